#!/usr/bin/env python
"""House Prices immunization (paper Sec. 5.1, Table 1, Figure 1), or the same on a table of your
own.

Default: the paper's protocol on the packaged Kaggle data, 5 seeds, every method; ``--protocol
strict``: docs/theory.md §10.  Your own CSV (:func:`pycore.data.load_table`)::

    python experiments/house_price.py --data my.csv --target-p y --split group=harmful
    python experiments/house_price.py --data dp.csv --harmful-data dh.csv \
        --target-p y --inputs a,b,c
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from experiments import common
from pycore import (
    EvaluationReference,
    def31_exponent_window,
    evaluate_linear,
    rir_ceiling,
    strict_protocol,
)
from pycore._closed_form import auto_exponent
from pycore._evaluate import norm_ratio_curves
from pycore._hardening import invariant_change, loss_floor
from pycore._immunization import check_method_work
from pycore._probe import MAX_PROBE_STEPS
from pycore._thetas import run_thetas, task_arrays
from pycore.data import load_table
from pycore.report import (
    METHOD_LABELS as LABELS,
    environment,
    fmt,
    pm,
    save_figure,
    save_thetas,
    summarize,
)

# Paper Table 1 (5 seeds): (i) harmful ratio ↑, (ii) pre-training ratio ↓, RIR ↑.
PAPER_TABLE1 = {
    "r_ill_only": {
        "harmful_ratio": (90.02, 3.77),
        "pretrain_ratio": (72.42, 3.55),
        "rir": (1.244, 0.021),
    },
    "imma": {
        "harmful_ratio": (7.053, 1.66),
        "pretrain_ratio": (3.545, 0.88),
        "rir": (2.001, 0.187),
    },
    "opt_kappa": {
        "harmful_ratio": (1.518, 0.027),
        "pretrain_ratio": (0.016, 0.001),
        "rir": (92.58, 4.49),
    },
    "ours": {
        "harmful_ratio": (18.92, 2.06),
        "pretrain_ratio": (0.053, 0.002),
        "rir": (356.2, 5.49),
    },
}
# over seeds, per method and row set (pycore.SplitEvaluation's numbers)
SPLIT_SUMMARISED = (
    "rir",
    "harmful_ratio",
    "pretrain_ratio",
    "dp_loss_before",
    "dp_loss_after",
    "rir_range_part",
    "rir_null_part",
)
# over seeds, per method
SUMMARISED = ("fraction_of_ceiling", "null_part_fraction", "wall_seconds")
# The rows whose runs amplify round-off until their printed digits depend on OpenBLAS's kernels,
# per (protocol, preset) on the paper's data: scripts/kernel_spread.py measures every kernel set,
# tests/test_readme_numbers.py holds this list to what moved there (docs/design.md §7).  The table
# marks them KERNEL_MARK; their Definition 3.1 count and their order against the other rows are
# what a reader (and the readme check) can rely on, not their digits.
KERNEL_DEPENDENT = {
    ("paper", "house_price"): ("opt_kappa", "opt_kappa_balanced"),
    ("strict", "strict"): ("imma", "opt_kappa", "opt_kappa_balanced", "ours"),
}
KERNEL_MARK = "†"
# A null part ‖P_N(θ − I)‖_F at or below this fraction of ‖θ − I‖_F is round-off (pm's threshold
# for a std): its share prints as 0, not as digits of noise (R_ill only's exact 0 under the
# strict protocol computes as ~3e-29, docs/design.md §7).
ROUND_OFF = 1e-12
# the numbers hardening must leave unchanged on every row set (docs/findings.md §5)
HARDENING_INVARIANTS = ("rir", "harmful_ratio", "pretrain_ratio", "dp_loss_after")
OUTPUTS = ("table.md", "norm_ratio.png", "thetas.npz", "results.json")


def build_parser() -> common.Parser:
    p = common.Parser("house_price.py", __doc__)
    common.add_run_flags(p, "5", "results/house_price")
    common.add_methods(p)
    p.add_argument(
        "--protocol",
        choices=("paper", "strict"),
        default="paper",
        help="paper: the authors' 79 inputs; strict: docs/theory.md §10 (finite RIR ceiling)",
    )
    p.add_argument(
        "--paper-hparams", action="store_true", help="the paper's Table 4 values as the preset"
    )
    common.add_house_price_data(
        p,
        "a CSV file: the Kaggle train.csv, or with --target-p any table (D_P's "
        "rows, with --harmful-data)",
    )
    own = p.add_argument_group("your own table (default: the paper's House Prices data)")
    own.add_argument("--target-p", help="D_P's target column")
    own.add_argument("--target-h", help="D_H's target column (default: --target-p)")
    own.add_argument(
        "--loss",
        choices=("mse", "bce"),
        default="mse",
        help="D_P's loss: the squared loss on the z-scored target, or the logistic loss on its "
        "0/1 labels (D_H is probed with the squared loss either way)",
    )
    own.add_argument(
        "--inputs",
        type=common.comma_list(),
        help="input columns (default: every other numeric column)",
    )
    split = own.add_mutually_exclusive_group()
    split.add_argument(
        "--split", metavar="COLUMN=VALUE", help="D_H = the rows where COLUMN is VALUE"
    )
    split.add_argument(
        "--harmful-data",
        dest="harmful_path",
        type=common.existing("file"),
        help="a second CSV file holding D_H's rows",
    )
    p.add_argument(
        "--probe-steps",
        type=common.count(1, MAX_PROBE_STEPS),
        default=100,
        help="exact-line-search probing steps of Figure 1",
    )
    p.add_argument("--no-plot", action="store_true", help="skip norm_ratio.png")
    common.add_immunize_options(p, "house_price", own_table=True)
    return p


def prepare(parser, args) -> None:
    """The flags of one's own table checked together, and ``args.immunizer``: the paper's data runs
    the paper's presets (its tables must not move), one's own table the library's defaults."""
    if args.target_p is None:
        given = [
            f
            for f, v in (
                ("--target-h", args.target_h),
                ("--inputs", args.inputs),
                ("--split", args.split),
                ("--harmful-data", args.harmful_path),
                ("--loss", args.loss != "mse"),
            )
            if v
        ]
        if given:
            raise common.UsageError("needs --target-p (the columns of your own table)", given[0])
    elif args.data is None:
        raise common.UsageError("needs --data (your table)", "--target-p")
    elif args.split is None and args.harmful_path is None:
        raise common.UsageError("needs --split COLUMN=VALUE or --harmful-data FILE", "--target-p")
    preset = (
        "paper"
        if args.paper_hparams
        else None
        if args.target_p is not None
        else ("strict" if args.protocol == "strict" else "house_price")
    )
    args.immunizer = common.immunizer(parser, args, args.methods, preset)
    common.check_out(args.out, OUTPUTS)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    prepare(parser, args)
    return args


# Relative cost of one run (CPU seconds, measured): the longest batches go first, so none starts
# last.
_COST = {
    "r_ill_only": 5.0,
    "opt_kappa": 4.0,
    "opt_kappa_balanced": 4.0,
    "ours": 4.0,
    "imma": 3.0,
    "closed_form": 0.1,
    "identity": 0.0,
}


@dataclass(frozen=True)
class Shared:
    """What every batch of runs needs (bound to :func:`run_batch`, it travels with each batch)."""

    train: object
    heldout: object
    immunize: common.Immunizer
    ceiling: object
    reference: EvaluationReference


def run_batch(shared: Shared, job) -> list:
    """``(row, θ, archive entries)`` of each seed of ``job = (method, seeds)``: the seeds' runs
    stepped together (``Immunizer.batch``), then each evaluated (a run equal to the one before,
    e.g. a method that draws nothing from its generator, once)."""
    method, seeds = job
    st, harden = shared, shared.immunize.harden
    results = st.immunize.batch(st.train, method, [np.random.default_rng(s) for s in seeds])
    out, last = [], None  # (θ, its evaluation)
    for seed, res in zip(seeds, results):
        if last is None or not np.array_equal(last[0], res.theta):
            last = res.theta, evaluate(st, res.theta)
        ev = last[1]
        row = {"seed": seed, "wall_seconds": res.wall_seconds, **ev.to_dict()}
        row["diagnostics"] = res.diagnostics
        if res.theta_unhardened is not None:  # hardening must leave every number unchanged
            plain = evaluate(st, res.theta_unhardened)
            # a best loss below its floor is an exact fit's round-off
            floors = [
                {"dp_loss_after": loss_floor(t.loss, t.Y_P)} if t is not None else {}
                for t in (st.train, st.heldout)
            ]
            pairs = [(ev.train, plain.train, floors[0]), (ev.heldout, plain.heldout, floors[1])]
            row["hardening"] = {
                "kind": harden,
                "max_rel_diff_vs_unhardened": max(
                    invariant_change(getattr(a, k), getattr(b, k), floor.get(k, 0.0))
                    for a, b, floor in pairs
                    if b is not None
                    for k in HARDENING_INVARIANTS
                ),
            }
        out.append((row, res.theta, run_thetas(res, method, seed, harden)))
    return out


def evaluate(shared: Shared, theta):
    """:func:`pycore.evaluate_linear` of θ on the shared tasks, ceiling and reference."""
    return evaluate_linear(
        theta, shared.train, shared.heldout, ceiling=shared.ceiling, reference=shared.reference
    )


def batches(methods, seeds, immunizer, jobs: int) -> list:
    """The ``(method, seeds)`` batches of a run, longest first: a method whose runs draw nothing
    from their generator is one batch (its seeds are one run, computed once); the others are
    split in ``jobs`` near-equal batches, so that every worker gets a share of every method."""
    out = []
    for m in methods:
        if not immunizer.draws_random(m):
            out.append(((m, tuple(seeds)), _COST.get(m, 1.0)))
            continue
        k = -(-len(seeds) // max(1, min(jobs, len(seeds))))
        for i in range(0, len(seeds), k):
            out.append(((m, tuple(seeds[i : i + k])), _COST.get(m, 1.0) * len(seeds[i : i + k])))
    out.sort(key=lambda job: -job[1])  # stable: methods and seeds in order among equals
    return [job for job, _ in out]


def def31_summary(flags) -> dict:
    """How many runs satisfy Definition 3.1: ``{"count", "runs", "per_seed"}`` (a table prints
    k/n)."""
    flags = [bool(f) for f in flags]
    return {"count": sum(flags), "runs": len(flags), "per_seed": flags}


def summarize_method(rows: list[dict]) -> dict:
    """A method's runs summarised over seeds: :data:`SUMMARISED`, per row set
    :data:`SPLIT_SUMMARISED` and Definition 3.1's count, then the runs themselves."""
    entry = {k: summarize(r[k] for r in rows) for k in SUMMARISED}
    for split in ("train", "heldout"):
        if rows[0][split] is not None:
            entry[split] = {k: summarize(r[split][k] for r in rows) for k in SPLIT_SUMMARISED}
            entry[split]["immunized"] = def31_summary(r[split]["immunized"] for r in rows)
    entry["runs"] = rows
    return entry


def run(args) -> tuple[dict, dict]:
    """``(results, θ archive)``: every method and seed on the data of ``args``; a line at the
    start and one per batch of runs as it ends."""
    t_start = time.perf_counter()
    workers = max(1, min(args.jobs, common.usable_cores()))
    where = args.data if args.target_p is not None else "the paper's House Prices data"
    print(
        f"{len(args.methods)} method(s) × {len(args.seeds)} seed(s), {args.protocol} protocol on "
        f"{where}, {workers} worker(s)",
        flush=True,
    )
    if args.target_p is None:  # the paper's data (the Kaggle column set, checked by the loader)
        data = common.load_house_price_data(args)
    else:
        data = load_table(
            args.data,
            target_p=args.target_p,
            target_h=args.target_h,
            inputs=args.inputs,
            split=args.split,
            harmful_path=args.harmful_path,
            n_train=args.n_train,
            on_outlier=args.on_outlier,
            on_missing=args.on_missing,
            loss=args.loss,
        )
        if args.loss == "mse" and data.binary_target_p:
            print(
                f"D_P's target {args.target_p!r} holds only 0 and 1: running the squared loss on "
                "its z-scores (--loss bce runs the logistic loss on the labels)",
                flush=True,
            )
        common.say_changes(data)
    train, heldout, strict = data.train, data.heldout, None
    if args.protocol == "strict":
        train, heldout, strict = strict_protocol(train, heldout, data.feature_names)
    for method in args.methods:  # in this process, before any worker starts
        check_method_work(train, method)
    ceiling = rir_ceiling(train.X_P, train.X_H)
    window = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
    settings = args.immunizer.to_dict()
    if "closed_form" in settings["options"]:  # the exponent as used ("auto": docs/theory.md §10)
        a = settings["options"]["closed_form"]["exponent"]
        settings["closed_form_exponent"] = auto_exponent(train, ceiling)[0] if a == "auto" else a
    if strict is not None:
        print(
            f"strict protocol: dropped {len(strict.dropped_columns)} column(s) constant "
            "on D_P's training "
            f"rows; rank K_P = {strict.rank_K_P} of {strict.D_after_drop}",
            flush=True,
        )
    shared = Shared(train, heldout, args.immunizer, ceiling, EvaluationReference(train, heldout))
    jobs = batches(args.methods, args.seeds, args.immunizer, args.jobs)

    def said(k, job):
        method, seeds = job
        print(
            f"  {LABELS.get(method, method)}, seed(s) {', '.join(map(str, seeds))}: done "
            f"({k + 1}/{len(jobs)}, {time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )

    done = common.pool_map(functools.partial(run_batch, shared), jobs, args.jobs, done=said)
    outs = {(m, s): o for (m, seeds), batch in zip(jobs, done) for s, o in zip(seeds, batch)}
    per_method, thetas, archive = {m: [] for m in args.methods}, {}, {}
    for method in args.methods:
        for seed in args.seeds:
            row, theta, saved = outs[method, seed]
            per_method[method].append(row)
            thetas.setdefault(method, theta)  # the first seed drives Figure 1
            archive.update(saved)
    archive.update(task_arrays({"train": train, "heldout": heldout}))
    methods = {}
    for m, rows in per_method.items():
        entry = summarize_method(rows)
        if m in PAPER_TABLE1 and args.target_p is None:
            entry["paper"] = {k: {"mean": v[0], "std": v[1]} for k, v in PAPER_TABLE1[m].items()}
        methods[m] = entry
    curves = {
        m: {k: v.tolist() for k, v in norm_ratio_curves(th, train, args.probe_steps).items()}
        for m, th in thetas.items()
    }
    held_ceiling = rir_ceiling(heldout.X_P, heldout.X_H) if heldout is not None else None
    return {
        "experiment": "house_price",
        "protocol": args.protocol,
        "strict_protocol": None if strict is None else strict.to_dict(),
        "data": {
            "source": data.source,
            "paper": args.target_p is None,
            "features": data.feature_names,
            "targets": [args.target_p, args.target_h or args.target_p],
            "split": args.split,
            "files": [str(f) for f in (args.data, args.harmful_path) if f is not None],
            "n_train_per_split": args.n_train,
            "rows_P": data.n_rows_P,
            "rows_H": data.n_rows_H,
            "D": train.D,
            "D_input": data.train.D,
            "loss": train.loss,
            "changes": data.changes(),
            "heldout_rows_P": None if heldout is None else heldout.X_P.shape[0],
            "heldout_rows_H": None if heldout is None else heldout.X_H.shape[0],
        },
        "seeds": args.seeds,
        "immunize": settings,
        "ceiling": ceiling.exact,
        "ceiling_range_restricted": ceiling.range_restricted,
        "ceiling_detail": ceiling.to_dict(),
        "closed_form_exponent_window": None if window is None else window.to_dict(),
        "heldout_ceiling_detail": None if held_ceiling is None else held_ceiling.to_dict(),
        "methods": methods,
        "norm_ratio_curves": {"seed": args.seeds[0], "steps": args.probe_steps, "curves": curves},
        **environment(),
        "wall_seconds": time.perf_counter() - t_start,
    }, archive


def data_name(data: dict) -> str:
    """How tables and figures name the data: the paper's, or the user's file(s)."""
    if data["paper"]:
        return "House Prices"
    return " + ".join(Path(f).name for f in data["files"])


def _count(e: dict, split: str) -> str:
    """Definition 3.1 on ``split``'s rows: k of n seeds."""
    d = e[split]["immunized"] if split in e else None
    return "n/a" if d is None else f"{d['count']}/{d['runs']}"


def kernel_dependent(result: dict) -> set[str]:
    """The methods of ``result`` whose digits depend on the BLAS kernel (:data:`KERNEL_DEPENDENT`):
    measured only on the paper's data with the protocol's preset and no option of their own."""
    settings = result["immunize"]
    if not result["data"]["paper"] or settings["certified"]:
        return set()
    listed = KERNEL_DEPENDENT.get((result["protocol"], settings["preset"]), ())
    return {m for m in listed if m in result["methods"] and not settings["given"].get(m)}


def null_share_cell(share: float) -> str:
    """‖P_N(θ − I)‖_F²/‖θ − I‖_F² as the table prints it: n/a at θ = I (NaN), 0 where the null part
    is round-off (:data:`ROUND_OFF`)."""
    return fmt(0.0 if share <= ROUND_OFF**2 else share)


def table_markdown(result: dict) -> str:
    c, protocol, data = result["ceiling_detail"], result["protocol"], result["data"]
    D, paper_data = data["D"], data["paper"]
    title = (
        "House Prices: immunization results (paper Table 1)"
        if paper_data
        else f"{data_name(data)}: immunization results"
    )
    where = (
        "the paper's House Prices data"
        if paper_data
        else (
            f"D_P's target {data['targets'][0]!r}, D_H's {data['targets'][1]!r}, "
            + (
                f"D_H = rows with {data['split']}"
                if data["split"]
                else f"D_H = the rows of {data['files'][-1]}"
            )
            + f", {data['D_input']} input columns"
            + (f", D_P's loss {data['loss']}" if data.get("loss", "mse") != "mse" else "")
        )
    )
    heading = (
        f"# {title}, {protocol} protocol"
        if paper_data
        else f"# {title}" + (", strict protocol" if protocol == "strict" else "")
    )
    rows = (
        ""
        if paper_data
        else f" Training rows: the first {data['n_train_per_split']} of each split in file "
        "order, the same for every seed: ± is the spread of a method's own randomness (0 for "
        "one that draws nothing at random); "
        "each split z-scored with the mean and std of all its rows, empty cells 0 before."
    )
    lines = [
        heading,
        "",
        f"Data {data['source']} ({where}); seeds {result['seeds']}; mean ± std "
        "(population) over seeds." + rows + " "
        "(i) = κ(H_H(θ))/κ(H_H(I)) ↑, (ii) = κ(H_P(θ))/κ(H_P(I)) ↓, RIR = (i)/(ii) ↑, "
        "on the training rows "
        "as in the paper; held-out RIR on the rows not used for training; Def. 3.1 = "
        "seeds with (i) > 1 and "
        "(ii) < 1 (training / held-out rows); fraction = RIR / range-restricted ceiling.",
    ]
    st = result.get("strict_protocol")
    if st:
        lines += [
            "",
            f"Strict protocol: dropped {len(st['dropped_columns'])} input column(s) constant on "
            f"D_P's training rows ({', '.join(st['dropped_columns']) or 'none'}); rank K_P = "
            f"{st['rank_K_P']} of {st['D_after_drop']}, D_H's weight on null(K_P) "
            f"{fmt(st['null_leak_after_drop'])}·‖K_H‖"
            + (
                f"; both tasks restricted to range(K_P) ({st['restriction']}, θ is "
                f"{st['D']}×{st['D']})"
                if st["restricted"]
                else ""
            )
            + f"; null(K_P) ⊆ null(K_H): {st['inclusion_holds']}.",
        ]
    pcols = ["paper (i)", "paper (ii)", "paper RIR"] if paper_data else []  # the paper's data only
    marked = kernel_dependent(result)
    label = {m: LABELS[m] + (f" {KERNEL_MARK}" if m in marked else "") for m in result["methods"]}
    if marked:  # in the paragraph just before the table: docs/results.md keeps that one
        lines += [""] * (not st) + [
            f"{KERNEL_MARK} Kernel-dependent: these runs amplify round-off, so their digits "
            "differ between CPUs (OpenBLAS picks its kernels by CPU); their Definition 3.1 "
            "counts hold on every kernel, and so does their order against each row outside "
            "their range (ranges and rule: docs/design.md §7).",
        ]
    lines += [
        "",
        "| method | (i) ↑ | (ii) ↓ | RIR ↑ | Def. 3.1 seeds | held-out RIR | held-out Def. 3.1 "
        "| fraction of ceiling |" + "".join(f" {c} |" for c in pcols),
        "|---" * (8 + len(pcols)) + "|",
    ]
    for m, e in result["methods"].items():
        paper = PAPER_TABLE1.get(m)
        pcols = (
            (
                [
                    f"{paper[k][0]:g} ± {paper[k][1]:g}"
                    for k in ("harmful_ratio", "pretrain_ratio", "rir")
                ]
                if paper
                else ["—"] * 3
            )
            if paper_data
            else []
        )
        t, held = e["train"], pm(e["heldout"]["rir"]) if "heldout" in e else "n/a"
        lines.append(
            f"| {label[m]} | {pm(t['harmful_ratio'])} | {pm(t['pretrain_ratio'])} | "
            f"{pm(t['rir'])} | "
            f"{_count(e, 'train')} | {held} | {_count(e, 'heldout')} | "
            f"{fmt(e['fraction_of_ceiling']['mean'])} |" + "".join(f" {c} |" for c in pcols)
        )
    lines += [
        "",
        "Range/null decomposition (docs/theory.md §8): RIR of θ_range = P_N + P_Rθ (what D_P's "
        "training rows see) and of θ_null = P_R + P_Nθ, P_R from the training rows' "
        "K_P; null share = "
        "‖P_N(θ − I)‖_F² / ‖θ − I‖_F².",
        "",
        "| method | RIR | range part | null part | held-out RIR | held-out range part | "
        "held-out null part | null share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        if "train" in e:
            cells = [
                pm(e[split][k]) if split in e else "n/a"
                for split in ("train", "heldout")
                for k in ("rir", "rir_range_part", "rir_null_part")
            ]
            share = null_share_cell(e["null_part_fraction"]["mean"])
            lines.append(f"| {label[m]} | " + " | ".join(cells) + f" | {share} |")
    lines += [
        "",
        f"RIR ceiling (docs/theory.md §10): exact = {fmt(result['ceiling'])} — {c['reason']}.",
        f"Restricted to range(K_P): {fmt(result['ceiling_range_restricted'])} "
        f"(κ(C) = {fmt(c['kappa_C'])}, κ(K_P) = {fmt(c['kappa_K_P'])}, κ(K_H) = "
        f"{fmt(c['kappa_K_H'])}, "
        f"rank K_P = {c['rank_K_P']}/{D}, "
        f"rank K_H = {c['rank_K_H']}/{D}).",
    ]
    w = result.get("closed_form_exponent_window")
    if w:
        lines.append(
            "Closed form s² = λ_C^a: Definition 3.1 holds on the training rows for "
            f"{fmt(w['low'])} "
            f"{'<' if w['low'] > 0 else '≤'} a < {fmt(w['high'])}"
            + (" (empty window)" if w["empty"] else "")
            + (
                f"; the closed form used a = {fmt(result['immunize']['closed_form_exponent'])}."
                if "closed_form_exponent" in result["immunize"]
                else "."
            )
        )
    if result.get("heldout_ceiling_detail"):
        hc = result["heldout_ceiling_detail"]
        lines.append(
            f"Held-out rows: exact ceiling {fmt(hc['exact'])}, range-restricted "
            f"{fmt(hc['range_restricted'])}."
        )
    dp = [
        f"{LABELS[m]} {fmt(t['dp_loss_before']['mean'])} → {fmt(t['dp_loss_after']['mean'])}"
        for m, t in ((m, e["train"]) for m, e in result["methods"].items() if "train" in e)
    ]
    if dp:
        lines += [
            "",
            "Best D_P training loss of a linear head (Definition 3.1(c)), before → after: "
            + "; ".join(dp)
            + ".",
        ]
    lines += common.immunize_lines(
        result, "RIR, (i), (ii) (training and held-out) and best D_P loss"
    )
    return "\n".join(lines) + "\n"


def plot_norm_ratio(result: dict, path) -> None:
    """Figure 1: probing convergence on D_P and D_H, one line per method, the legend beside the
    panels."""
    plt = common.pyplot()
    curves = result["norm_ratio_curves"]["curves"]
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.2))
    for ax, task, title in (
        (axes[0], "D_P", "pre-training task D_P (faster is better)"),
        (axes[1], "D_H", "harmful task D_H (slower is better)"),
    ):
        for m, c in curves.items():
            y = np.maximum(np.asarray(c[task]), 1e-300)
            ax.semilogy(
                np.arange(len(y)),
                y,
                label=LABELS[m],
                lw=2.2 if m in ("identity", "ours") else 1.4,
                ls="--" if m == "identity" else "-",
            )
        # an exactly conditioned H
        if min(float(np.min(c[task])) for c in curves.values()) < 1e-10:
            ax.set_ylim(bottom=1e-10)  # converges to round-off
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("linear-probing step (GD, exact line search)")
        ax.set_ylabel("‖w_t − w*‖² / ‖w_0 − w*‖²")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    data = result["data"]
    fig.suptitle(
        f"{data_name(data)} ({result['protocol']} protocol), linear θ ({data['D']}×{data['D']}), "
        f"seed {result['norm_ratio_curves']['seed']}: probing each method's features"
        + (" (paper Figure 1)" if data["paper"] else "")
    )
    save_figure(fig, path)


def thetas_meta(result: dict) -> dict:
    """What thetas.npz holds (its ``meta`` entry; pycore.report.load_thetas reads it back)."""
    return {
        "experiment": result["experiment"],
        "protocol": result["protocol"],
        "seeds": result["seeds"],
        "harden": result["immunize"]["harden"],
        "command": result["command"],
        "keys": "<method>/seed<k> = θ (D×D; features X @ θ); with --harden: "
        "<method>+<kind>/seed<k> = "
        "the hardened θ and <method>+<kind>/seed<k>/Q its rotation (hardened = unhardened @ Q); "
        "data/<train|heldout>/<X_P|Y_P|X_H|Y_H> = the protocol's inputs and targets",
    }


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        prepare(parser, args)
        result, archive = run(args)
        common.write_run(
            args.out,
            table_markdown(result),
            result,
            {
                "thetas.npz": lambda p: save_thetas(p, archive, thetas_meta(result)),
                "norm_ratio.png": None if args.no_plot else lambda p: plot_norm_ratio(result, p),
            },
        )

    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
