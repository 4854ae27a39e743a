#!/usr/bin/env python
"""Worst-case attack evaluation of linear immunization (docs/attacks.md): who is slowed, by how much,
and what the condition number alone could have forced.

For identity and each immunizer of ``--methods`` (and, for ``--hardened-methods``, the same θ
hardened by an orthogonal rotation, :mod:`pycore.harden`), every attacker family of
:func:`pycore.worst_case.attacker_grid` probes the features ``Z = Xθ`` of D_H and D_P on the
training and the held-out rows and counts its steps to each relative suboptimality ε; the
analysis (:func:`pycore.worst_case.analyse`) names each family's best configuration, the
defender's worst case and what κ alone can force (:func:`pycore.worst_case.kappa_bounds`), also
against the rotated identity for hardened θ's.

    python experiments/attacks.py                         # strict, 5 seeds, closed form and Algorithm 1
    python experiments/attacks.py --protocol paper
    python experiments/attacks.py --quick --seeds 1      # CI smoke test (small grid)
    python experiments/attacks.py --mnist-pairs 0-1,7-2  # also MNIST (logistic probing)

Writes ``table.md``, ``best_so_far.png``, ``thetas.npz`` (every attacked θ, hardened and not, with
the inputs they act on) and ``results.json`` (every configuration's steps and the analysis).
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import time

import numpy as np

from experiments import common
from pycore import attacks as A
from pycore import worst_case as W
from pycore.immunize import MAX_EPOCHS, METHODS
from pycore.report import METHOD_LABELS, dumps_json, environment

# Step cap of an attacker: its trajectory keeps a loss per step, and many attackers run on 4 problems
# per (method, seed); 50× the default cap, ample for ε = 1e-6 on House Prices.
MAX_STEPS = 1_000_000
TASKS = ("D_H", "D_P")
OUTPUTS = ("table.md", "best_so_far.png", "thetas.npz", "results.json")
LSQ_FAMILIES = tuple(f for f in W.FAMILIES if f != "newton")
_STATE: dict = {}   # data shared with forked workers (never pickled per job)


def build_parser() -> common.Parser:
    p = common.Parser("attacks.py", __doc__.split("\n\n")[0])
    common.add_seeds(p, "5", "immunization seeds")
    p.add_argument("--protocol", choices=("paper", "strict"), default="strict",
                   help="House Prices protocol (docs/theory.md §10): the preset 'strict' or 'house_price'")
    methods = common.comma_list(choices=METHODS)
    p.add_argument("--methods", type=methods, default="closed_form,ours",
                   help="immunizers to attack (identity is always added)")
    p.add_argument("--hardened-methods", type=methods, default="closed_form,ours",
                   help="methods also attacked hardened by --harden (identity's rotated twin, the reference, "
                        "is added)")
    p.add_argument("--attackers", type=common.comma_list(choices=LSQ_FAMILIES),
                   default=",".join(LSQ_FAMILIES), help="attacker families")
    p.add_argument("--eps", type=common.comma_list(common.real(0.0, 1.0, lo_open=True, hi_open=True),
                                                   max_items=10),
                   default="1e-2,1e-4", help="relative-suboptimality targets")
    p.add_argument("--max-steps", type=common.count(1, MAX_STEPS), default=20000,
                   help="step cap of every iterative attacker")
    p.add_argument("--quick", action="store_true", help="a few configurations per family (smoke tests)")
    p.add_argument("--orders", type=common.count(1, W.MAX_ORDERS), default=200,
                   help="random orders of the configurations for the best-so-far curves")
    p.add_argument("--data", type=common.existing("file"),
                   help="Kaggle House Prices train.csv (default: the packaged copy)")
    p.add_argument("--on-outlier", choices=("warn", "error"), default="warn",
                   help="a cell > 1e6 × its column's median magnitude: warn or refuse the file")
    p.add_argument("--n-train", type=common.count(2, 1_000_000), default=200, help="training rows per split")
    common.add_out(p, "results/attacks")
    p.add_argument("--no-plot", action="store_true", help="skip best_so_far.png")
    common.add_jobs(p)
    mn = p.add_argument_group("MNIST (logistic probing)")
    mn.add_argument("--mnist-pairs", type=common.flag_type("pairs", "P-H,P-H,...", _pairs),
                    help="also attack these ordered pairs P-H, e.g. 0-1,7-2")
    mn.add_argument("--mnist-only", action="store_true",
                    help="attack only the MNIST pairs (no House Prices)")
    mn.add_argument("--mnist-methods", type=methods, default="closed_form,ours",
                    help="MNIST immunizers (identity added; each also hardened)")
    mn.add_argument("--mnist-seeds", type=common.seeds, default="1", metavar="N|A,B,C|A-B",
                    help="MNIST immunization seeds")
    mn.add_argument("--mnist-n-train", type=common.count(1, 500), default=100,
                    help="training images per digit")
    mn.add_argument("--mnist-epochs", type=common.count(0, MAX_EPOCHS), default=30,
                    help="immunization epochs (preset 'mnist', as experiments/mnist.py)")
    mn.add_argument("--mnist-max-steps", type=common.count(1, MAX_STEPS), default=3000,
                    help="attacker step cap")
    mn.add_argument("--logistic-ridge", type=common.real(0.0, lo_open=True), default=1e-4,
                    help="logistic probe ridge λ = r·‖Z‖₂²/4 (pycore.attacks.make_problem's ridge_rel)")
    common.add_immunize_options(p, "strict")
    p.set_defaults(harden="haar")
    return p


def _pairs(text):
    from pycore.data.mnist import parse_pairs

    return parse_pairs(text)


def prepare(args, parser) -> None:
    """The checks that involve several flags, before any compute."""
    if args.mnist_only and not args.mnist_pairs:
        raise common.UsageError("needs --mnist-pairs", "--mnist-only")
    missing = [m for m in args.hardened_methods if m not in args.methods]
    if missing:
        raise common.UsageError(f"{missing[0]!r} is not among --methods", "--hardened-methods")
    args.methods = ["identity"] + [m for m in args.methods if m != "identity"]
    args.immunizer = common.immunizer(parser, args, args.methods,
                                      "strict" if args.protocol == "strict" else "house_price")
    from pycore.immunize import options_of

    args.mnist_methods = ["identity"] + [m for m in args.mnist_methods if m != "identity"]
    has = {m: {f.name for f in dataclasses.fields(options_of(m))} for m in args.mnist_methods}
    epochs = {m: {"epochs": args.mnist_epochs} if "epochs" in has[m] else {} for m in has}   # preset "mnist"
    args.mnist_immunizer = common.Immunizer("mnist", epochs, args.certified, args.harden)
    common.check_out(args.out, OUTPUTS)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    prepare(args, parser)
    return args


# ----------------------------------------------------------------------------------------------
# variants: a method's θ as immunized, and hardened
# ----------------------------------------------------------------------------------------------
def variant_name(method: str, harden: str = "none") -> str:
    return method if harden == "none" else f"{method}+{harden}"


def variant_label(variant: str) -> str:
    """The printed name of a variant key: the method's label (pycore.report.METHOD_LABELS), then
    the hardening (``ours+haar`` → ``Ours (Alg. 1) + haar``)."""
    method, _, harden = variant.partition("+")
    return METHOD_LABELS[method] + (f" + {harden}" if harden else "")


def _digest(theta: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(theta).tobytes()).hexdigest()[:16]


def _immunize_job(job):
    """One (method, seed): θ as immunized and (if asked) hardened, with the invariants that
    hardening must keep (RIR, (i), (ii) on both row sets, the best D_P loss)."""
    from pycore.losses import best_probe_loss
    from pycore.metrics import rir

    method, seed, hardened = job
    st = _STATE
    run = st["immunize"] if hardened else dataclasses.replace(st["immunize"], harden="none")
    res = run(st["splits"]["train"], method, np.random.default_rng(seed))

    def numbers(theta):
        out = {}
        for rows, t in st["splits"].items():
            r = rir(theta, t.X_P, t.X_H)
            out[rows] = {"rir": r.value, "harmful_ratio": r.harmful_ratio, "pretrain_ratio": r.pretrain_ratio,
                         "dp_loss": best_probe_loss(t.loss, t.X_P @ theta, t.Y_P)}
        return out

    plain = res.theta if res.theta_unhardened is None else res.theta_unhardened
    entry = {"method": method, "seed": seed, "wall_seconds": res.wall_seconds,
             "diagnostics": {k: v for k, v in res.diagnostics.items() if np.isscalar(v)},
             "variants": {variant_name(method): {"theta": plain, "numbers": numbers(plain)}}}
    if res.theta_unhardened is not None:
        hv = variant_name(method, run.harden)
        entry["variants"][hv] = {"theta": res.theta, "Q": res.rotation, "numbers": numbers(res.theta),
                                 "orthogonality_defect": res.diagnostics["harden"]["orthogonality_defect"]}
    return entry


def invariance(plain: dict, hard: dict) -> dict:
    """Largest relative difference between a hardened θ's RIR, (i), (ii), best D_P loss and the
    unhardened θ's, per row set (exact invariants: docs/attacks.md §2)."""
    out = {}
    for rows in plain:
        out[rows] = max(abs(hard[rows][k] - plain[rows][k]) / abs(plain[rows][k])
                        for k in ("rir", "harmful_ratio", "pretrain_ratio", "dp_loss"))
    return out


def _grid_job(unit):
    """Every attacker configuration on one (θ, rows, task) problem."""
    digest, rows, task = unit
    st = _STATE
    t = st["splits"][rows]
    X, Y = (t.X_H, t.Y_H) if task == "D_H" else (t.X_P, t.Y_P)
    theta = st["thetas"][digest]
    prob = A.make_problem(X @ theta, Y, st["loss"], ridge_rel=st["ridge_rel"])
    run = W.run_grid(prob, st["grid"], eps=st["eps"], max_steps=st["cap"])
    return run


# ----------------------------------------------------------------------------------------------
def run(args) -> dict:
    from pycore.data.house_price import load_house_price
    from pycore.protocol import strict_protocol

    t_start = time.perf_counter()
    if args.mnist_only:
        mnist, thetas = run_mnist(args, t_start)
        first = next(iter(mnist["pairs"].values()))
        return {"experiment": "attacks", "dataset": "mnist", "protocol": "mnist", "mnist": mnist,
                "harden": args.harden,
                "seeds": mnist["seeds"], "eps": sorted(args.eps, reverse=True), "_thetas": thetas,
                "variants": first["variants"], "best_so_far": first["best_so_far"],
                **environment(), "wall_seconds": time.perf_counter() - t_start}
    data = load_house_price(args.data, n_train=args.n_train, on_outlier=args.on_outlier)
    if data.heldout is None:
        raise ValueError(f"House Prices: --n-train {args.n_train} leaves no held-out rows (lower it)")
    train, held, strict = data.train, data.heldout, None
    if args.protocol == "strict":
        train, held, strict = strict_protocol(train, held, data.feature_names)
    splits = {"train": train, "heldout": held}
    grid = tuple(c for c in W.attacker_grid("lsq", quick=args.quick) if c.family in args.attackers)
    hp = evaluate(splits, args.methods, args.hardened_methods, args.seeds, args.immunizer, grid, "lsq",
                  args.max_steps,
                  args.eps, ridge_rel=args.logistic_ridge, jobs=args.jobs, orders=args.orders,
                  label="house prices", t_start=t_start)
    result = {
        "experiment": "attacks", "dataset": "house_prices", "source": data.source,
        "protocol": args.protocol, "strict_protocol": None if strict is None else strict.as_dict(),
        "seeds": args.seeds, "methods": args.methods, "hardened_methods": args.hardened_methods,
        "harden": args.harden, "eps": sorted(args.eps, reverse=True), "step_cap": args.max_steps,
        "quick_grid": args.quick, "grid": [c.as_dict() for c in grid],
        "loss": "0.5*||Zw - y||^2 (Hessian Z^T Z = H(theta)); every attacker starts at w = 0",
        "immunize": args.immunizer.as_dict(),
        "n_rows": {rows: {"D_P": int(t.X_P.shape[0]), "D_H": int(t.X_H.shape[0])}
                   for rows, t in splits.items()},
        **hp,
    }
    thetas = result.pop("_thetas")
    for rows, t in splits.items():
        for name in ("X_P", "Y_P", "X_H", "Y_H"):
            thetas[f"data/{rows}/{name}"] = getattr(t, name)
    if args.mnist_pairs:
        result["mnist"], mnist_thetas = run_mnist(args, t_start)
        thetas.update(mnist_thetas)
    result["_thetas"] = thetas
    result.update(environment())
    result["wall_seconds"] = time.perf_counter() - t_start
    return result


def evaluate(splits, methods, hardened, seeds, immunizer, grid, loss, cap, eps, *, ridge_rel, jobs, orders,
             label, t_start):
    """Immunize ``splits['train']`` with every (method, seed) — hardened too for ``hardened`` and
    identity — then run the whole grid on D_H and D_P of every split for every distinct θ (a
    deterministic method's θ is attacked once). Returns the JSON-ready runs, the analysis, the
    best-so-far curves and the θ archive entries (``_thetas``)."""
    harden = immunizer.harden
    do_hard = harden != "none"
    jobs_a = [(m, s, do_hard and (m in hardened or m == "identity")) for s in seeds for m in methods]
    _STATE.update(splits=splits, immunize=immunizer, loss=loss, ridge_rel=ridge_rel, grid=grid,
                  eps=tuple(eps), cap=cap)
    entries = common.pool_map(_immunize_job, jobs_a, jobs, desc=f"{label}: immunizing")
    thetas_by_digest, runs, archive = {}, [], {}
    for e in entries:
        for v, blob in e["variants"].items():
            d = _digest(blob["theta"])
            thetas_by_digest[d] = blob["theta"]
            archive[f"{v}/seed{e['seed']}"] = blob["theta"]
            if "Q" in blob:
                archive[f"{v}/seed{e['seed']}/Q"] = blob["Q"]
            runs.append({"seed": e["seed"], "method": e["method"], "variant": v, "theta_digest": d,
                         "numbers": blob["numbers"], "immunize_seconds": e["wall_seconds"],
                         "diagnostics": e["diagnostics"],
                         "orthogonality_defect": blob.get("orthogonality_defect")})
        if len(e["variants"]) == 2:
            (pv, pb), (hv, hb) = e["variants"].items()
            runs[-1]["invariance_vs"] = pv
            runs[-1]["invariance"] = invariance(pb["numbers"], hb["numbers"])
    print(f"{label}: immunized {len(entries)} runs, {len(thetas_by_digest)} distinct θ "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    _STATE["thetas"] = thetas_by_digest
    units = [(d, rows, task) for d in thetas_by_digest for rows in splits for task in TASKS]
    grids = common.pool_map(_grid_job, units, jobs, desc=f"{label}: attacking")
    by_unit = dict(zip(units, grids))
    for r in runs:
        r["problems"] = {f"{rows}/{task}": by_unit[(r["theta_digest"], rows, task)].compact()
                         for rows in splits for task in TASKS}
    print(f"{label}: {len(units)} problems attacked ({time.perf_counter() - t_start:.0f}s)", flush=True)
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    analysis = W.analyse(runs, grid, sorted(eps, reverse=True), cap, rotated=variant_name("identity", harden))
    sofar = W.best_so_far_curves(runs, grid, min(eps), cap, orders)
    return {"runs": runs, "variants": variants, "analysis": analysis, "best_so_far": sofar,
            "_thetas": archive}


# ----------------------------------------------------------------------------------------------
# MNIST (logistic probing)
# ----------------------------------------------------------------------------------------------
def run_mnist(args, t_start):
    """MNIST ordered pairs (P, H) with logistic probing, immunized with the preset "mnist"
    (experiments/mnist.py's defaults) and hardened like House Prices."""
    from pycore.data.mnist import load_mnist, pair_task, split_digits

    digits = load_mnist()
    immunizer = args.mnist_immunizer
    grid = tuple(c for c in W.attacker_grid("logistic", quick=args.quick)
                 if c.family in args.attackers or c.family == "newton")
    methods = args.mnist_methods
    out = {"pairs": {}, "grid": [c.as_dict() for c in grid], "step_cap": args.mnist_max_steps,
           "ridge_rel": args.logistic_ridge, "n_train": args.mnist_n_train, "seeds": args.mnist_seeds,
           "methods": methods, "immunize": immunizer.as_dict(), "source": digits.source}
    archive = {}
    for p, h in args.mnist_pairs:
        split = split_digits(digits, args.mnist_n_train, np.random.default_rng(0))
        splits = {"train": pair_task(digits, split, p, h),
                  "heldout": pair_task(digits, split, p, h, heldout=True)}
        res = evaluate(splits, methods, methods, args.mnist_seeds, immunizer, grid, "logistic",
                       args.mnist_max_steps, args.eps, ridge_rel=args.logistic_ridge, jobs=args.jobs,
                       orders=args.orders,
                       label=f"mnist {p}-{h}", t_start=t_start)
        archive.update({f"mnist/{p}-{h}/{k}": v for k, v in res.pop("_thetas").items()})
        out["pairs"][f"{p}-{h}"] = res
    return out, archive


# ----------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------
def _fmt_one(v, kind):
    if kind == "n/a":
        return "both capped"
    txt = f"{v:.3g}" if v < 1000 else f"{v:.2e}"
    return {"=": txt, ">=": "≥" + txt, "<=": "≤" + txt}[kind]


def fmt_factors(items):
    """One cell from per-seed ``(value, kind)`` pairs: the median, and the range with > 1 seed."""
    vals = [(v, k) for v, k in items if k != "n/a"]
    if not vals:
        return "both capped"
    if len(items) == 1:
        return _fmt_one(*items[0])
    vals.sort(key=lambda x: x[0])
    med = vals[len(vals) // 2]
    lo, hi = _fmt_one(*vals[0]), _fmt_one(*vals[-1])
    return _fmt_one(*med) if lo == hi else f"{_fmt_one(*med)} ({lo}–{hi})"


def _fmt_bound(values):
    v = float(np.median(values))
    return f"{v:.3g}" if v < 1000 else f"{v:.2e}"


def _yes(x):
    return {True: "yes", False: "NO", None: "undecided (cap)"}[x]


def table_markdown(res: dict) -> str:
    if res.get("dataset") == "mnist":
        return "\n".join([f"Command: `{' '.join(res['command'][1:])}`\n"] + mnist_table(res)) + "\n"
    L = []
    ds = "House Prices" if res.get("dataset") == "house_prices" else res.get("dataset", "")
    L.append(f"# Worst-case attack evaluation: {ds}, {res['protocol']} protocol\n")
    L.append(f"Command: `{' '.join(res['command'][1:])}`  \n"
             f"Seeds {res['seeds']}; step cap {res['step_cap']}; ε ∈ {res['eps']}; hardening "
             f"`{res['harden']}` for {', '.join(res['hardened_methods']) or 'no method'} and the "
             f"identity reference; {len(res['grid'])} attacker configurations"
             + (" (quick grid)" if res["quick_grid"] else "") + ". Loss ½‖Zw − y‖², w₀ = 0; one step = one "
             "iteration (one gradient for every first-order family; L-BFGS may evaluate more per iteration; "
             "whitening also forms Σ̂ once; the closed form is one solve). Rows: train = the "
             f"{res['n_rows']['train']['D_H']}/{res['n_rows']['train']['D_P']} D_H/D_P rows used to "
             "immunize; "
             f"held-out = the other {res['n_rows']['heldout']['D_H']}/{res['n_rows']['heldout']['D_P']}. "
             "Slow-down = steps of the family's best configuration on θ / on identity (median over "
             "seeds, min–max in brackets; ≥ when θ's run hit the cap, ≤ when identity's did); [b] = what "
             "κ alone can force on the family (pycore.worst_case.kappa_bounds: GD r, momentum/CG/L-BFGS √r, "
             "Adam/Adagrad r_J, Jacobi-PCG √r_J, whitening/closed form 1; r = κ(θ)/κ(I), r_J the same for "
             "the Jacobi-scaled Hessian).\n")
    L += _invariance_lines(res)
    L += _target_lines(res)
    fams = list(dict.fromkeys(c["family"] for c in res["grid"]))
    for rows in ("train", "heldout"):
        for e in res["eps"]:
            L += _worst_table(res, rows, W._ekey(e), fams)
    L += _adam_decomposition(res)
    L += _transfer_lines(res)
    if res.get("mnist"):
        L += mnist_table(res)
    return "\n".join(L) + "\n"


def _invariance_lines(res):
    inv = [r for r in res["runs"] if "invariance" in r]
    if not inv:
        return []
    worst = max(max(r["invariance"].values()) for r in inv)
    od = max(r["orthogonality_defect"] for r in res["runs"] if r.get("orthogonality_defect") is not None)
    return [f"Hardening leaves every spectrum unchanged: over {len(inv)} hardened runs the largest relative "
            f"difference of RIR, (i), (ii) and the best D_P loss to the unhardened θ, on training and "
            f"held-out rows, is {worst:.2e}; ‖QᵀQ − I‖_max ≤ {od:.1e}.\n"]


def _target_lines(res):
    T = W.targets(res)
    if not T:
        return []
    L = ["## Hardening targets (training rows, ε = 1e-4)\n",
         "Best Adam of the grid on D_H slowed ≥ 10× against identity on every seed; D_P's best Adam not "
         "slowed "
         "by more than 1.2×; RIR, (i), (ii), best D_P loss equal to the unhardened θ's to 1e-10 relative.\n",
         "| variant | Adam D_H slow-down (per seed) | ≥ 10× every seed | Adam D_P slow-down | ≤ 1.2× | "
         "invariants (max rel. diff) | ≤ 1e-10 |", "|---|---|---|---|---|---|---|"]
    for t in T:
        per = ", ".join(_fmt_one(*x) for x in t["adam_dh"])
        perp = ", ".join(_fmt_one(*x) for x in t["adam_dp"])
        L.append(f"| {variant_label(t['variant'])} | {per} | {_yes(t['dh_ok'])} | {perp} | "
                 f"{_yes(t['dp_ok'])} | "
                 f"{t['invariance']:.1e} | {_yes(t['inv_ok'])} |")
    return L + [""]


def _worst_table(res, rows, ek, fams):
    an = res["analysis"]
    L = [f"## Worst case, {rows} rows, ε = {ek} (D_H: slowed is good for the defender)\n",
         "| θ | worst case, all attackers | worst first-order attacker (on θ) | first-order slow-down | "
         + " | ".join(fams) + " |",
         "|---|---|---|---|" + "---|" * len(fams)]
    for v, per in an.items():
        cell = per[f"{rows}/D_H"][ek]
        wa, wf = cell["worst_all"], cell["worst_first_order"]
        wa_txt = (f"{fmt_factors([(w['slowdown'], w['kind']) for w in wa])} "
                  f"({_mode([w['attacker'] for w in wa])})")
        names = _mode([f"{w['attacker']}: {'>cap' if w['steps'] is None else w['steps']} steps" for w in wf])
        fo = fmt_factors([(w["slowdown"], w["kind"]) for w in wf])
        cells = [f"{fmt_factors(cell['families'][f]['slowdown'])} "
                 f"[{_fmt_bound(cell['families'][f]['bound'])}]"
                 for f in fams]
        L.append(f"| {variant_label(v)} | {wa_txt} | {names} | {fo} | " + " | ".join(cells) + " |")
    L.append("")
    L.append(f"D_P ({rows} rows, ε = {ek}; ≤ 1 is good: pre-training probing not slowed), per family:\n")
    L.append("| θ | " + " | ".join(fams) + " |")
    L.append("|---|" + "---|" * len(fams))
    for v, per in an.items():
        cell = per[f"{rows}/D_P"][ek]
        L.append(f"| {variant_label(v)} | "
                 + " | ".join(fmt_factors(cell["families"][f]["slowdown"]) for f in fams) + " |")
    L.append("")
    return L


def _mode(items):
    """The most frequent item (first in order on ties), with '(k/n seeds)' when not unanimous."""
    items = list(items)
    best = max(dict.fromkeys(items), key=items.count)
    k = items.count(best)
    return best if k == len(items) else f"{best} ({k}/{len(items)} seeds)"


def _adam_decomposition(res):
    an = res["analysis"]
    hv = [v for v in res["variants"] if "+" in v]
    if not hv:
        return []
    L = ["## What hardening buys against diagonal preconditioners, and what an attacker who whitens "
         "recovers\n",
         "D_H, training rows. 'vs I' = against identity; 'vs IQ' = against the rotated identity (identity "
         "hardened "
         "the same way), which isolates the conditioning from the loss of the input basis. [b] as above.\n",
         "| θ | ε | Adam vs I [b] | Adam vs IQ [b] | Adagrad vs I | Jacobi-PCG vs I [b] | Jacobi-PCG vs IQ | "
         "whitening vs I | whitening vs IQ |", "|---|---|---|---|---|---|---|---|---|"]
    for v in hv:
        if v.startswith("identity+"):
            continue
        base = v.split("+")[0]
        for e in res["eps"]:
            ek = W._ekey(e)
            for name in (base, v):
                c = an[name]["train/D_H"][ek]["families"]

                def g(f, key="slowdown", c=c):
                    return fmt_factors(c[f][key]) if f in c and key in c[f] else "—"

                def b(f, key="bound", c=c):
                    return _fmt_bound(c[f][key]) if f in c and key in c[f] else "—"
                L.append(f"| {variant_label(name)} | {ek} | {g('adam')} [{b('adam')}] | "
                         f"{g('adam', 'slowdown_vs_rotated')} "
                         f"[{b('adam', 'bound_vs_rotated')}] | {g('adagrad')} | {g('pcg_jacobi')} "
                         f"[{b('pcg_jacobi')}] | {g('pcg_jacobi', 'slowdown_vs_rotated')} | {g('whiten')} | "
                         f"{g('whiten', 'slowdown_vs_rotated')} |")
    rot = variant_name("identity", res["harden"])
    if rot in an:
        for e in res["eps"]:
            ek = W._ekey(e)
            c = an[rot]["train/D_H"][ek]["families"]
            L.append(f"| {variant_label(rot)} (reference) | {ek} | "
                     f"{fmt_factors(c['adam']['slowdown']) if 'adam' in c else '—'} "
                     f"[{_fmt_bound(c['adam']['bound']) if 'adam' in c else '—'}] | — | "
                     f"{fmt_factors(c['adagrad']['slowdown']) if 'adagrad' in c else '—'} | "
                     f"{fmt_factors(c['pcg_jacobi']['slowdown']) if 'pcg_jacobi' in c else '—'} | — | "
                     f"{fmt_factors(c['whiten']['slowdown']) if 'whiten' in c else '—'} | — |")
    return L + [""]


def _transfer_lines(res):
    """Held-out vs training rows: the worst first-order slow-down and Adam's, per variant."""
    an = res["analysis"]
    e = W._ekey(min(res["eps"]))
    L = [f"## What transfers to held-out rows (D_H, ε = {e})\n",
         "| θ | RIR train → held-out | (i) train → held-out | first-order worst case train | held-out | "
         "Adam train | held-out | D_P best-attacker slow-down train | held-out |",
         "|---|---|---|---|---|---|---|---|---|"]
    nums = {}
    for r in res["runs"]:
        nums.setdefault(r["variant"], []).append(r["numbers"])
    for v, per in an.items():
        if "heldout/D_H" not in per:
            continue
        n = nums[v]
        rt = np.median([x["train"]["rir"] for x in n])
        rh = np.median([x["heldout"]["rir"] for x in n])
        it = np.median([x["train"]["harmful_ratio"] for x in n])
        ih = np.median([x["heldout"]["harmful_ratio"] for x in n])

        def wf(key):
            return fmt_factors([(w["slowdown"], w["kind"]) for w in per[key][e]["worst_first_order"]])

        def fam(key, f):
            c = per[key][e]["families"]
            return fmt_factors(c[f]["slowdown"]) if f in c else "—"
        L.append(f"| {variant_label(v)} | {rt:.4g} → {rh:.4g} | {it:.4g} → {ih:.4g} | {wf('train/D_H')} | "
                 f"{wf('heldout/D_H')} | "
                 f"{fam('train/D_H', 'adam')} | {fam('heldout/D_H', 'adam')} | {wf('train/D_P')} | "
                 f"{wf('heldout/D_P')} |")
    return L + [""]


def mnist_table(res):
    M = res["mnist"]
    L = [f"# MNIST pairs: logistic probing (BCE + ridge λ = {M['ridge_rel']:g}·‖Z‖₂²/4), "
         f"{M['n_train']} training images per digit, seeds {M['seeds']}, step cap {M['step_cap']}, "
         f"{len(M['grid'])} configurations (second-order attacker: damped Newton)\n"]
    harden = M["immunize_config"]["harden"]
    for pair, blk in M["pairs"].items():
        fams = list(dict.fromkeys(c["family"] for c in M["grid"]))
        sub = {**res, "analysis": blk["analysis"], "runs": blk["runs"], "variants": blk["variants"],
               "grid": M["grid"], "harden": harden}
        L.append(f"## pair {pair} (P = {pair.split('-')[0]}, H = {pair.split('-')[1]})\n")
        L += _invariance_lines(sub)
        L += [x.replace("## ", "### ", 1) if x.startswith("## ") else x for x in _target_lines(sub)]
        for rows in ("train", "heldout"):
            for e in res["eps"]:
                L += [x.replace("## ", "### ", 1) if x.startswith("## ") else x
                      for x in _worst_table(sub, rows, W._ekey(e), fams)]
        L += [x.replace("## ", "### ", 1) if x.startswith("## ") else x for x in _adam_decomposition(sub)]
    return L


# ----------------------------------------------------------------------------------------------
def plot_best_so_far(res: dict, path) -> None:
    """One panel per attacked θ (columns) and row set (rows): the median best-so-far slow-down over
    orders and seeds with its 10–90 % band for every family, and the median for the first-order
    families alone; the legend above the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    C, sofar = res["best_so_far"]["curves"], res["best_so_far"]
    variants = [v for v in res["variants"] if v != "identity" and any(k.startswith(v + "|") for k in C)]
    fig, axes = plt.subplots(2, len(variants), figsize=(3.4 * len(variants) + 1, 6.4), squeeze=False,
                             sharey=True)
    for col, v in enumerate(variants):
        for row, rows in enumerate(("train", "heldout")):
            ax = axes[row][col]
            for pool, color, label in (("all", "tab:blue", "every family: median, 10–90 % band"),
                                       ("first_order", "tab:orange", "first-order families: median")):
                c = C.get(f"{v}|{rows}|{pool}")
                if c is not None:
                    x = np.arange(1, len(c["median"]) + 1)
                    ax.plot(x, c["median"], color=color, lw=1.6, label=label)
                    if pool == "all":
                        ax.fill_between(x, c["q10"], c["q90"], color=color, alpha=0.2, lw=0)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.axhline(1.0, color="0.5", lw=0.8)
            ax.set_title(f"{variant_label(v)}, {'training' if rows == 'train' else 'held-out'} rows",
                         fontsize=9)
            ax.set_xlabel("configurations tried (random order)", fontsize=8)
        axes[0][0].set_ylabel("best steps on θ / best on identity", fontsize=8)
        axes[1][0].set_ylabel("best steps on θ / best on identity", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=2, fontsize=8, frameon=False)
    where = ("MNIST, first pair" if res.get("dataset") == "mnist"
             else f"House Prices, {res['protocol']} protocol")
    fig.suptitle(f"{where}, linear θ: best-so-far slow-down of the attackers on D_H, ε = {sofar['eps']:g} "
                 f"({sofar['orders_per_seed']} orders × {len(res['seeds'])} seeds)", fontsize=10, x=0.02,
                 ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from pycore.thetas import save_thetas

    parser = build_parser()

    def body(args):
        prepare(args, parser)
        res = run(args)
        archive = res.pop("_thetas")
        table = table_markdown(res)
        meta = {"protocol": res["protocol"], "seeds": res["seeds"], "harden": res["harden"],
                "command": res["command"],
                "keys": "<variant>/seed<k> = θ (D×D, features X @ θ); <variant>/seed<k>/Q = the hardening "
                        "rotation (θ = θ_unhardened @ Q); data/<rows>/<X_P|Y_P|X_H|Y_H> = the protocol's "
                        "inputs θ acts on; mnist/<P-H>/... the same per MNIST pair"}
        files = {"table.md": table, "thetas.npz": lambda p: save_thetas(p, archive, meta)}
        if not args.no_plot:
            files["best_so_far.png"] = lambda p: plot_best_so_far(res, p)
        files["results.json"] = dumps_json(res, indent=2) + "\n"
        written = common.write_outputs(args.out, files)
        print(table + "\nwrote " + ", ".join(map(str, written)) + f" in {res['wall_seconds']:.0f}s")
    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
