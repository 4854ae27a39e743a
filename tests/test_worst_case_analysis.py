"""The worst case over seeds (:func:`pycore.attacks.analyse`, docs/findings.md §4–5): the analysis
agrees with the attacker grid's raw steps."""

import numpy as np
import pytest

import pycore._worst_case as W
from pycore import ParameterError, attacks as A
from pycore._worst_case_analysis import Variant, VariantRun, analyse, best_so_far_curves, targets
from tests.helpers import known_kappa


def test_analysis_over_seeds_agrees_with_the_grid_runs():
    X, theta, y = known_kappa(1)
    grid = A.attacker_grid("mse", quick=True)
    Qr = np.linalg.qr(np.random.default_rng(2).standard_normal((X.shape[1],) * 2))[0]
    identity, rotated, m, hardened = (
        Variant("identity"),
        Variant("identity", "haar"),
        Variant("m"),
        Variant("m", "haar"),
    )
    thetas = {identity: np.eye(X.shape[1]), rotated: Qr, m: theta, hardened: theta @ Qr}
    problems = {
        v: {
            "train": {
                t: A.run_grid(A.make_problem(X[r] @ th, y[r]), grid, eps=(1e-4,), max_steps=1000)
                for t, r in (("D_H", slice(0, 30)), ("D_P", slice(20, 50)))
            }
        }
        for v, th in thetas.items()
    }
    runs = [
        VariantRun(
            seed=s,
            variant=v,
            theta_digest="",
            numbers={},
            immunize_seconds=0.0,
            diagnostics={},
            problems=p,
            invariance={"train": 1e-13} if v.hardened else None,
        )
        for s in (0, 1)
        for v, p in problems.items()
    ]
    an = analyse(runs, grid, [1e-4], 1000, rotated=rotated)
    assert an.variants == [rotated, m, hardened]
    cell = an(hardened, "train", "D_H", 1e-4)
    run, ref, rot = (problems[v]["train"]["D_H"] for v in (hardened, identity, rotated))
    fb, fr, fo = (W.family_best(r, 1e-4) for r in (run, ref, rot))
    for fam in ("adam", "cg", "closed_form"):
        c = cell.families[fam]
        assert c.slowdown == (W.slowdown(fb[fam].steps, fr[fam].steps, 1000),) * 2
        assert c.slowdown_vs_rotated[0] == W.slowdown(fb[fam].steps, fo[fam].steps, 1000)
    assert an(m, "train", "D_H", 1e-4).families["adam"].slowdown_vs_rotated is None
    assert cell.worst_all[0] == A.worst_case(run, ref, 1e-4)
    curves = best_so_far_curves(runs, grid, 1e-4, 1000, 20).curve(hardened, "train", "all")
    # ends at the worst case
    assert curves.median[-1] == pytest.approx(cell.worst_all[0].slowdown)
    [t] = targets(runs, an)
    assert t.variant == hardened and t.inv_ok is True
    assert t.dh_ok == W.within(cell.families["adam"].slowdown, low=10)


def test_runs_without_their_reference_are_refused():
    X, theta, y = known_kappa(1)
    grid = A.attacker_grid("mse", quick=True)
    problems = {
        "train": {"D_H": A.run_grid(A.make_problem(X @ theta, y), grid, eps=(1e-4,), max_steps=50)}
    }

    def run(seed, variant):
        return VariantRun(seed, variant, "", {}, 0.0, {}, problems)

    lone = [run(0, Variant("identity")), run(0, Variant("m")), run(1, Variant("m"))]
    for runs in ([], lone):  # no runs; seed 1 without identity's run
        for call in (
            lambda: analyse(runs, grid, [1e-4], 50),
            lambda: best_so_far_curves(runs, grid, 1e-4, 50, 5),
        ):
            with pytest.raises(ParameterError) as info:
                call()
            assert info.value.parameter == "runs"
    an = analyse(lone[:2], grid, [1e-4], 50)
    assert an.variants == [Variant("m")] and an(Variant("m"), "train", "D_H", 1e-4) is not None
