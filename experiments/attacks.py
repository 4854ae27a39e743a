#!/usr/bin/env python
"""Worst-case attack evaluation of linear immunization (docs/findings.md §4): who is slowed, by how
much, and what the condition number alone could have forced.

Every attacker family of :func:`pycore.attacks.attacker_grid` probes ``Z = Xθ`` of D_H and D_P
(training and held-out rows) for identity and each of ``--methods`` (``--hardened-methods`` also
hardened, :func:`pycore.harden_result`) and counts its steps to each ε;
:func:`pycore._worst_case_analysis.analyse` names each family's best configuration, the defender's
worst case and what κ alone can force.

    python experiments/attacks.py                        # strict, 5 seeds, closed form, Alg. 1
    python experiments/attacks.py --quick --seeds 1      # CI smoke test (small grid)
    python experiments/attacks.py --mnist-pairs 0-1,7-2  # also MNIST (logistic probing)
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from experiments import common
from pycore import METHODS
from pycore._linear_options import MAX_EPOCHS
from pycore._thetas import task_arrays, theta_key
from pycore._worst_case import FAMILIES, MAX_ORDERS
from pycore._worst_case_analysis import Variant, VariantRun, analyse, best_so_far_curves, targets
from pycore.attacks import GridRun, attacker_grid, run_grid
from pycore.data._mnist import parse_pairs
from pycore.report import environment, save_figure

MAX_STEPS = (
    1_000_000  # a trajectory keeps a loss per step: 50× the default cap, ample for ε = 1e-6
)
TASKS = ("D_H", "D_P")
OUTPUTS = ("table.md", "best_so_far.png", "thetas.npz", "results.json")
LSQ_FAMILIES = tuple(f for f in FAMILIES if f != "newton")


def build_parser() -> common.Parser:
    p = common.Parser("attacks.py", __doc__.split("\n\n")[0])
    common.add_run_flags(p, "5", "results/attacks", "immunization seeds")
    p.add_argument(
        "--protocol",
        choices=("paper", "strict"),
        default="strict",
        help="House Prices protocol (docs/theory.md §10): the preset 'strict' or 'house_price'",
    )
    methods = common.comma_list(choices=METHODS)
    p.add_argument(
        "--methods",
        type=methods,
        default="closed_form,ours",
        help="immunizers (identity is added)",
    )
    p.add_argument(
        "--hardened-methods",
        type=methods,
        default="closed_form,ours",
        help="methods also attacked hardened by --harden (identity's rotated twin is added)",
    )
    p.add_argument(
        "--attackers",
        type=common.comma_list(choices=LSQ_FAMILIES),
        default=",".join(LSQ_FAMILIES),
        help="attacker families",
    )
    eps = common.real(0, 1, lo_open=True, hi_open=True)
    p.add_argument(
        "--eps",
        type=common.comma_list(eps, max_items=10),
        default="1e-2,1e-4",
        help="relative-suboptimality targets",
    )
    p.add_argument(
        "--max-steps",
        type=common.count(1, MAX_STEPS),
        default=20000,
        help="step cap of an attacker",
    )
    p.add_argument(
        "--quick", action="store_true", help="a few configurations per family (smoke tests)"
    )
    p.add_argument(
        "--orders",
        type=common.count(1, MAX_ORDERS),
        default=200,
        help="random orders of the configurations for the best-so-far curves",
    )
    common.add_house_price_data(p)
    p.add_argument("--no-plot", action="store_true", help="skip best_so_far.png")
    mn = p.add_argument_group("MNIST (logistic probing)")
    mn.add_argument(
        "--mnist-pairs",
        type=common.flag_type("pairs", "P-H,P-H,...", parse_pairs),
        help="also attack these ordered digit pairs",
    )
    mn.add_argument(
        "--mnist-only", action="store_true", help="only the MNIST pairs (no House Prices)"
    )
    mn.add_argument(
        "--mnist-methods",
        type=methods,
        default="closed_form,ours",
        help="MNIST immunizers (identity added; each also hardened)",
    )
    mn.add_argument(
        "--mnist-seeds", type=common.seeds, default="1", metavar="N|A,B,C|A-B", help="MNIST seeds"
    )
    mn.add_argument(
        "--mnist-n-train", type=common.count(1, 500), default=100, help="training images per digit"
    )
    mn.add_argument(
        "--mnist-epochs",
        type=common.count(0, MAX_EPOCHS),
        default=30,
        help="immunization epochs (the preset 'mnist', as experiments/mnist.py)",
    )
    mn.add_argument(
        "--mnist-max-steps", type=common.count(1, MAX_STEPS), default=3000, help="step cap"
    )
    mn.add_argument(
        "--logistic-ridge",
        type=common.real(0.0, lo_open=True),
        default=1e-4,
        help="logistic probe ridge λ = r·‖Z‖₂²/4 (pycore.attacks.make_problem's ridge_rel)",
    )
    common.add_immunize_options(p, "strict")
    p.set_defaults(harden="haar")
    return p


def prepare(args, parser) -> None:
    """The checks that involve several flags, before any compute."""
    from pycore import options_of

    if args.mnist_only and not args.mnist_pairs:
        raise common.UsageError("needs --mnist-pairs", "--mnist-only")
    missing = [m for m in args.hardened_methods if m not in args.methods]
    if missing:
        raise common.UsageError(f"{missing[0]!r} is not among --methods", "--hardened-methods")
    args.methods = ["identity"] + [m for m in args.methods if m != "identity"]
    args.immunizer = common.immunizer(
        parser, args, args.methods, "strict" if args.protocol == "strict" else "house_price"
    )
    args.mnist_methods = ["identity"] + [m for m in args.mnist_methods if m != "identity"]
    # the preset "mnist" with --mnist-epochs for the methods that have epochs
    epochs = {
        m: {"epochs": args.mnist_epochs} if "epochs" in options_of(m).names() else {}
        for m in args.mnist_methods
    }
    args.mnist_immunizer = common.Immunizer("mnist", epochs, args.certified, args.harden)
    common.check_out(args.out, OUTPUTS)


def digest(theta: np.ndarray) -> str:
    """The ``theta_digest`` results.json records for θ: the first 16 hex digits of the SHA-1 of
    its C-order float64 bytes; equal θ's of several runs are attacked once."""
    return hashlib.sha1(np.ascontiguousarray(theta).tobytes()).hexdigest()[:16]


def _numbers(theta, splits) -> dict:
    """Per row set: what hardening must leave unchanged (docs/findings.md §5)."""
    from pycore import rir
    from pycore._losses import best_probe_loss

    return {
        rows: {
            "rir": (r := rir(theta, t.X_P, t.X_H)).value,
            "harmful_ratio": r.harmful_ratio,
            "pretrain_ratio": r.pretrain_ratio,
            "dp_loss": best_probe_loss(t.loss, t.X_P @ theta, t.Y_P),
        }
        for rows, t in splits.items()
    }


def _immunize_job(job) -> dict:
    """One (method, seed) on ``splits["train"]``: θ as immunized and, if ``hardened``, hardened,
    each with its :func:`_numbers` (a worker task: everything it needs comes in ``job``)."""
    immunizer, splits, method, seed, hardened = job
    run = immunizer if hardened else dataclasses.replace(immunizer, harden="none")
    res = run(splits["train"], method, np.random.default_rng(seed))
    plain = res.theta if res.theta_unhardened is None else res.theta_unhardened
    out = {
        "thetas": {Variant(method): plain},
        "numbers": {Variant(method): _numbers(plain, splits)},
        "rotation": None,
        "orthogonality_defect": None,
        "wall_seconds": res.wall_seconds,
        "diagnostics": {k: v for k, v in res.diagnostics.items() if np.isscalar(v)},
    }
    if res.theta_unhardened is not None:
        v = Variant(method, run.harden)
        out["thetas"][v], out["numbers"][v] = res.theta, _numbers(res.theta, splits)
        out["rotation"] = res.rotation
        out["orthogonality_defect"] = res.diagnostics["harden"]["orthogonality_defect"]
    return out


def _grid_job(unit) -> GridRun:
    """Every attacker configuration of ``grid`` probing ``Z = Xθ`` against ``Y`` (a worker task:
    everything it needs comes in ``unit``)."""
    from pycore.attacks import make_problem

    theta, X, Y, loss, ridge_rel, grid, eps, cap = unit
    return run_grid(
        make_problem(X @ theta, Y, loss, ridge_rel=ridge_rel), grid, eps=eps, max_steps=cap
    )


def run(args) -> tuple[dict, dict]:
    """The experiment: ``(results, archive)``, the archive the θ's and inputs for thetas.npz."""
    from pycore import strict_protocol

    t_start = time.perf_counter()
    if args.mnist_only:
        mnist, archive = run_mnist(args, t_start)
        first = next(iter(mnist["pairs"].values()))
        res = {
            "experiment": "attacks",
            "dataset": "mnist",
            "protocol": "mnist",
            "mnist": mnist,
            "harden": args.harden,
            "seeds": mnist["seeds"],
            "eps": sorted(args.eps, reverse=True),
            "variants": first["variants"],
            "best_so_far": first["best_so_far"],
            **environment(),
            "wall_seconds": time.perf_counter() - t_start,
        }
        return res, archive
    data = common.load_house_price_data(args)
    if data.heldout is None:
        raise common.UsageError("leaves no held-out rows (lower it)", "--n-train")
    train, held, strict = data.train, data.heldout, None
    if args.protocol == "strict":
        train, held, strict = strict_protocol(train, held, data.feature_names)
    splits = {"train": train, "heldout": held}
    grid = tuple(c for c in attacker_grid("mse", quick=args.quick) if c.family in args.attackers)
    found, archive = evaluate(
        splits,
        args.methods,
        args.hardened_methods,
        args.seeds,
        args.immunizer,
        grid,
        "mse",
        args.max_steps,
        args.eps,
        args,
        "house prices",
        t_start,
    )
    archive.update(task_arrays(splits))
    res = {
        "experiment": "attacks",
        "dataset": "house_prices",
        "source": data.source,
        "data_changes": data.changes(),
        "protocol": args.protocol,
        "strict_protocol": None if strict is None else strict.to_dict(),
        "seeds": args.seeds,
        "methods": args.methods,
        "hardened_methods": args.hardened_methods,
        "harden": args.harden,
        "eps": sorted(args.eps, reverse=True),
        "step_cap": args.max_steps,
        "quick_grid": args.quick,
        "grid": [c.to_dict() for c in grid],
        "immunize": args.immunizer.to_dict(),
        "loss": "0.5*||Zw - y||^2 (Hessian Z^T Z = H(theta)); every attacker starts at w = 0",
        "n_rows": {
            rows: {"D_P": int(t.X_P.shape[0]), "D_H": int(t.X_H.shape[0])}
            for rows, t in splits.items()
        },
        **found,
    }
    if args.mnist_pairs:
        res["mnist"], mnist_archive = run_mnist(args, t_start)
        archive.update(mnist_archive)
    return {**res, **environment(), "wall_seconds": time.perf_counter() - t_start}, archive


def evaluate(
    splits, methods, hardened, seeds, immunizer, grid, loss, cap, eps, args, label, t_start
) -> tuple[dict, dict]:
    """Immunize ``splits['train']`` per (method, seed) (``hardened`` and identity also hardened),
    then the grid on both tasks of every split per distinct θ: ``({"runs", "variants",
    "analysis", "best_so_far"}, archive)``."""
    harden = immunizer.harden
    jobs = [
        (immunizer, splits, m, s, harden != "none" and (m in hardened or m == "identity"))
        for s in seeds
        for m in methods
    ]
    entries = common.pool_map(_immunize_job, jobs, args.jobs, desc=f"{label}: immunizing")
    thetas, archive = {}, {}
    for (_, _, method, seed, _), e in zip(jobs, entries):
        for v, theta in e["thetas"].items():
            thetas[digest(theta)] = theta
            archive[theta_key(v.method, seed, v.harden)] = theta
        if e["rotation"] is not None:
            archive[theta_key(method, seed, harden, "Q")] = e["rotation"]
    print(
        f"{label}: immunized {len(entries)} runs, {len(thetas)} distinct θ "
        f"({time.perf_counter() - t_start:.0f}s)",
        flush=True,
    )
    eps = tuple(eps)
    units = [(d, rows, task) for d in thetas for rows in splits for task in TASKS]
    work = []
    for d, rows, task in units:
        t = splits[rows]
        X, Y = (t.X_H, t.Y_H) if task == "D_H" else (t.X_P, t.Y_P)
        work.append((thetas[d], X, Y, loss, args.logistic_ridge, grid, eps, cap))
    by_unit = dict(
        zip(units, common.pool_map(_grid_job, work, args.jobs, desc=f"{label}: attacking"))
    )
    print(
        f"{label}: {len(units)} problems attacked ({time.perf_counter() - t_start:.0f}s)",
        flush=True,
    )
    runs = []
    for (_, _, method, seed, _), e in zip(jobs, entries):
        plain = e["numbers"][Variant(method)]
        for v, theta in e["thetas"].items():
            d, numbers = digest(theta), e["numbers"][v]
            runs.append(
                VariantRun(
                    seed=seed,
                    variant=v,
                    theta_digest=d,
                    numbers=numbers,
                    immunize_seconds=e["wall_seconds"],
                    diagnostics=e["diagnostics"],
                    problems={
                        rows: {task: by_unit[(d, rows, task)] for task in TASKS} for rows in splits
                    },
                    orthogonality_defect=e["orthogonality_defect"] if v.hardened else None,
                    # hardening must leave every number as it was (exact invariants)
                    invariance={
                        rows: max(abs(numbers[rows][k] - n[k]) / abs(n[k]) for k in n)
                        for rows, n in plain.items()
                    }
                    if v.hardened
                    else None,
                )
            )
    rotated = Variant("identity", harden)
    return {
        "runs": runs,
        "variants": list(dict.fromkeys(r.variant for r in runs)),
        "analysis": analyse(runs, grid, sorted(eps, reverse=True), cap, rotated=rotated),
        "best_so_far": best_so_far_curves(runs, grid, min(eps), cap, args.orders),
    }, archive


def run_mnist(args, t_start) -> tuple[dict, dict]:
    """MNIST ordered pairs with logistic probing, immunized with the preset "mnist" (as
    experiments/mnist.py) and hardened like House Prices: ``(results, archive)``."""
    from pycore.data import load_mnist, pair_task, split_digits

    digits = load_mnist()
    grid = tuple(
        c
        for c in attacker_grid("bce", quick=args.quick)
        if c.family in args.attackers or c.family == "newton"
    )
    out = {
        "pairs": {},
        "grid": [c.to_dict() for c in grid],
        "step_cap": args.mnist_max_steps,
        "ridge_rel": args.logistic_ridge,
        "n_train": args.mnist_n_train,
        "seeds": args.mnist_seeds,
        "methods": args.mnist_methods,
        "immunize": args.mnist_immunizer.to_dict(),
        "source": digits.source,
    }
    archive = {}
    for p, h in args.mnist_pairs:
        split = split_digits(digits, args.mnist_n_train, np.random.default_rng(0))
        splits = {
            "train": pair_task(digits, split, p, h),
            "heldout": pair_task(digits, split, p, h, heldout=True),
        }
        res, thetas = evaluate(
            splits,
            args.mnist_methods,
            args.mnist_methods,
            args.mnist_seeds,
            args.mnist_immunizer,
            grid,
            "bce",
            args.mnist_max_steps,
            args.eps,
            args,
            f"mnist {p}-{h}",
            t_start,
        )
        archive.update({f"mnist/{p}-{h}/{k}": v for k, v in thetas.items()})
        out["pairs"][f"{p}-{h}"] = res
    return out, archive


# ---------------------------------------------------------------- tables


def _fmt_one(v, kind="="):
    if kind == "n/a":
        return "both capped"
    txt = f"{v:.3g}" if v < 1000 else f"{v:.2e}"
    return {"=": txt, ">=": "≥" + txt, "<=": "≤" + txt}[kind]


def fmt_factors(items):
    """One cell from per-seed ``(value, kind)`` pairs: the median, and the range with > 1 seed."""
    vals = sorted(((v, k) for v, k in items if k != "n/a"), key=lambda x: x[0])
    if not vals or len(items) == 1:
        return _fmt_one(*items[0]) if vals else "both capped"
    med, lo, hi = _fmt_one(*vals[len(vals) // 2]), _fmt_one(*vals[0]), _fmt_one(*vals[-1])
    return med if lo == hi else f"{med} ({lo}–{hi})"


def _mode(items):
    """The most frequent item (first in order on ties), with '(k/n seeds)' when not unanimous."""
    items = list(items)
    best = max(dict.fromkeys(items), key=items.count)
    return (
        best
        if items.count(best) == len(items)
        else f"{best} ({items.count(best)}/{len(items)} seeds)"
    )


INTRO = (
    "Loss ½‖Zw − y‖², w₀ = 0; one step = one iteration (one gradient for every first-order "
    "family; L-BFGS may evaluate more per iteration; whitening also forms Σ̂ once; the "
    "closed form is "
    "one solve). Rows: train = the {}/{} D_H/D_P rows used to immunize; held-out = the "
    "other {}/{}. "
    "Slow-down = steps of the family's best configuration on θ / on identity (median over seeds, "
    "min–max in brackets; ≥ when θ's run hit the cap, ≤ when identity's did); [b] = "
    "what κ alone can "
    "force on the family (pycore.attacks.kappa_bounds: GD r, momentum/CG/L-BFGS √r, "
    "Adam/Adagrad "
    "r_J, Jacobi-PCG √r_J, whitening/closed form 1; r = κ(θ)/κ(I), r_J the same for the "
    "Jacobi-scaled "
    "Hessian).\n"
)


def table_markdown(res: dict) -> str:
    command = f"Command: `{' '.join(res['command'][1:])}`"
    L = [command + "\n"]
    if res.get("dataset") != "mnist":
        n = res["n_rows"]
        L = [
            f"# Worst-case attack evaluation: House Prices, {res['protocol']} protocol\n",
            f"{command}  \nSeeds {res['seeds']}; step cap {res['step_cap']}; ε ∈ "
            f"{res['eps']}; hardening "
            f"`{res['harden']}` for {', '.join(res['hardened_methods']) or 'no method'} "
            "and the identity "
            f"reference; {len(res['grid'])} attacker configurations"
            + (" (quick grid)" if res["quick_grid"] else "")
            + ". "
            + INTRO.format(
                n["train"]["D_H"], n["train"]["D_P"], n["heldout"]["D_H"], n["heldout"]["D_P"]
            ),
        ]
        L += _sections(res, "##") + _transfer_lines(res)
    if res.get("mnist"):
        M = res["mnist"]
        L.append(
            f"# MNIST pairs: logistic probing (BCE + ridge λ = {M['ridge_rel']:g}·‖Z‖₂²/4), "
            f"{M['n_train']} training images per digit, seeds {M['seeds']}, step cap "
            f"{M['step_cap']}, "
            f"{len(M['grid'])} configurations (second-order attacker: damped Newton)\n"
        )
        for pair, blk in M["pairs"].items():
            L.append(f"## pair {pair} (P = {pair.split('-')[0]}, H = {pair.split('-')[1]})\n")
            L += _sections(
                {**res, **blk, "grid": M["grid"], "harden": M["immunize"]["harden"]}, "###"
            )
    return "\n".join(L) + "\n"


def _slowdowns(ws) -> str:
    return fmt_factors([(w.slowdown, w.kind) for w in ws])


def _sections(res, h) -> list[str]:
    """Hardening invariants and targets, the worst case per row set and ε, Adam and whitening."""
    L, inv = [], [r for r in res["runs"] if r.invariance is not None]
    if inv:
        od = max(r.orthogonality_defect for r in inv)
        worst = max(max(r.invariance.values()) for r in inv)
        L.append(
            f"Hardening leaves every spectrum unchanged: over {len(inv)} hardened runs "
            "the largest "
            "relative difference of RIR, (i), (ii) and the best D_P loss to the unhardened θ, on "
            f"training and held-out rows, is {worst:.2e}; ‖QᵀQ − I‖_max ≤ {od:.1e}.\n"
        )
    yes = {True: "yes", False: "NO", None: "undecided (cap)"}
    if found := targets(res["runs"], res["analysis"]):
        L += [
            f"{h} Hardening targets (training rows, ε = 1e-4)\n",
            "Best Adam of the grid on D_H slowed ≥ 10× against identity on every seed; "
            "D_P's best Adam not "
            "slowed by more than 1.2×; RIR, (i), (ii), best D_P loss equal to the "
            "unhardened θ's to 1e-10 "
            "relative.\n",
            "| variant | Adam D_H slow-down (per seed) | ≥ 10× every seed | Adam D_P "
            "slow-down | ≤ 1.2× | invariants (max rel. diff) | ≤ 1e-10 |",
            "|---|---|---|---|---|---|---|",
        ]
        L += [
            f"| {t.variant.label} | {', '.join(_fmt_one(*x) for x in t.adam_dh)} | "
            f"{yes[t.dh_ok]} | {', '.join(_fmt_one(*x) for x in t.adam_dp)} | "
            f"{yes[t.dp_ok]} | "
            f"{t.invariance:.1e} | {yes[t.inv_ok]} |"
            for t in found
        ] + [""]
    fams, an = list(dict.fromkeys(c["family"] for c in res["grid"])), res["analysis"]
    for rows, e in ((rows, e) for rows in ("train", "heldout") for e in res["eps"]):
        L += [
            f"{h} Worst case, {rows} rows, ε = {e:g} (D_H: slowed is good for the defender)\n",
            "| θ | worst case, all attackers | worst first-order attacker (on θ) | "
            "first-order slow-down | " + " | ".join(fams) + " |",
            "|---|---|---|---|" + "---|" * len(fams),
        ]
        for v in an.variants:
            c = an(v, rows, "D_H", e)
            wa, wf = c.worst_all, c.worst_first_order
            steps = _mode(
                f"{w.attacker}: {'>cap' if w.steps is None else w.steps} steps" for w in wf
            )
            fam = [
                f"{fmt_factors(x.slowdown)} [{_fmt_one(np.median(x.bound))}]"
                for x in (c.families[f] for f in fams)
            ]
            L.append(
                f"| {v.label} | {_slowdowns(wa)} ({_mode(w.attacker for w in wa)}) | "
                f"{steps} | {_slowdowns(wf)} | " + " | ".join(fam) + " |"
            )
        L += [
            "",
            f"D_P ({rows} rows, ε = {e:g}; ≤ 1 is good: pre-training probing not slowed), "
            "per family:\n",
            "| θ | " + " | ".join(fams) + " |",
            "|---|" + "---|" * len(fams),
        ]
        L += [
            f"| {v.label} | "
            + " | ".join(fmt_factors(an(v, rows, "D_P", e).families[f].slowdown) for f in fams)
            + " |"
            for v in an.variants
        ] + [""]
    return L + _adam_decomposition(res, h)


def _adam_decomposition(res, h) -> list[str]:
    an = res["analysis"]
    hardened = [v for v in an.variants if v.hardened and v.method != "identity"]
    rot = Variant("identity", res["harden"])
    if not hardened and rot not in an.variants:
        return []
    L = [
        f"{h} What hardening buys against diagonal preconditioners, and what an attacker "
        "who whitens "
        "recovers\n",
        "D_H, training rows. 'vs I' = against identity; 'vs IQ' = against the rotated "
        "identity (identity hardened the same way), which isolates the conditioning "
        "from the loss of the "
        "input basis. [b] as above.\n",
        "| θ | ε | Adam vs I [b] | Adam vs IQ [b] | Adagrad vs I | Jacobi-PCG vs I [b] | "
        "Jacobi-PCG vs IQ | whitening vs I | whitening vs IQ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(families, f, key="slowdown"):
        values = getattr(families[f], key) if f in families else None
        if values is None:
            return "—"
        return _fmt_one(np.median(values)) if key.startswith("bound") else fmt_factors(values)

    for v, e in ((v, e) for v in hardened for e in res["eps"]):
        for name in (v.unhardened(), v):
            c = an(name, "train", "D_H", e).families
            L.append(
                f"| {name.label} | {e:g} | {cell(c, 'adam')} "
                f"[{cell(c, 'adam', 'bound')}] | "
                f"{cell(c, 'adam', 'slowdown_vs_rotated')} "
                f"[{cell(c, 'adam', 'bound_vs_rotated')}] | "
                f"{cell(c, 'adagrad')} | {cell(c, 'pcg_jacobi')} "
                f"[{cell(c, 'pcg_jacobi', 'bound')}] | "
                f"{cell(c, 'pcg_jacobi', 'slowdown_vs_rotated')} | {cell(c, 'whiten')} | "
                f"{cell(c, 'whiten', 'slowdown_vs_rotated')} |"
            )
    for e in res["eps"] if rot in an.variants else ():
        c = an(rot, "train", "D_H", e).families
        L.append(
            f"| {rot.label} (reference) | {e:g} | {cell(c, 'adam')} "
            f"[{cell(c, 'adam', 'bound')}] | — | {cell(c, 'adagrad')} | "
            f"{cell(c, 'pcg_jacobi')} | — | "
            f"{cell(c, 'whiten')} | — |"
        )
    return L + [""]


def _transfer_lines(res) -> list[str]:
    """Held-out vs training rows: the worst first-order slow-down and Adam's, per variant."""
    an, e = res["analysis"], min(res["eps"])
    L = [
        f"## What transfers to held-out rows (D_H, ε = {e:g})\n",
        "| θ | RIR train → held-out | (i) train → held-out | first-order worst case "
        "train | held-out | "
        "Adam train | held-out | D_P best-attacker slow-down train | held-out |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    problems = [("train", "D_H"), ("heldout", "D_H"), ("train", "D_P"), ("heldout", "D_P")]
    for v in (v for v in an.variants if an(v, "heldout", "D_H", e) is not None):
        n = [r.numbers for r in res["runs"] if r.variant == v]
        med = {
            (rows, k): np.median([x[rows][k] for x in n])
            for rows in ("train", "heldout")
            for k in ("rir", "harmful_ratio")
        }
        worst = {p: _slowdowns(an(v, *p, e).worst_first_order) for p in problems}
        adam = {
            p: fmt_factors(an(v, *p, e).families["adam"].slowdown)
            if "adam" in an(v, *p, e).families
            else "—"
            for p in problems[:2]
        }
        L.append(
            f"| {v.label} | {med['train', 'rir']:.4g} → {med['heldout', 'rir']:.4g} | "
            f"{med['train', 'harmful_ratio']:.4g} → {med['heldout', 'harmful_ratio']:.4g} | "
            + " | ".join(
                [
                    worst["train", "D_H"],
                    worst["heldout", "D_H"],
                    adam["train", "D_H"],
                    adam["heldout", "D_H"],
                    worst["train", "D_P"],
                    worst["heldout", "D_P"],
                ]
            )
            + " |"
        )
    return L + [""]


def plot_best_so_far(res: dict, path) -> None:
    """A panel per attacked θ (columns) and row set (rows): each family's median best-so-far
    slow-down over orders and seeds, its 10–90 % band, and that of the first-order families."""
    plt = common.pyplot()
    sofar = res["best_so_far"]
    variants = [v for v in res["variants"] if v.method != "identity" or v.hardened]
    variants = [v for v in variants if any(c.variant == v for c in sofar.curves)]
    fig, axes = plt.subplots(
        2, len(variants), figsize=(3.4 * len(variants) + 1, 6.4), squeeze=False, sharey=True
    )
    panels = ((r, c) for r in enumerate(("train", "heldout")) for c in enumerate(variants))
    for (row, rows), (col, v) in panels:
        ax = axes[row][col]
        for pool, color, label in (
            ("all", "tab:blue", "every family: median, 10–90 % band"),
            ("first_order", "tab:orange", "first-order families: median"),
        ):
            if (c := sofar.curve(v, rows, pool)) is not None:
                x = np.arange(1, len(c.median) + 1)
                ax.plot(x, c.median, color=color, lw=1.6, label=label)
                if pool == "all":
                    ax.fill_between(x, c.q10, c.q90, color=color, alpha=0.2, lw=0)
        ax.set(xscale="log", yscale="log")
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_title(
            f"{v.label}, {'training' if rows == 'train' else 'held-out'} rows", fontsize=9
        )
        ax.set_xlabel("configurations tried (random order)", fontsize=8)
        if col == 0:
            ax.set_ylabel("best steps on θ / best on identity", fontsize=8)
    fig.legend(
        *axes[0][0].get_legend_handles_labels(),
        loc="upper right",
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    mnist = res.get("dataset") == "mnist"
    where = "MNIST, first pair" if mnist else f"House Prices, {res['protocol']} protocol"
    fig.suptitle(
        f"{where}, linear θ: best-so-far slow-down of the attackers on D_H, ε = {sofar.eps:g} "
        f"({sofar.orders_per_seed} orders × {len(res['seeds'])} seeds)",
        fontsize=10,
        x=0.02,
        ha="left",
    )
    save_figure(fig, path, rect=(0, 0, 1, 0.92))


def main(argv=None) -> int:
    from pycore.report import save_thetas

    parser = build_parser()

    def body(args):
        prepare(args, parser)
        res, archive = run(args)
        meta = {
            "protocol": res["protocol"],
            "seeds": res["seeds"],
            "harden": res["harden"],
            "command": res["command"],
            "keys": "<variant>/seed<k> = θ (D×D, features X @ θ); <variant>/seed<k>/Q = the "
            "hardening "
            "rotation (θ = θ_unhardened @ Q); data/<rows>/<X_P|Y_P|X_H|Y_H> = the protocol's "
            "inputs θ acts on; mnist/<P-H>/... the same per MNIST pair",
        }
        common.write_run(
            args.out,
            table_markdown(res),
            res,
            {
                "thetas.npz": lambda p: save_thetas(p, archive, meta),
                "best_so_far.png": None if args.no_plot else lambda p: plot_best_so_far(res, p),
            },
        )

    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
