"""Attack suite on House Prices (docs/theory.md §10): how many steps does each linear-probing attacker need?

For identity and every immunizer of :data:`pycore.immunize.METHODS`, probe the features
``Z = Xθ`` of D_H (harmful, ``SalePrice``) and D_P (pre-training, ``LotArea``), on the rows used
to immunize ("train") and on the rows never seen ("held-out"), with every attacker of
:mod:`pycore.attacks`, and count the steps to a relative suboptimality ε. The slow-down factor
is ``steps(θ_I)/steps(identity)``: > 1 on D_H is what immunization promises, ≤ 1 on D_P is what
it must keep (paper Figure 1 / Definition 3.1).

    python experiments/attacks.py                       # 1 seed, cap 20000 steps (~1 min)
    python experiments/attacks.py --seeds 3 --max-steps 50000
    python experiments/attacks.py --certified           # immunize in certified-monotone mode

Writes ``results/attacks/results.json`` (every number, the command line, versions),
``table.md`` and ``curves.png``.
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import math
import sys
import time
from pathlib import Path

import numpy as np

from experiments import cli
from pycore import attacks as A
from pycore.immunize import METHODS, ImmunizeConfig
from pycore.report import METHOD_LABELS, environment

ROWS = ("train", "heldout")
# Step cap of an attacker: its trajectory stores a loss per step, and 8 attackers run on 4 problems
# per (method, seed); 50× the default cap, ample for ε = 1e-6 on House Prices (docs/cli.md).
MAX_STEPS = 1_000_000
TASKS = ("D_H", "D_P")


# ----------------------------------------------------------------------------------------------
def build_parser() -> cli.Parser:
    p = cli.Parser(prog="attacks.py", description=__doc__.split("\n\n")[0])
    cli.add_seeds(p, "1", "immunization seeds")
    p.add_argument("--methods", type=cli.choice_list(METHODS, "method"), default=",".join(METHODS),
                   help="comma list of immunizers to attack (default: all of pycore.immunize.METHODS; "
                        "identity is always added)")
    lsq = A.attackers_for("lsq")
    p.add_argument("--attackers", type=cli.choice_list(lsq, "least-squares attacker"), default=",".join(lsq),
                   help=f"comma list of attackers (default: all for least squares: {','.join(lsq)})")
    p.add_argument("--eps", type=cli.number_list(0.0, 1.0, open_interval=True),
                   default=",".join(f"{e:g}" for e in A.DEFAULT_EPS),
                   help="comma list of relative-suboptimality targets in (0, 1) (default: 1e-2,1e-4,1e-6)")
    p.add_argument("--max-steps", type=cli.integer(1, MAX_STEPS), default=20000,
                   help="step cap of every iterative attacker (default 20000)")
    cli.add_immunize_flags(p, ImmunizeConfig())
    p.add_argument("--data", type=cli.existing_path("file"), default=None,
                   help="Kaggle House Prices train.csv (default: packaged copy)")
    p.add_argument("--on-outlier", choices=("warn", "error"), default="warn",
                   help="a cell > 1e6 × its column's median magnitude: warn (default) or refuse the file")
    p.add_argument("--n-train", type=cli.integer(2), default=200,
                   help="training rows per split (authors' protocol: 200)")
    p.add_argument("--out", type=Path, default=Path("results/attacks"),
                   help="output folder (replaced as a whole by this run's results.json, table.md, "
                        "curves.png)")
    p.add_argument("--no-plot", action="store_true", help="skip curves.png")
    p.add_argument("--mnist-pairs", type=cli.pairs, default=None,
                   help="also attack MNIST ordered pairs P-H, e.g. '0-1,3-8' (logistic probing; slow on CPU)")
    p.add_argument("--mnist-n-train", type=cli.integer(1), default=100,
                   help="MNIST training images per digit (default 100)")
    p.add_argument("--mnist-epochs", type=cli.integer(0), default=30,
                   help="MNIST immunization epochs (paper: 30)")
    p.add_argument("--mnist-max-steps", type=cli.integer(1, MAX_STEPS), default=3000,
                   help="MNIST attacker step cap (default 3000)")
    p.add_argument("--logistic-ridge", type=cli.real(0.0), default=1e-4,
                   help="logistic probe ridge λ = r·‖Z‖₂²/4 (pycore.attacks.make_problem's ridge_rel; "
                        "default 1e-4)")
    return p


def parse_args(argv=None):
    """Parsed and checked flags; ``args.config`` is the House Prices :class:`ImmunizeConfig`."""
    p = build_parser()
    args = p.parse_args(argv)
    prepare(args, p)
    return args


def prepare(args, parser: cli.Parser) -> None:
    """The checks that involve more than one flag, before any compute."""
    args.config = cli.config_from_args(parser, args, ImmunizeConfig(), methods=args.methods)
    # The MNIST part runs experiments/mnist.py's defaults; of the flags above only --certified
    # carries over (the others are House Prices settings).
    try:
        args.mnist_config = ImmunizeConfig.mnist(epochs=args.mnist_epochs, certified=args.config.certified)
    except ValueError as exc:
        raise cli.UsageError(str(exc), "--mnist-epochs" if "epochs" in str(exc) else "--certified") from exc
    if "identity" not in args.methods:
        args.methods.insert(0, "identity")


# ----------------------------------------------------------------------------------------------
def slowdown(s_method, s_identity, cap):
    """``steps(θ_I)/steps(identity)`` as ``(value, kind)``; kind '=' exact, '>=' when θ_I hit the
    cap (a lower bound), '<=' when identity did (an upper bound), 'n/a' when both did."""
    if s_method is not None and s_identity is not None:
        return s_method / s_identity, "="
    if s_method is None and s_identity is not None:
        return (cap + 1) / s_identity, ">="
    if s_method is not None and s_identity is None:
        return s_method / (cap + 1), "<="
    return None, "n/a"


def _fmt_one(v, kind):
    if kind == "n/a":
        return "both capped"
    txt = f"{v:.3g}" if v < 1000 else f"{v:.2e}"
    return {"=": txt, ">=": "≥" + txt, "<=": "≤" + txt}[kind]


def fmt_factors(items):
    """One table cell from the per-seed ``(value, kind)`` list: median, and the range if > 1 seed."""
    vals = [(v, k) for v, k in items if k != "n/a"]
    if not vals:
        return "both capped"
    if len(items) == 1:
        return _fmt_one(*items[0])
    vals.sort(key=lambda x: x[0])
    med = vals[len(vals) // 2]
    return f"{_fmt_one(*med)} ({_fmt_one(*vals[0])}–{_fmt_one(*vals[-1])})"


def holds(items, want):
    """Claim check on the per-seed factors, ``want='>1'`` (slower) or ``'<=1'`` (not slower):
    True / False when every seed decides it (a bound decides only when it points the right way),
    None when some seed cannot tell (both capped, or a bound on the wrong side), False if any
    seed contradicts it."""
    verdicts = []
    for v, k in items:
        if k == "n/a":
            verdicts.append(None)
        elif want == ">1":
            verdicts.append(True if v > 1 and k in ("=", ">=")
                            else False if v <= 1 and k in ("=", "<=") else None)
        else:
            verdicts.append(True if v <= 1 and k in ("=", "<=")
                            else False if v > 1 and k in ("=", ">=") else None)
    if any(x is False for x in verdicts):
        return False
    return None if any(x is None for x in verdicts) else True


def n_contradicting(items, want):
    """How many seeds contradict the claim (the verdict of :func:`holds` is False if any does)."""
    return sum(holds([it], want) is False for it in items)


def _curve_digest(rel, n=120):
    """Log-spaced subsample of a curve, for replotting from the JSON."""
    idx = np.unique(np.concatenate([[0], np.geomspace(1, max(1, len(rel) - 1), n).astype(int)]))
    return {"step": idx.tolist(), "rel_subopt": [float(rel[i]) for i in idx]}


# ----------------------------------------------------------------------------------------------
def run(args) -> dict:
    from pycore.data.house_price import load_house_price
    from pycore.immunize import config_dict

    data = load_house_price(args.data, n_train=args.n_train, on_outlier=args.on_outlier)
    if data.heldout is None:
        raise ValueError(f"House Prices: --n-train {args.n_train} leaves no held-out rows (lower it)")
    methods = args.methods
    attackers = tuple(args.attackers)
    cfg = args.config
    splits = {"train": data.train, "heldout": data.heldout}

    t_start = time.perf_counter()
    runs, curves = evaluate(splits, methods, args.seeds, cfg, attackers, "lsq", args.max_steps, args.eps,
                            ridge_rel=args.logistic_ridge, label="house prices", t_start=t_start)
    factors = compute_factors(runs, methods, attackers, args.eps, args.max_steps)
    mnist = run_mnist(args, methods, t_start) if args.mnist_pairs else None
    return {
        "experiment": "attacks", "dataset": "house_prices", "source": data.source,
        "seeds": args.seeds, "methods": methods, "attackers": list(attackers), "eps": args.eps,
        "step_cap": args.max_steps, "loss": "0.5*||Zw - y||^2 (Hessian Z^T Z = H(theta))",
        "immunize_config": config_dict(cfg),
        "n_rows": {rows: {"D_P": int(t.X_P.shape[0]), "D_H": int(t.X_H.shape[0])}
                   for rows, t in splits.items()},
        **environment(),
        "wall_seconds": time.perf_counter() - t_start,
        "runs": runs, "slowdown": factors, "_curves": curves,
        "mnist": mnist,
    }


def evaluate(splits, methods, seeds, cfg, attackers, loss, cap, eps, *, ridge_rel, label, t_start):
    """Immunize ``splits['train']`` with each method and seed, then attack D_H and D_P of every
    split with every attacker. Returns the JSON-ready runs and the seed-0 training-row curves."""
    from pycore.immunize import immunize
    from pycore.metrics import rir

    runs, curves = [], {}
    for seed in seeds:
        for method in methods:
            res = immunize(splits["train"], method, rng=np.random.default_rng(seed), config=cfg)
            theta = res.theta
            entry = {"seed": seed, "method": method, "immunize_seconds": res.wall_seconds,
                     "diagnostics": res.diagnostics, "rir": {}, "attacks": {}}  # write_json encodes it
            for rows, task in splits.items():
                entry["rir"][rows] = float(rir(theta, task.X_P, task.X_H))
                for tname, (X, Y) in (("D_H", (task.X_H, task.Y_H)), ("D_P", (task.X_P, task.Y_P))):
                    prob = A.make_problem(X @ theta, Y, loss, ridge_rel=ridge_rel)
                    traj = A.run_attack_suite(prob, attackers, max_steps=cap, tol=min(eps))
                    block = entry["attacks"][f"{rows}/{tname}"] = {
                        "kappa": prob.kappa, "rank": prob.rank, "n_rows": int(X.shape[0]),
                        "attackers": {k: t.summary(eps) for k, t in traj.items()},
                    }
                    if loss == "logistic":
                        block["ridge"] = prob.ridge
                    if seed == seeds[0] and rows == "train":
                        curves[(method, tname)] = {k: t.rel_subopt for k, t in traj.items()}
                        for k, t in traj.items():
                            block["attackers"][k]["curve"] = _curve_digest(t.rel_subopt)
            runs.append(entry)
            print(f"{label}: seed {seed} {method:12s} RIR train {entry['rir']['train']:.4g} held-out "
                  f"{entry['rir']['heldout']:.4g}  ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return runs, curves


def run_mnist(args, methods, t_start) -> dict:
    """MNIST ordered pairs (P, H) with logistic probing (``pycore.data.mnist`` tasks: D_P = digit
    P, D_H = digit H, balanced ink-mass BCE targets), immunized with ``experiments/mnist.py``'s
    defaults (:meth:`pycore.immunize.ImmunizeConfig.mnist`)."""
    from pycore.data.mnist import load_mnist, pair_task, split_digits
    from pycore.immunize import config_dict

    pairs = args.mnist_pairs
    digits = load_mnist()
    attackers = A.attackers_for("logistic")
    cfg = args.mnist_config  # as experiments/mnist.py
    out = {"pairs": {}, "attackers": list(attackers), "step_cap": args.mnist_max_steps,
           "ridge_rel": args.logistic_ridge, "n_train": args.mnist_n_train,
           "immunize_config": config_dict(cfg),
           "source": digits.source}
    for p, h in pairs:
        split = split_digits(digits, args.mnist_n_train, np.random.default_rng(0))
        splits = {"train": pair_task(digits, split, p, h),
                  "heldout": pair_task(digits, split, p, h, heldout=True)}
        runs, _ = evaluate(splits, methods, args.seeds, cfg, attackers, "logistic", args.mnist_max_steps,
                           args.eps, ridge_rel=args.logistic_ridge, label=f"mnist {p}-{h}", t_start=t_start)
        out["pairs"][f"{p}-{h}"] = {
            "runs": runs,
            "slowdown": compute_factors(runs, methods, attackers, args.eps, args.mnist_max_steps)}
    return out


def compute_factors(runs, methods, attackers, eps_list, cap):
    """``{method: {rows/task: {attacker: {eps: [(value, kind) per seed]}}}}`` against identity."""
    by = {(r["seed"], r["method"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    out = {}
    for m in methods:
        if m == "identity":
            continue
        out[m] = {}
        for rows in ROWS:
            for task in TASKS:
                key = f"{rows}/{task}"
                out[m][key] = {}
                for a in attackers:
                    out[m][key][a] = {}
                    for e in eps_list:
                        ek = f"{e:g}"
                        items = []
                        for s in seeds:
                            sm = by[(s, m)]["attacks"][key]["attackers"][a]["steps_to"][ek]
                            si = by[(s, "identity")]["attacks"][key]["attackers"][a]["steps_to"][ek]
                            items.append(slowdown(sm, si, cap))
                        out[m][key][a][ek] = items
    return out


# ----------------------------------------------------------------------------------------------
def table_markdown(res: dict) -> str:
    methods = [m for m in res["methods"] if m != "identity"]
    attackers, eps_list, F = res["attackers"], res["eps"], res["slowdown"]
    by = {(r["seed"], r["method"]): r for r in res["runs"]}
    s0 = res["seeds"][0]
    L = []
    L.append("# Attack suite on House Prices: steps to relative suboptimality ε, immunized vs identity\n")
    L.append(f"Command: `{' '.join(res['command'][1:])}`  \n"
             f"Seeds: {res['seeds']}; step cap {res['step_cap']} "
             f"(a run that does not reach ε within the cap is shown as a bound: ≥ when θ_I hit the cap, "
             f"≤ when identity did); loss ½‖Zw − y‖² on features Z = Xθ; every attacker starts at w = 0. "
             f"Rows: train = the "
             f"{res['n_rows']['train']['D_H']}/{res['n_rows']['train']['D_P']} D_H/D_P rows "
             f"used to immunize; held-out = the other {res['n_rows']['heldout']['D_H']}/"
             f"{res['n_rows']['heldout']['D_P']} rows. Factor = steps(θ_I)/steps(identity): "
             f"> 1 on D_H means the attacker is slowed (good), ≤ 1 on D_P means pre-training probing is not "
             f"slowed (good). With several seeds a cell is the median (min–max).\n")

    # condition numbers and RIR for context
    L.append("## Condition numbers of the probing Hessians (seed %d)\n" % s0)
    L.append("| θ | RIR train | RIR held-out | κ(H_H) train | κ(H_P) train | "
             "κ(H_H) held-out | κ(H_P) held-out |")
    L.append("|---|---|---|---|---|---|---|")
    for m in res["methods"]:
        r = by[(s0, m)]
        k = lambda key: f"{r['attacks'][key]['kappa']:.3g}"  # noqa: E731
        L.append(f"| {METHOD_LABELS[m]} | {r['rir']['train']:.4g} | {r['rir']['heldout']:.4g} | "
                 f"{k('train/D_H')} | {k('train/D_P')} | {k('heldout/D_H')} | {k('heldout/D_P')} |")
    L.append("")

    # the paper's claim
    L.append("## The paper's Figure 1 claim, GD with exact line search\n")
    L.append("Claim: with θ_I, probing D_H is slower (factor > 1) and probing D_P is not slower "
             "(factor ≤ 1). "
             "A cell holds only when every seed confirms it; a failure says on how many seeds.\n")
    L.append("| θ_I | rows | ε | D_H factor | D_P factor | claim |")
    L.append("|---|---|---|---|---|---|")
    fails, undetermined, n_cells = [], [], 0
    for m in methods:
        for rows in ROWS:
            for e in eps_list:
                ek = f"{e:g}"
                fh = F[m][f"{rows}/D_H"]["gd_exact"][ek] if "gd_exact" in attackers else None
                fp = F[m][f"{rows}/D_P"]["gd_exact"][ek] if "gd_exact" in attackers else None
                if fh is None:
                    continue
                ok_h, ok_p = holds(fh, ">1"), holds(fp, "<=1")
                n_cells += 1
                if ok_h and ok_p:
                    verdict = "holds"
                else:
                    n_seeds = len(fh)
                    why = [f"{x} ({n}/{n_seeds} seeds)" if n_seeds > 1 else x
                           for x, ok, n in (("D_H not slowed", ok_h is False, n_contradicting(fh, ">1")),
                                            ("D_P slowed", ok_p is False, n_contradicting(fp, "<=1"))) if ok]
                    unk = [x for x, ok in (("D_H", ok_h is None), ("D_P", ok_p is None)) if ok]
                    verdict = ("FAILS: " + ", ".join(why)) if why else ""
                    if unk:
                        verdict += (("; " if verdict else "") + "undetermined on " + " and ".join(unk)
                                    + " (cap)")
                    (fails if why else undetermined).append(f"{m}/{rows}/ε={ek}")
                L.append(f"| {METHOD_LABELS[m]} | {rows} | {ek} | {fmt_factors(fh)} | {fmt_factors(fp)} | "
                         f"{verdict} |")
    L.append("")
    L.append(f"Of {n_cells} cells the claim holds in {n_cells - len(fails) - len(undetermined)}, fails in "
             f"{len(fails)} ({', '.join(fails) if fails else 'none'}) "
             f"and cannot be decided within the cap in "
             f"{len(undetermined)} ({', '.join(undetermined) if undetermined else 'none'}).\n")

    # which attackers are not slowed on D_H
    L.append("## Attackers NOT slowed on D_H (factor ≤ 1, i.e. immunization does not help against them)\n")
    L.append("| θ_I | rows | ε | attackers not slowed | undetermined (cap) |")
    L.append("|---|---|---|---|---|")
    for m in methods:
        for rows in ROWS:
            for e in eps_list:
                ek = f"{e:g}"
                names = [a for a in attackers if holds(F[m][f"{rows}/D_H"][a][ek], ">1") is False]
                unk = [a for a in attackers if holds(F[m][f"{rows}/D_H"][a][ek], ">1") is None]
                L.append(f"| {METHOD_LABELS[m]} | {rows} | {ek} | {', '.join(names) if names else '—'} | "
                         f"{', '.join(unk) if unk else '—'} |")
    L.append("")

    # full slow-down tables
    for rows in ROWS:
        for e in eps_list:
            ek = f"{e:g}"
            L.append(f"## Slow-down factors, {rows} rows, ε = {ek}\n")
            L.append("| attacker | identity steps D_H | identity steps D_P | " +
                     " | ".join(f"{METHOD_LABELS[m]} D_H | {METHOD_LABELS[m]} D_P" for m in methods) + " |")
            L.append("|---|---|---|" + "---|---|" * len(methods))
            for a in attackers:
                idr = by[(s0, "identity")]["attacks"]
                sh = idr[f"{rows}/D_H"]["attackers"][a]["steps_to"][ek]
                sp = idr[f"{rows}/D_P"]["attackers"][a]["steps_to"][ek]
                cells = [f"{fmt_factors(F[m][f'{rows}/D_H'][a][ek])} | "
                         f"{fmt_factors(F[m][f'{rows}/D_P'][a][ek])}"
                         for m in methods]
                L.append(f"| {A.ATTACKER_LABELS[a]} | "
                         f"{sh if sh is not None else '>' + str(res['step_cap'])} | "
                         f"{sp if sp is not None else '>' + str(res['step_cap'])} | "
                         + " | ".join(cells) + " |")
            L.append("")
    if res.get("mnist"):
        L += mnist_table(res)
    return "\n".join(L)


def mnist_table(res):
    M = res["mnist"]
    methods = [m for m in res["methods"] if m != "identity"]
    L = [f"# MNIST pairs: logistic probing (BCE + ridge λ = {M['ridge_rel']:g}·‖Z‖₂²/4), "
         f"{M['n_train']} training images per digit, step cap {M['step_cap']}\n",
         "Second-order attacker: damped Newton. Factor = steps(θ_I)/steps(identity), as above.\n"]
    for e in res["eps"]:
        ek = f"{e:g}"
        for rows in ROWS:
            L.append(f"## MNIST, {rows} rows, ε = {ek}\n")
            L.append("| pair | attacker | "
                     + " | ".join(f"{METHOD_LABELS[m]} D_H | {METHOD_LABELS[m]} D_P" for m in methods) + " |")
            L.append("|---|---|" + "---|---|" * len(methods))
            for pair, blk in M["pairs"].items():
                for a in M["attackers"]:
                    cells = [f"{fmt_factors(blk['slowdown'][m][f'{rows}/D_H'][a][ek])} | "
                             f"{fmt_factors(blk['slowdown'][m][f'{rows}/D_P'][a][ek])}" for m in methods]
                    L.append(f"| {pair} | {A.ATTACKER_LABELS[a]} | " + " | ".join(cells) + " |")
            L.append("")
    return L


def plot_curves(res: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, attackers, methods = res["_curves"], res["attackers"], res["methods"]
    n = len(attackers)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    floor = min(res["eps"]) / 100
    for ax, a in zip(axes.flat, attackers):
        for i, m in enumerate(methods):
            for task, ls in (("D_H", "-"), ("D_P", "--")):
                rel = np.maximum(np.asarray(curves[(m, task)][a]), floor)
                steps = np.arange(len(rel))
                ax.plot(np.maximum(steps, 0.8), rel, ls, color=colors[i % len(colors)], lw=1.2,
                        label=f"{METHOD_LABELS[m]} {task}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(floor, 2)
        ax.set_title(A.ATTACKER_LABELS[a], fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("(L − L*)/(L₀ − L*)")
        for e in res["eps"]:
            ax.axhline(e, color="0.8", lw=0.6, zorder=0)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    h, lab = axes.flat[0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=min(6, len(lab)), fontsize=8, frameon=False)
    fig.suptitle(f"House Prices, training rows, seed {res['seeds'][0]}: solid D_H (harmful), dashed D_P "
                 f"(pre-training); cap {res['step_cap']} steps", fontsize=11)
    fig.tight_layout(rect=(0, 0.07 + 0.02 * math.ceil(len(lab) / 6), 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        prepare(args, parser)
        with cli.OutputSet(args.out, ("results.json", "table.md", "curves.png")) as outs:
            res = run(args)
            curves = res.pop("_curves")
            cli.write_set(outs, res, table_markdown(res))
            if not args.no_plot:
                plot_curves({**res, "_curves": curves}, outs.path / "curves.png")
            outs.commit()
        print(f"wrote {outs.final}/results.json, table.md" + ("" if args.no_plot else ", curves.png")
              + f" in {res['wall_seconds']:.0f}s")
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
