"""The (i)/(ii) frontier of House Prices immunization (docs/attacks.md §3): log (i) against log (ii).

Points, per protocol (paper and strict) and per row set (training, held-out): the optimal closed
form over its exponent a (s² = λ_C^a; its RIR is the ceiling for every a ≥ 0, so it is the
frontier), Algorithm 1 (the paper's objective) over a λ_H × η grid for each optimizer in
``--optimizers``, and every baseline at its protocol's configuration. The training-row path of
every Algorithm-1 run (per epoch, from its history) is drawn too.

Algorithm-1 point: from the grid on the STRICT protocol, seed ``--seeds``' first, training rows,
the configuration with the largest progress towards (i) ≥ 10, (ii) ≤ 0.1
(:func:`pycore.frontier.target_progress`: ≥ 1 inside the region) is re-run on every seed of
``--confirm-seeds`` and reported per seed. :func:`pycore.frontier.regularizer_product` along
the closed-form frontier says which balance the paper's objective itself prefers.

    python experiments/frontier.py                 # both protocols (a few minutes)
    python experiments/frontier.py --quick         # CI smoke test

Writes ``results.json``, ``table.md`` and ``frontier.png``.
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
import time
from pathlib import Path

import numpy as np

from experiments import cli
from pycore.frontier import closed_form_frontier, ratios, regularizer_product, target_progress
from pycore.immunize import METHODS
from pycore.report import METHOD_LABELS, environment, fmt

OUTPUTS = ("results.json", "table.md", "frontier.png")
BASELINES = tuple(m for m in METHODS if m not in ("identity", "closed_form"))
TARGET = (10.0, 0.1)
_STATE: dict = {}


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="frontier.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocols", type=cli.choice_list(("paper", "strict"), "protocol"),
                   default="paper,strict",
                   help="protocols to place (default paper,strict)")
    cli.add_seeds(p, "1", "seeds of the grid and the baselines (the first one selects the Algorithm-1 point)")
    p.add_argument("--confirm-seeds", type=cli.seeds, default="5", metavar="N|A,B,C|A-B",
                   help="seeds the selected Algorithm-1 configuration is re-run on (default 5: 0-4)")
    p.add_argument("--optimizers", type=cli.choice_list(("adam", "gd"), "optimizer"), default="adam,gd",
                   help="Algorithm 1's optimizers in the grid (default adam,gd)")
    p.add_argument("--lambda-h-grid", type=cli.number_list(0.0, open_interval=False), default="1e7,1e10,1e13",
                   help="λ_H values of the grid (default 1e7,1e10,1e13)")
    p.add_argument("--lr-grid", type=cli.number_list(0.0, open_interval=False), default="0.005,0.02",
                   help="η values of the grid (default 0.005,0.02)")
    p.add_argument("--gd-lambda-p", type=cli.real(0.0), default=0.01,
                   help="λ_P of the plain-GD grid (default 0.01: the paper's 100 makes the R_well step "
                        "η·λ_P·σ_max(K_P) ≫ 1 and GD diverges; Adam keeps the protocol's λ_P)")
    p.add_argument("--grid-epochs", type=cli.integer(1), default=250,
                   help="epochs of every grid run (default 250 = 1000 steps with batch 64 on 200 rows)")
    p.add_argument("--exponents", type=cli.number_list(), default=None,
                   help="closed-form exponents a (default: 27 values from -0.3 to 1)")
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines (R_ill only, IMMA, Opt "
                                                               "κ, …)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: one grid point per optimizer, 3 grid epochs, 5 exponents, no baselines, "
                        "one confirmation seed")
    p.add_argument("--data", type=cli.existing_path("file"), default=None,
                   help="Kaggle House Prices train.csv (default: packaged copy)")
    p.add_argument("--on-outlier", choices=("warn", "error"), default="warn",
                   help="a cell > 1e6 × its column's median magnitude: warn (default) or refuse the file")
    p.add_argument("--n-train", type=cli.integer(2), default=200, help="training rows per split (paper: 200)")
    p.add_argument("--out", type=Path, default=Path("results/frontier"),
                   help="output folder (replaced as a whole by this run's " + ", ".join(OUTPUTS) + ")")
    p.add_argument("--no-plot", action="store_true", help="skip frontier.png")
    cli.add_jobs(p, "immunization runs")
    return p


def prepare(args) -> None:
    if args.quick:
        args.lambda_h_grid, args.lr_grid, args.grid_epochs = args.lambda_h_grid[:1], args.lr_grid[:1], 3
        args.exponents = args.exponents or [0.0, 0.1, 0.2, 0.3, 0.5]
        args.no_baselines, args.confirm_seeds = True, args.confirm_seeds[:1]
    if args.exponents is None:
        args.exponents = [float(x) for x in np.round(np.linspace(-0.3, 1.0, 27), 4)]
    if any(x <= 0 for x in args.lambda_h_grid + args.lr_grid):
        raise cli.UsageError("grid values must be > 0", "--lambda-h-grid" if any(
            x <= 0 for x in args.lambda_h_grid) else "--lr-grid")


def base_config(protocol: str) -> cli.Settings:
    return cli.Settings("strict" if protocol == "strict" else "house_price")


def grid_config(protocol, optimizer, lambda_h, lr, epochs, gd_lambda_p) -> cli.Settings:
    """One Algorithm-1 grid point: the protocol's configuration with (optimizer, λ_H, η, epochs)
    replaced, and λ_P = ``gd_lambda_p`` under plain GD."""
    kw = dict(optimizer=optimizer, lambda_h=float(lambda_h), lr=float(lr), epochs=int(epochs))
    if optimizer == "gd":
        kw["lambda_p"] = float(gd_lambda_p)
    return cli.Settings(base_config(protocol).preset, kw)


def _run_job(job):
    """Immunize one (protocol, method, config, seed); ratios on both row sets, the training-row
    path from the history, the regularizer product, or the error that stopped it."""
    protocol, method, cfg, seed, tag = job
    train, held = _STATE["tasks"][protocol]
    out = {"protocol": protocol, "method": method, "seed": seed, "tag": tag,
           "config": {k: getattr(cfg, k) for k in ("optimizer", "lambda_h", "lambda_p", "lr", "epochs",
                                                   "batch_size", "precond")}}
    t0 = time.perf_counter()
    try:
        res = cfg.run(train, method, np.random.default_rng(seed))
    except (ValueError, FloatingPointError) as exc:     # a diverging grid point is a result, not a crash
        out.update(error=f"{type(exc).__name__}: {exc}", wall_seconds=time.perf_counter() - t0)
        return out
    out.update(ratios(res.theta, train, held))
    out["regularizer_product"] = regularizer_product(res.theta, train)
    h = res.history
    if h.get("kappa_P") and h.get("kappa_H"):
        kP, kH = np.asarray(h["kappa_P"], float), np.asarray(h["kappa_H"], float)
        idx = np.unique(np.linspace(0, kP.size - 1, min(kP.size, 200)).astype(int))
        out["path"] = {"epoch": [int(h.get("epoch", h.get("step"))[i]) for i in idx],
                       "harmful_ratio": (kH[idx] / kH[0]).tolist(),
                       "pretrain_ratio": (kP[idx] / kP[0]).tolist()}
    out["progress"] = target_progress(out["train"]["harmful_ratio"], out["train"]["pretrain_ratio"], TARGET)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def run(args) -> dict:
    from pycore.data.house_price import load_house_price
    from pycore.metrics import def31_exponent_window, rir_ceiling
    from pycore.protocol import strict_protocol

    t_start = time.perf_counter()
    data = load_house_price(args.data, n_train=args.n_train, on_outlier=args.on_outlier)
    if data.heldout is None:
        raise ValueError(f"House Prices: --n-train {args.n_train} leaves no held-out rows (lower it)")
    tasks, closed, windows = {}, {}, {}
    for prot in args.protocols:
        train, held = data.train, data.heldout
        if prot == "strict":
            train, held, _ = strict_protocol(train, held, data.feature_names)
        tasks[prot] = (train, held)
        ceiling = rir_ceiling(train.X_P, train.X_H)
        w = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
        windows[prot] = None if w is None else {**w.as_dict(),
                                                "ceiling_range_restricted": ceiling.range_restricted}
        closed[prot] = closed_form_frontier(train, held, args.exponents)
    _STATE["tasks"] = tasks
    seed0 = args.seeds[0]
    jobs = []
    for prot in args.protocols:
        for opt in args.optimizers:
            for lh in args.lambda_h_grid:
                for lr in args.lr_grid:
                    cfg = grid_config(prot, opt, lh, lr, args.grid_epochs, args.gd_lambda_p)
                    jobs += [(prot, "ours", cfg, s, "grid") for s in args.seeds]
        if not args.no_baselines:
            for m in BASELINES:
                jobs += [(prot, m, base_config(prot), s, "baseline") for s in args.seeds]
    runs = cli.parallel_map(_run_job, jobs, args.jobs, desc="immunizing", unit="run")
    print(f"frontier: {len(runs)} runs ({time.perf_counter() - t_start:.0f}s)", flush=True)
    # the Algorithm-1 point: best progress on strict (else the first protocol), seed0, training rows
    sel_prot = "strict" if "strict" in args.protocols else args.protocols[0]
    cands = [r for r in runs if r["tag"] == "grid" and r["protocol"] == sel_prot and r["seed"] == seed0
             and "error" not in r]
    selected = max(cands, key=lambda r: r["progress"]) if cands else None
    confirm = []
    if selected is not None:
        c = selected["config"]
        cfg = grid_config(sel_prot, c["optimizer"], c["lambda_h"], c["lr"], c["epochs"], args.gd_lambda_p)
        jobs = [(sel_prot, "ours", cfg, s, "confirm") for s in args.confirm_seeds]
        confirm = cli.parallel_map(_run_job, jobs, args.jobs, desc="confirming", unit="run")
    return {
        "experiment": "frontier", "dataset": "house_prices", "source": data.source,
        "protocols": args.protocols, "seeds": args.seeds, "confirm_seeds": args.confirm_seeds,
        "target": {"harmful_ratio_at_least": TARGET[0], "pretrain_ratio_at_most": TARGET[1]},
        "grid": {"optimizers": args.optimizers, "lambda_h": args.lambda_h_grid, "lr": args.lr_grid,
                 "epochs": args.grid_epochs, "gd_lambda_p": args.gd_lambda_p,
                 "other settings": "each protocol's preset ('house_price' / 'strict'): "
                                   "batch, preconditioner, init = identity (no warm start)"},
        "closed_form": closed, "exponent_window": windows, "runs": runs,
        "selected": None if selected is None else {"protocol": sel_prot, "config": selected["config"],
                                                   "rule": "largest target_progress on training rows, "
                                                           f"seed {seed0}", "confirm": confirm},
        **environment(), "wall_seconds": time.perf_counter() - t_start,
    }


# ----------------------------------------------------------------------------------------------
def _pt(r, rows="train"):
    return r[rows]["harmful_ratio"], r[rows]["pretrain_ratio"]


def path_best(r) -> tuple[float, int, float, float] | None:
    """The point of a run's recorded training-row path (≤ 200 epochs, evenly sampled) closest to
    the target region: ``(progress, epoch, (i), (ii))``; None without a path."""
    p = r.get("path")
    if not p:
        return None
    pts = [(target_progress(a, b, TARGET), e, a, b)
           for e, a, b in zip(p["epoch"], p["harmful_ratio"], p["pretrain_ratio"])]
    return max(pts, key=lambda x: x[0])


def table_markdown(res: dict) -> str:
    L = ["# The (i)/(ii) frontier, House Prices\n",
         f"Command: `{' '.join(res['command'][1:])}`  \n"
         "(i) = κ(H_H(θ))/κ(H_H(I)) ↑, (ii) = κ(H_P(θ))/κ(H_P(I)) ↓ (RIR = (i)/(ii)); target region (i) ≥ "
         "10, "
         "(ii) ≤ 0.1; progress = min(log (i)/log 10, log (ii)/log 0.1) (≥ 1 inside the region). Grid: "
         f"optimizers {res['grid']['optimizers']}, λ_H ∈ {res['grid']['lambda_h']}, η ∈ {res['grid']['lr']}, "
         f"{res['grid']['epochs']} epochs, λ_P of GD {res['grid']['gd_lambda_p']:g}; "
         f"{res['grid']['other settings']}. "
         "R·R = R_well(H_P)·R_ill(H_H), the paper's regularizer term at its best scale up to 2√(λ_Pλ_H) "
         "(pycore.frontier.regularizer_product: lower = preferred by Algorithm 1's objective).\n"]
    for prot in res["protocols"]:
        cf = res["closed_form"][prot]
        w = res["exponent_window"][prot]
        L.append(f"## {prot} protocol\n")
        if w:
            L.append(f"Closed form: Definition 3.1 window {fmt(w['low'])} ≤ a < {fmt(w['high'])}, balanced "
                     "a = "
                     f"{fmt(w['balanced'])}; range-restricted ceiling "
                     f"{fmt(w['ceiling_range_restricted'])}.\n")
        L.append("| closed form a | (i) | (ii) | RIR | held-out (i) | held-out (ii) | held-out RIR | R·R |")
        L.append("|---|---|---|---|---|---|---|---|")
        for p in cf:
            L.append(f"| {p['exponent']:g} | {fmt(p['train']['harmful_ratio'])} | "
                     f"{fmt(p['train']['pretrain_ratio'])} | "
                     f"{fmt(p['train']['rir'])} | {fmt(p['heldout']['harmful_ratio'])} | "
                     f"{fmt(p['heldout']['pretrain_ratio'])} | {fmt(p['heldout']['rir'])} | "
                     f"{fmt(p['regularizer_product'])} |")
        best = min(cf, key=lambda p: p["regularizer_product"])
        L.append(f"\nAlong the frontier the paper's objective is lowest at a = {best['exponent']:g} "
                 f"((i) {fmt(best['train']['harmful_ratio'])}, (ii) "
                 f"{fmt(best['train']['pretrain_ratio'])}).\n")
        L.append("| run | seed | optimizer | λ_H | λ_P | η | epochs | (i) | (ii) | RIR | progress | "
                 "best on path (epoch) | held-out (i) | held-out (ii) | R·R |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["runs"]:
            if r["protocol"] != prot:
                continue
            c = r["config"]
            name = METHOD_LABELS[r['method']] if r['tag'] == 'baseline' else 'Alg. 1 grid'
            head = (f"| {name} | {r['seed']} | "
                    f"{c['optimizer']} | "
                    f"{c['lambda_h']:g} | {c['lambda_p']:g} | {c['lr']:g} | {c['epochs']} | ")
            if "error" in r:
                L.append(head + f"failed: {r['error'][:80]} | | | | | | | |")
                continue
            pb = path_best(r)
            pbt = "—" if pb is None else f"{pb[0]:.3f} ({pb[1]})"
            L.append(head + f"{fmt(r['train']['harmful_ratio'])} | {fmt(r['train']['pretrain_ratio'])} | "
                     f"{fmt(r['train']['rir'])} | {r['progress']:.3f} | {pbt} | "
                     f"{fmt(r['heldout']['harmful_ratio'])} | "
                     f"{fmt(r['heldout']['pretrain_ratio'])} | {fmt(r['regularizer_product'])} |")
        L.append("")
    sel = res.get("selected")
    if sel:
        c = sel["config"]
        L.append(f"## Selected Algorithm-1 configuration ({sel['protocol']}; rule: {sel['rule']})\n")
        L.append(f"{c['optimizer']}, λ_H {c['lambda_h']:g}, λ_P {c['lambda_p']:g}, η {c['lr']:g}, "
                 f"{c['epochs']} "
                 f"epochs, batch {c['batch_size']}, preconditioner {c['precond']}, init identity.\n")
        L.append("| seed | (i) | (ii) | RIR | in target region | held-out (i) | held-out (ii) |")
        L.append("|---|---|---|---|---|---|---|")
        for r in sel["confirm"]:
            if "error" in r:
                L.append(f"| {r['seed']} | failed: {r['error'][:80]} | | | | | |")
                continue
            ok = r["train"]["harmful_ratio"] >= TARGET[0] and r["train"]["pretrain_ratio"] <= TARGET[1]
            L.append(f"| {r['seed']} | {fmt(r['train']['harmful_ratio'])} | "
                     f"{fmt(r['train']['pretrain_ratio'])} | {fmt(r['train']['rir'])} | "
                     f"{'yes' if ok else 'no'} | {fmt(r['heldout']['harmful_ratio'])} | "
                     f"{fmt(r['heldout']['pretrain_ratio'])} |")
        ok_all = all("error" not in r and r["train"]["harmful_ratio"] >= TARGET[0]
                     and r["train"]["pretrain_ratio"] <= TARGET[1] for r in sel["confirm"])
        L.append(f"\nTarget (i) ≥ 10 and (ii) ≤ 0.1 on every seed: {'met' if ok_all else 'NOT met'}.")
        paths = [(path_best(r), r) for r in res["runs"] + sel["confirm"]
                 if r["protocol"] == sel["protocol"] and r["method"] == "ours" and path_best(r)]
        if paths:
            (pg, ep, a, b), r = max(paths, key=lambda x: x[0][0])
            c = r["config"]
            L.append(f"Closest any recorded {sel['protocol']} Algorithm-1 path comes to the region: "
                     f"progress {pg:.3f} at epoch {ep} ((i) {fmt(a)}, (ii) {fmt(b)}; {c['optimizer']}, "
                     f"λ_H {c['lambda_h']:g}, η {c['lr']:g}, seed {r['seed']}).\n")
    return "\n".join(L) + "\n"


def plot_frontier(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pycore.report import save_figure

    prots = res["protocols"]
    fig, axes = plt.subplots(len(prots), 2, figsize=(12, 5.2 * len(prots)), squeeze=False)
    markers = {"r_ill_only": "v", "imma": "s", "opt_kappa": "D", "opt_kappa_balanced": "P", "ours": "*"}
    for i, prot in enumerate(prots):
        for j, rows in enumerate(("train", "heldout")):
            ax = axes[i][j]
            cf = res["closed_form"][prot]
            x = [p[rows]["harmful_ratio"] for p in cf]
            y = [p[rows]["pretrain_ratio"] for p in cf]
            ax.plot(x, y, "-", color="k", lw=1.6, label="closed form over a (frontier on training rows)")
            for p in cf:
                if abs(p["exponent"]) < 1e-12:
                    ax.plot(p[rows]["harmful_ratio"], p[rows]["pretrain_ratio"], "o", color="k", ms=5)
            grid = [r for r in res["runs"]
                    if r["protocol"] == prot and r["tag"] == "grid" and "error" not in r]
            for opt, color in (("adam", "tab:blue"), ("gd", "tab:orange")):
                g = [r for r in grid if r["config"]["optimizer"] == opt]
                if not g:
                    continue
                ax.scatter([_pt(r, rows)[0] for r in g], [_pt(r, rows)[1] for r in g], s=22, color=color,
                           label=f"Algorithm 1 grid ({opt})", zorder=3)
                if rows == "train":
                    for r in g:
                        if "path" in r:
                            ax.plot(r["path"]["harmful_ratio"], r["path"]["pretrain_ratio"], "-", color=color,
                                    lw=0.5, alpha=0.35)
            for r in res["runs"]:
                if r["protocol"] == prot and r["tag"] == "baseline" and "error" not in r:
                    ax.scatter(*_pt(r, rows), marker=markers.get(r["method"], "x"), s=60, color="tab:red",
                               edgecolor="k", zorder=4, label=METHOD_LABELS[r["method"]])
            sel = res.get("selected")
            if sel and sel["protocol"] == prot:
                ok = [r for r in sel["confirm"] if "error" not in r]
                ax.scatter([_pt(r, rows)[0] for r in ok], [_pt(r, rows)[1] for r in ok], marker="*", s=120,
                           color="gold", edgecolor="k", zorder=5, label="selected Alg. 1, every seed")
            ax.fill_between([TARGET[0], 1e12], 1e-12, TARGET[1], color="tab:green", alpha=0.08,
                            label="target (i) ≥ 10, (ii) ≤ 0.1")
            ax.axvline(1, color="0.6", lw=0.7)
            ax.axhline(1, color="0.6", lw=0.7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            allx = x + [_pt(r, rows)[0] for r in res["runs"] if r["protocol"] == prot and "error" not in r]
            ally = y + [_pt(r, rows)[1] for r in res["runs"] if r["protocol"] == prot and "error" not in r]
            ax.set_xlim(min(allx) / 2, max(allx) * 2)
            ax.set_ylim(min(ally) / 2, max(ally) * 2)
            ax.set_xlabel("(i) = κ(H_H(θ)) / κ(H_H(I))  (↑ harmful harder)")
            ax.set_ylabel("(ii) = κ(H_P(θ)) / κ(H_P(I))  (↓ pre-training easier)")
            ax.set_title(f"{prot} protocol, {'training' if rows == 'train' else 'held-out'} rows",
                         fontsize=10)
            h, lab = ax.get_legend_handles_labels()
            uniq = dict(zip(lab, h))
            ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="lower right")
    fig.suptitle("House Prices: the (i)/(ii) plane (RIR = (i)/(ii); constant RIR = lines of slope 1)",
                 fontsize=11)
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        prepare(args)
        with cli.OutputSet(args.out, OUTPUTS) as outs:
            res = run(args)
            table = table_markdown(res)
            written = cli.write_set(outs, res, table, None if args.no_plot else plot_frontier, "frontier.png")
            outs.commit()
        print(table)
        print("wrote " + ", ".join(str(p) for p in written) + f" in {res['wall_seconds']:.0f}s")
        return cli.EXIT_OK
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
