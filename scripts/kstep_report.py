#!/usr/bin/env python
"""The k-step immunizer (docs/theory.md §11) judged by what it did not optimise against
(docs/findings.md §2): on House Prices (both protocols, training and held-out rows) and the ten
tasks of tests/test_defaults.py (training rows), ``kstep`` and the adaptive ``ours`` (both with
the library's defaults; neither draws from its generator), against θ = I:

* the squared-loss GD probe's remaining fraction on D_H, E_k(θ)/E_k(I), at k = 1, 10, 100, 1000
  (kstep optimised k = 10 on the training rows), and on D_P at k = 10;
* ``pycore.attack_evaluation``: steps to ε per attacker family on θ against θ = I (GD, Adam,
  CG, the whitened probe, the worst case), seed 0;
* the same engine on D_P's rows (its user's squared-loss probe: it should not be slowed);
* D_P's best loss at θ = I and at θ (Definition 3.1(c), ``pycore.evaluate_linear``) and the κ
  ratios (i), (ii);
* kstep's k-step ratios with its plain θ-gradients and with K⁺-preconditioned ones.

    OMP_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell python scripts/kstep_report.py [--eps 1e-2,1e-4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pycore import (  # noqa: E402
    LinearTask,
    attack_evaluation,
    evaluate_linear,
    immunize,
    kstep_remaining,  # noqa: E402
    strict_protocol,  # noqa: E402
)
from pycore.data import load_house_price  # noqa: E402
from pycore.report import fmt  # noqa: E402

K_GRID = (1, 10, 100, 1000)
FAMILIES = ("gd", "adam", "cg", "whiten")
METHODS = ("ours", "kstep")


def tasks() -> dict:
    """name → (training task, held-out task or None)."""
    from test_defaults import TASKS  # noqa: PLC0415

    d = load_house_price()
    strict, strict_held, _ = strict_protocol(d.train, d.heldout, d.feature_names)
    out = {
        "House Prices paper": (d.train, d.heldout),
        "House Prices strict": (strict, strict_held),
    }
    out.update({name: (t, None) for name, t in TASKS.items()})
    return out


def ratio(X, Y, theta, k) -> float:
    """E_k(Xθ)/E_k(X): the GD probe's remaining fraction against θ = I's."""
    return (
        kstep_remaining(X @ theta, Y, steps=k).remaining / kstep_remaining(X, Y, steps=k).remaining
    )


def slowdown(f) -> str:
    """A family's slow-down with its kind (≥: θ's run hit the cap), n/a when both did."""
    if f.slowdown is None:
        return "n/a"
    return {">=": "≥", "<=": "≤"}.get(f.kind, "") + fmt(f.slowdown, 3)


def table(title: str, header: list[str], rows: list[str]) -> None:
    print(title, end="\n\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    print("\n".join(rows), end="\n\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--eps",
        default="1e-2,1e-4",
        help="the attackers' relative suboptimalities, comma-separated (default 1e-2,1e-4)",
    )
    args = p.parse_args(argv)
    eps = [float(e) for e in args.eps.split(",")]
    probe, attacks, dp, dp_attacks, precond = [], {e: [] for e in eps}, [], [], []
    for name, (train, held) in tasks().items():
        splits = [("train", train)] + ([("held-out", held)] if held is not None else [])
        runs = {m: immunize(train, m, rng=np.random.default_rng(0)) for m in METHODS}
        pinv = immunize(train, "kstep", rng=np.random.default_rng(0), precond="pinv")
        d, dq = runs["kstep"].diagnostics, pinv.diagnostics
        precond.append(
            f"| {name} | {fmt(d['kstep_harmful_ratio'], 3)}, {fmt(d['kstep_pretrain_ratio'], 3)}"
            f" | {fmt(dq['kstep_harmful_ratio'], 3)}, {fmt(dq['kstep_pretrain_ratio'], 3)} |"
        )
        for method, res in runs.items():
            theta = res.theta
            ev = evaluate_linear(theta, train, held)
            for rows, t in splits:
                cells = [fmt(ratio(t.X_H, t.Y_H, theta, k), 3) for k in K_GRID]
                cells.append(fmt(ratio(t.X_P, t.Y_P, theta, 10), 3))
                probe.append(f"| {name} | {method} | {rows} | " + " | ".join(cells) + " |")
                for e in eps:
                    a = attack_evaluation(theta, t, rng=np.random.default_rng(0), eps=e)
                    cells = [slowdown(a.families[f]) for f in FAMILIES]
                    cells.append(f"{slowdown(a.worst)} ({a.worst.family})")
                    attacks[e].append(f"| {name} | {method} | {rows} | {' | '.join(cells)} |")
                # D_P's own user probes D_P's rows with the squared loss (its k-step objective)
                user = LinearTask(t.X_H, t.Y_H, t.X_P, t.Y_P, name=f"{name} D_P")
                a = attack_evaluation(theta, user, rng=np.random.default_rng(0), eps=eps[0])
                cells = [slowdown(a.families[f]) for f in FAMILIES[:3]]
                dp_attacks.append(f"| {name} | {method} | {rows} | {' | '.join(cells)} |")
                s = ev.train if rows == "train" else ev.heldout
                dp.append(
                    f"| {name} | {method} | {rows} | {fmt(s.dp_loss_before)} | "
                    f"{fmt(s.dp_loss_after)} | {fmt(s.harmful_ratio, 3)} | "
                    f"{fmt(s.pretrain_ratio, 3)} |"
                )
    head = ["task", "method", "rows"]
    table(
        "GD probe's remaining fraction against θ = I: E_k(θ)/E_k(I) on D_H, and on D_P at k = 10",
        head + [f"D_H k={k}" for k in K_GRID] + ["D_P k=10"],
        probe,
    )
    for e in eps:
        table(
            f"Attackers (pycore.attack_evaluation, ε = {e:g}, seed 0): slow-down on θ against "
            "θ = I",
            head + list(FAMILIES) + ["worst"],
            attacks[e],
        )
    table(
        f"D_P's own probes (squared loss, ε = {eps[0]:g}, seed 0): slow-down on θ against θ = I "
        "(below 1: faster)",
        head + list(FAMILIES[:3]),
        dp_attacks,
    )
    table(
        "D_P's best loss at θ = I and at θ (Definition 3.1(c)), the κ ratios (i), (ii)",
        head + ["D_P loss θ = I", "D_P loss θ", "(i)", "(ii)"],
        dp,
    )
    table(
        "kstep's ((i)_k, (ii)_k) on the training rows with the plain θ-gradients (default) and "
        "K⁺-preconditioned ones",
        ["task", "precond none", "precond pinv"],
        precond,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
