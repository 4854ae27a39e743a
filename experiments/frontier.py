#!/usr/bin/env python
"""The (i)/(ii) frontier of House Prices immunization (docs/findings.md §6): log (i) against log
(ii).

Per protocol and row set: the closed form over its exponent a (its RIR is the ceiling for every
a ≥ 0), Algorithm 1 over a λ_H × η grid per optimizer (with its training-row path) and the
baselines at their preset; the grid point closest to (i) ≥ 10, (ii) ≤ 0.1 on the strict protocol
(:func:`pycore._frontier.target_progress`) is re-run on ``--confirm-seeds``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from experiments import common
from pycore import METHODS
from pycore._frontier import (
    closed_form_frontier,
    frontier_ratios,
    regularizer_product,
    target_progress,
)
from pycore._linear_options import MAX_EPOCHS
from pycore.report import METHOD_LABELS, environment, fmt, save_figure

OUTPUTS = ("table.md", "frontier.png", "results.json")
BASELINES = tuple(m for m in METHODS if m not in ("identity", "closed_form"))
PRESET = {"paper": "house_price", "strict": "strict"}  # each protocol's preset
TARGET = (10.0, 0.1)
MAX_GRID = 20  # values of --lambda-h-grid and --lr-grid
MAX_EXPONENTS = 100  # closed-form exponents
MAX_RUNS = 10_000  # immunization runs of one invocation
# what the tables print of each run's options (a method that lacks one prints "—")
CONFIG_KEYS = ("optimizer", "lambda_h", "lambda_p", "lr", "epochs", "batch_size", "precond")


def build_parser() -> common.Parser:
    p = common.Parser("frontier.py", __doc__.split("\n\n")[0])
    p.add_argument(
        "--protocols",
        type=common.comma_list(choices=("paper", "strict")),
        default="paper,strict",
        help="protocols to place",
    )
    common.add_run_flags(
        p,
        "1",
        "results/frontier",
        "seeds of the grid and the baselines (the first selects the Algorithm-1 point)",
    )
    p.add_argument(
        "--confirm-seeds",
        type=common.seeds,
        default="5",
        metavar="N|A,B,C|A-B",
        help="seeds the selected Algorithm-1 configuration is re-run on",
    )
    p.add_argument(
        "--optimizers",
        type=common.comma_list(choices=("adam", "gd")),
        default="adam,gd",
        help="Algorithm 1's optimizers in the grid",
    )
    positive = common.real(0.0, lo_open=True)
    p.add_argument(
        "--lambda-h-grid",
        type=common.comma_list(positive, max_items=MAX_GRID),
        default="1e7,1e10,1e13",
        help="λ_H values of the grid",
    )
    p.add_argument(
        "--lr-grid",
        type=common.comma_list(positive, max_items=MAX_GRID),
        default="0.005,0.02",
        help="η values of the grid",
    )
    p.add_argument(
        "--gd-lambda-p",
        type=common.real(0.0),
        default=0.01,
        help="λ_P of the plain-GD grid (the paper's 100 makes GD diverge; Adam keeps the "
        "protocol's)",
    )
    p.add_argument(
        "--grid-epochs",
        type=common.count(1, MAX_EPOCHS),
        default=250,
        help="epochs of every grid run",
    )
    p.add_argument(
        "--exponents",
        type=common.comma_list(common.real(), max_items=MAX_EXPONENTS),
        help="closed-form exponents a (default: 27 values from -0.3 to 1)",
    )
    p.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the baselines (R_ill only, IMMA, Opt κ, …)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: one grid point per optimizer, 3 grid epochs, 5 exponents, no baselines, "
        "one confirmation seed",
    )
    common.add_house_price_data(p)
    p.add_argument("--no-plot", action="store_true", help="skip frontier.png")
    return p


def prepare(args) -> None:
    """The checks that involve several flags, before any compute."""
    if args.quick:
        args.lambda_h_grid, args.lr_grid, args.grid_epochs = (
            args.lambda_h_grid[:1],
            args.lr_grid[:1],
            3,
        )
        args.exponents = args.exponents or [0.0, 0.1, 0.2, 0.3, 0.5]
        args.no_baselines, args.confirm_seeds = True, args.confirm_seeds[:1]
    if args.exponents is None:
        args.exponents = [float(x) for x in np.round(np.linspace(-0.3, 1.0, 27), 4)]
    per_seed = len(args.optimizers) * len(args.lambda_h_grid) * len(args.lr_grid) + (
        0 if args.no_baselines else len(BASELINES)
    )
    runs = len(args.protocols) * per_seed * len(args.seeds) + len(args.confirm_seeds)
    if runs > MAX_RUNS:
        raise common.UsageError(
            f"{runs} immunization runs, more than {MAX_RUNS}; fewer seeds or grid values",
            "--seeds",
        )
    common.check_out(args.out, OUTPUTS)


def grid_options(optimizer, lambda_h, lr, epochs, gd_lambda_p) -> dict:
    """One Algorithm-1 grid point on top of its protocol's preset; λ_P = ``gd_lambda_p`` under
    plain GD."""
    kw = dict(optimizer=optimizer, lambda_h=float(lambda_h), lr=float(lr), epochs=int(epochs))
    return {**kw, "lambda_p": float(gd_lambda_p)} if optimizer == "gd" else kw


def _run_job(job):
    """Immunize one (protocol, method, config, seed) (a worker task: the tasks come in ``job``);
    ratios on both row sets, the training-row path from the history, the regularizer product, or
    the error that stopped it."""
    from pycore import immunize
    from pycore._immunization import resolve_options

    protocol, method, kw, seed, tag, (train, held) = job
    options = resolve_options(method, PRESET[protocol], **kw).to_dict()
    out = {
        "protocol": protocol,
        "method": method,
        "seed": seed,
        "tag": tag,
        "config": {k: options.get(k) for k in CONFIG_KEYS},
    }
    t0 = time.perf_counter()
    try:
        res = immunize(
            train, method, rng=np.random.default_rng(seed), preset=PRESET[protocol], **kw
        )
    # a diverging grid point is a result, not a crash
    except (ValueError, FloatingPointError) as exc:
        out.update(error=f"{type(exc).__name__}: {exc}", wall_seconds=time.perf_counter() - t0)
        return out
    out["train"] = frontier_ratios(res.theta, train).to_dict()
    if held is not None:
        out["heldout"] = frontier_ratios(res.theta, held).to_dict()
    out["regularizer_product"] = regularizer_product(res.theta, train)
    h = res.history
    if h.get("kappa_P") and h.get("kappa_H"):
        kP, kH = np.asarray(h["kappa_P"], float), np.asarray(h["kappa_H"], float)
        idx = np.unique(np.linspace(0, kP.size - 1, min(kP.size, 200)).astype(int))
        out["path"] = {
            "epoch": [int(h.get("epoch", h.get("step"))[i]) for i in idx],
            "harmful_ratio": (kH[idx] / kH[0]).tolist(),
            "pretrain_ratio": (kP[idx] / kP[0]).tolist(),
        }
    out["progress"] = target_progress(
        out["train"]["harmful_ratio"], out["train"]["pretrain_ratio"], TARGET
    )
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def run(args) -> dict:
    from pycore import def31_exponent_window, rir_ceiling, strict_protocol

    t_start = time.perf_counter()
    data = common.load_house_price_data(args)
    if data.heldout is None:
        raise ValueError(
            f"House Prices: --n-train {args.n_train} leaves no held-out rows (lower it)"
        )
    tasks, closed, windows = {}, {}, {}
    for prot in args.protocols:
        train, held = data.train, data.heldout
        if prot == "strict":
            train, held, _ = strict_protocol(train, held, data.feature_names)
        tasks[prot] = (train, held)
        ceiling = rir_ceiling(train.X_P, train.X_H)
        w = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
        windows[prot] = (
            None
            if w is None
            else {**w.to_dict(), "ceiling_range_restricted": ceiling.range_restricted}
        )
        closed[prot] = [p.to_dict() for p in closed_form_frontier(train, held, args.exponents)]
    seed0 = args.seeds[0]
    jobs = []
    for prot in args.protocols:
        jobs += [
            (
                prot,
                "ours",
                grid_options(opt, lh, lr, args.grid_epochs, args.gd_lambda_p),
                s,
                "grid",
                tasks[prot],
            )
            for opt in args.optimizers
            for lh in args.lambda_h_grid
            for lr in args.lr_grid
            for s in args.seeds
        ]
        jobs += [
            (prot, m, {}, s, "baseline", tasks[prot])
            for m in (() if args.no_baselines else BASELINES)
            for s in args.seeds
        ]
    runs = common.pool_map(_run_job, jobs, args.jobs, desc="immunizing")
    print(f"frontier: {len(runs)} runs ({time.perf_counter() - t_start:.0f}s)", flush=True)
    # the Algorithm-1 point: best progress on strict (else the first protocol), seed0, training
    # rows
    sel_prot = "strict" if "strict" in args.protocols else args.protocols[0]
    cands = [
        r
        for r in runs
        if r["tag"] == "grid"
        and r["protocol"] == sel_prot
        and r["seed"] == seed0
        and "error" not in r
    ]
    selected = max(cands, key=lambda r: r["progress"]) if cands else None
    confirm = []
    if selected is not None:
        c = selected["config"]
        kw = grid_options(c["optimizer"], c["lambda_h"], c["lr"], c["epochs"], args.gd_lambda_p)
        jobs = [(sel_prot, "ours", kw, s, "confirm", tasks[sel_prot]) for s in args.confirm_seeds]
        confirm = common.pool_map(_run_job, jobs, args.jobs, desc="confirming")
    return {
        "experiment": "frontier",
        "dataset": "house_prices",
        "source": data.source,
        "data_changes": data.changes(),
        "protocols": args.protocols,
        "seeds": args.seeds,
        "confirm_seeds": args.confirm_seeds,
        "target": {"harmful_ratio_at_least": TARGET[0], "pretrain_ratio_at_most": TARGET[1]},
        "grid": {
            "optimizers": args.optimizers,
            "lambda_h": args.lambda_h_grid,
            "lr": args.lr_grid,
            "epochs": args.grid_epochs,
            "gd_lambda_p": args.gd_lambda_p,
            "other settings": "each protocol's preset ('house_price' / 'strict'): "
            "batch, preconditioner, init = identity (no warm start)",
        },
        "closed_form": closed,
        "exponent_window": windows,
        "runs": runs,
        "selected": None
        if selected is None
        else {
            "protocol": sel_prot,
            "config": selected["config"],
            "rule": f"largest target_progress on training rows, seed {seed0}",
            "confirm": confirm,
        },
        **environment(),
        "wall_seconds": time.perf_counter() - t_start,
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
    pts = [
        (target_progress(a, b, TARGET), e, a, b)
        for e, a, b in zip(p["epoch"], p["harmful_ratio"], p["pretrain_ratio"])
    ]
    return max(pts, key=lambda x: x[0])


def _setting(value) -> str:
    """An option as run; "—" for one the method does not have."""
    return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _ratios(r, rows="train") -> list[str]:
    return [fmt(r[rows]["harmful_ratio"]), fmt(r[rows]["pretrain_ratio"])]


def table_markdown(res: dict) -> str:
    g = res["grid"]
    L = [
        "# The (i)/(ii) frontier, House Prices\n",
        f"Command: `{' '.join(res['command'][1:])}`  \n(i) = κ(H_H(θ))/κ(H_H(I)) ↑, (ii) = "
        "κ(H_P(θ))/κ(H_P(I)) ↓ (RIR = (i)/(ii)); target region (i) ≥ 10, (ii) ≤ 0.1; progress = "
        "min(log (i)/log 10, log (ii)/log 0.1) (≥ 1 inside the region). Grid: optimizers "
        f"{g['optimizers']}, λ_H ∈ {g['lambda_h']}, η ∈ {g['lr']}, "
        f"{g['epochs']} epochs, λ_P of GD {g['gd_lambda_p']:g}; {g['other settings']}. R·R = "
        "R_well(H_P)·R_ill(H_H), the paper's regularizer term at its best scale up to 2√(λ_Pλ_H) "
        "(pycore.regularizer_product: lower = preferred by Algorithm 1's objective).\n",
    ]
    for prot in res["protocols"]:
        cf, w = res["closed_form"][prot], res["exponent_window"][prot]
        L.append(f"## {prot} protocol\n")
        if w:
            L.append(
                f"Closed form: Definition 3.1 window {fmt(w['low'])} ≤ a < "
                f"{fmt(w['high'])}, balanced "
                f"a = {fmt(w['balanced'])}; range-restricted ceiling "
                f"{fmt(w['ceiling_range_restricted'])}.\n"
            )
        L += [
            "| closed form a | (i) | (ii) | RIR | held-out (i) | held-out (ii) | "
            "held-out RIR | R·R |",
            "|---|---|---|---|---|---|---|---|",
        ]
        L += [
            " | ".join(
                [
                    f"| {p['exponent']:g}",
                    *_ratios(p),
                    fmt(p["train"]["rir"]),
                    *_ratios(p, "heldout"),
                    fmt(p["heldout"]["rir"]),
                    fmt(p["regularizer_product"]),
                ]
            )
            + " |"
            for p in cf
        ]
        best = min(cf, key=lambda p: p["regularizer_product"])
        L += [
            "\nAlong the frontier the paper's objective is lowest at a = "
            f"{best['exponent']:g} ((i) "
            f"{fmt(best['train']['harmful_ratio'])}, (ii) "
            f"{fmt(best['train']['pretrain_ratio'])}).\n",
            "| run | seed | optimizer | λ_H | λ_P | η | epochs | (i) | (ii) | RIR | "
            "progress | best on "
            "path (epoch) | held-out (i) | held-out (ii) | R·R |",
            "|---" * 15 + "|",
        ]
        for r in (r for r in res["runs"] if r["protocol"] == prot):
            c = r["config"]
            name = METHOD_LABELS[r["method"]] if r["tag"] == "baseline" else "Alg. 1 grid"
            cfg = [_setting(c[k]) for k in ("optimizer", "lambda_h", "lambda_p", "lr", "epochs")]
            head = f"| {name} | {r['seed']} | " + " | ".join(cfg) + " | "
            if "error" in r:
                L.append(head + f"failed: {r['error'][:80]} | | | | | | | |")
                continue
            pb = path_best(r)
            pbt = "—" if pb is None else f"{pb[0]:.3f} ({pb[1]})"
            L.append(
                head
                + " | ".join(
                    [
                        *_ratios(r),
                        fmt(r["train"]["rir"]),
                        f"{r['progress']:.3f}",
                        pbt,
                        *_ratios(r, "heldout"),
                        fmt(r["regularizer_product"]),
                    ]
                )
                + " |"
            )
        L.append("")
    if sel := res.get("selected"):
        c, ok = sel["config"], {}
        L += [
            f"## Selected Algorithm-1 configuration ({sel['protocol']}; rule: {sel['rule']})\n",
            f"{c['optimizer']}, λ_H {c['lambda_h']:g}, λ_P {c['lambda_p']:g}, η "
            f"{c['lr']:g}, {c['epochs']} "
            f"epochs, batch {c['batch_size']}, preconditioner {c['precond']}, init identity.\n",
            "| seed | (i) | (ii) | RIR | in target region | held-out (i) | held-out (ii) |",
            "|---" * 7 + "|",
        ]
        for r in sel["confirm"]:
            if "error" in r:
                L.append(f"| {r['seed']} | failed: {r['error'][:80]} | | | | | |")
                continue
            ok[r["seed"]] = (
                r["train"]["harmful_ratio"] >= TARGET[0]
                and r["train"]["pretrain_ratio"] <= TARGET[1]
            )
            L.append(
                " | ".join(
                    [
                        f"| {r['seed']}",
                        *_ratios(r),
                        fmt(r["train"]["rir"]),
                        "yes" if ok[r["seed"]] else "no",
                        *_ratios(r, "heldout"),
                    ]
                )
                + " |"
            )
        met = len(ok) == len(sel["confirm"]) and all(ok.values())
        L.append(f"\nTarget (i) ≥ 10 and (ii) ≤ 0.1 on every seed: {'met' if met else 'NOT met'}.")
        paths = [
            (path_best(r), r)
            for r in res["runs"] + sel["confirm"]
            if r["protocol"] == sel["protocol"] and r["method"] == "ours" and path_best(r)
        ]
        if paths:
            (pg, ep, a, b), r = max(paths, key=lambda x: x[0][0])
            L.append(
                f"Closest any recorded {sel['protocol']} Algorithm-1 path comes to the "
                "region: progress "
                f"{pg:.3f} at epoch {ep} ((i) {fmt(a)}, (ii) {fmt(b)}; "
                f"{r['config']['optimizer']}, λ_H "
                f"{r['config']['lambda_h']:g}, η {r['config']['lr']:g}, seed {r['seed']}).\n"
            )
    return "\n".join(L) + "\n"


def plot_frontier(res: dict, path) -> None:
    """One row per protocol, training and held-out rows side by side; one legend, right of the
    panels."""
    plt = common.pyplot()
    prots = res["protocols"]
    fig, axes = plt.subplots(len(prots), 2, figsize=(14, 5.2 * len(prots)), squeeze=False)
    markers = {
        "r_ill_only": "v",
        "imma": "s",
        "opt_kappa": "D",
        "opt_kappa_balanced": "P",
        "ours": "*",
    }
    handles = {}
    for i, prot in enumerate(prots):
        runs = [r for r in res["runs"] if r["protocol"] == prot and "error" not in r]
        for j, rows in enumerate(("train", "heldout")):
            ax = axes[i][j]
            cf = res["closed_form"][prot]
            x, y = [p[rows]["harmful_ratio"] for p in cf], [p[rows]["pretrain_ratio"] for p in cf]
            ax.plot(
                x,
                y,
                "-",
                color="k",
                lw=1.6,
                label="closed form over a (frontier on training rows)",
            )
            for opt, color in (("adam", "tab:blue"), ("gd", "tab:orange")):
                g = [r for r in runs if r["tag"] == "grid" and r["config"]["optimizer"] == opt]
                if g:
                    ax.scatter(
                        [_pt(r, rows)[0] for r in g],
                        [_pt(r, rows)[1] for r in g],
                        s=22,
                        color=color,
                        label=f"Algorithm 1 grid ({opt})",
                        zorder=3,
                    )
                for r in g if rows == "train" else ():
                    if "path" in r:
                        ax.plot(
                            r["path"]["harmful_ratio"],
                            r["path"]["pretrain_ratio"],
                            "-",
                            color=color,
                            lw=0.5,
                            alpha=0.35,
                        )
            for r in runs:
                if r["tag"] == "baseline":
                    ax.scatter(
                        *_pt(r, rows),
                        marker=markers.get(r["method"], "x"),
                        s=60,
                        color="tab:red",
                        edgecolor="k",
                        zorder=4,
                        label=METHOD_LABELS[r["method"]],
                    )
            sel = res.get("selected")
            if sel and sel["protocol"] == prot:
                ok = [r for r in sel["confirm"] if "error" not in r]
                ax.scatter(
                    [_pt(r, rows)[0] for r in ok],
                    [_pt(r, rows)[1] for r in ok],
                    marker="*",
                    s=120,
                    color="gold",
                    edgecolor="k",
                    zorder=5,
                    label="selected Alg. 1, every seed",
                )
            ax.fill_between(
                [TARGET[0], 1e12],
                1e-12,
                TARGET[1],
                color="tab:green",
                alpha=0.08,
                label="target (i) ≥ 10, (ii) ≤ 0.1",
            )
            ax.axvline(1, color="0.6", lw=0.7)
            ax.axhline(1, color="0.6", lw=0.7)
            ax.set(xscale="log", yscale="log")
            allx, ally = x + [_pt(r, rows)[0] for r in runs], y + [_pt(r, rows)[1] for r in runs]
            ax.set_xlim(min(allx) / 2, max(allx) * 2)
            ax.set_ylim(min(ally) / 2, max(ally) * 2)
            ax.set_xlabel("(i) = κ(H_H(θ)) / κ(H_H(I))  (↑ harmful harder)")
            ax.set_ylabel("(ii) = κ(H_P(θ)) / κ(H_P(I))  (↓ pre-training easier)")
            ax.set_title(
                f"{prot} protocol, {'training' if rows == 'train' else 'held-out'} rows",
                fontsize=10,
            )
            handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(
        handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(0.78, 0.95), fontsize=8
    )
    fig.suptitle(
        f"House Prices ({res['source'].rsplit('/', 1)[-1]}), linear θ: closed form, "
        "Algorithm 1 and "
        "the baselines in the (i)/(ii) plane (constant RIR = lines of slope 1)",
        fontsize=11,
    )
    save_figure(fig, path, rect=(0, 0, 0.77, 0.96))  # the legend's column stays free of data


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        prepare(args)
        res = run(args)
        common.write_run(
            args.out,
            table_markdown(res),
            res,
            {"frontier.png": None if args.no_plot else lambda p: plot_frontier(res, p)},
        )

    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
