"""Seeds as a batch dimension (docs/design.md §6): a stack of runs gives each run the bits it gets
alone; the small-side spectra and directions equal the D×D formulas to round-off; rows of θ no
gradient can reach stay as they started; runs that draw nothing from their generator are one."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from pycore import LinearTask, immunize, immunize_batch, options_of
from pycore._immunization import resolve_options
from pycore._precondition import FactorPreconditioner, Preconditioner
from pycore.linalg import GramStack, hessian_regularizer


def dead_column_task(seed=0, N=90, D=9, loss="mse"):
    """Columns 2 (dead in both tasks), 5 (dead in D_P only) and 7 (dead in D_H only)."""
    rng = np.random.default_rng(seed)
    X_P = rng.standard_normal((N, D)) * np.geomspace(1, 0.05, D)
    X_H = rng.standard_normal((N, D)) @ rng.standard_normal((D, D))
    X_P[:, [2, 5]] = 0.0
    X_H[:, [2, 7]] = 0.0
    Y_P = (X_P[:, :1] > 0).astype(float) if loss == "bce" else rng.standard_normal((N, 1))
    return LinearTask(X_P, Y_P, X_H, rng.standard_normal((N, 1)), loss=loss)


LOOPS = ["ours", "opt_kappa", "opt_kappa_balanced", "imma", "r_ill_only"]
SETTINGS = {
    "house_price": dict(preset="house_price", epochs=3, batch_size=32),
    "strict": dict(preset="strict", epochs=3, batch_size=32),
    "mnist": dict(preset="mnist", epochs=4),
    "exact_random": dict(preset="house_price", epochs=3, precond="exact", init="random"),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", LOOPS)
def test_a_stack_gives_each_run_its_own_bits(method, setting):
    """Bit for bit: a run's numbers do not depend on the other runs of its stack."""
    names = {f.name for f in fields(options_of(method))}
    kw = {k: v for k, v in SETTINGS[setting].items() if k == "preset" or k in names}
    task = dead_column_task(1, loss="bce" if setting == "mnist" else "mse")
    seeds = (3, 0, 7)
    stack = immunize_batch(task, method, rngs=[np.random.default_rng(s) for s in seeds], **kw)
    for seed, res in zip(seeds, stack):
        alone = immunize(task, method, rng=np.random.default_rng(seed), **kw)
        np.testing.assert_array_equal(res.theta, alone.theta)
        assert res.history == alone.history
        np.testing.assert_array_equal(res.rir, alone.rir)
    options = resolve_options(method, kw.pop("preset"), **kw)
    assert options.draws_random != np.array_equal(stack[0].theta, stack[1].theta)


def test_runs_that_draw_nothing_are_one_run():
    task = dead_column_task(2)
    rngs = [np.random.default_rng(s) for s in range(3)]
    states = [r.bit_generator.state for r in rngs]
    runs = immunize_batch(task, "r_ill_only", rngs=rngs, preset="house_price", epochs=2)
    assert all(np.array_equal(r.theta, runs[0].theta) for r in runs)
    assert runs[0].theta is not runs[1].theta  # each result owns its arrays
    assert [r.bit_generator.state for r in rngs] == states  # no generator was touched
    assert not resolve_options("r_ill_only").draws_random
    assert resolve_options("r_ill_only", init="random").draws_random
    assert not resolve_options("ours").draws_random  # the adaptive default, from θ = I
    assert resolve_options("ours", "strict").draws_random


@pytest.mark.parametrize("method", ["ours", "opt_kappa", "imma", "r_ill_only"])
def test_rows_no_gradient_reaches_stay_as_they_started(method):
    """Column 2 is zero in both tasks: θ's row 2 never moves; rows dead in one task move when a
    term of the method reaches them."""
    task = dead_column_task(3)
    th = immunize(task, method, rng=np.random.default_rng(0), preset="house_price", epochs=3).theta
    eye = np.eye(task.D)
    np.testing.assert_array_equal(th[2], eye[2])
    assert not np.array_equal(th[5], eye[5])  # D_H varies there
    # D_P varies there: the D_P loss and R_well reach it, R_ill only's K_H⁺ step does not
    assert np.array_equal(th[7], eye[7]) == (method == "r_ill_only")


def _stack_and_dense(seed, N, D, rank=None):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D)) * np.exp(rng.normal(0, 1, D))
    if rank is not None:
        X = X[:, :rank] @ rng.standard_normal((rank, D))
    task = LinearTask(X, rng.standard_normal(N), X[::-1] * 1.3, rng.standard_normal(N))
    theta = np.eye(D) + 0.2 * rng.standard_normal((2, D, D))
    return task, theta


@pytest.mark.parametrize("shape", [(60, 8, None), (12, 30, None), (50, 10, 6)])
@pytest.mark.parametrize("kind", ["well", "ill"])
def test_small_side_spectra_and_terms_match_the_dxd_path(shape, kind):
    """GramStack (r×r W = FFᵀ, F = Aθ) against hessian_regularizer (D×D or N×N from Z = Xθ): the
    same κ, rank, ties and gradient G = a·vvᵀ − b·H to round-off."""
    N, D, rank = shape
    task, theta = _stack_and_dense(4, N, D, rank)
    gram = GramStack(task.factor_P.features(theta), D)
    term = gram.term(kind)
    for b in range(2):
        Z = task.X_P @ theta[b]
        reg = hessian_regularizer(Z, kind)
        assert gram.rank[b] == reg.info.rank
        assert gram.kappa[b] == pytest.approx(reg.info.kappa, rel=1e-9)
        assert bool(gram.tie_max[b]) == reg.info.tie_max
        assert bool(gram.tie_min[b]) == reg.info.tie_min
        v = gram.v(term.index)[b]
        G = term.a[b] * np.outer(v, v) - term.b[b] * (Z.T @ Z)
        np.testing.assert_allclose(G, reg.G, rtol=0, atol=1e-9 * np.abs(reg.G).max())
        # FG = EF, the identity the directions rest on
        F = gram.F[b]
        np.testing.assert_allclose(
            term.E[b] @ F, F @ reg.G, rtol=0, atol=1e-9 * np.abs(F @ reg.G).max()
        )


@pytest.mark.parametrize(
    "mode,ridge", [("pinv", 0.0), ("ridge", 1e-3), ("none", 0.0), ("exact", 0.0)]
)
@pytest.mark.parametrize("shape", [(60, 8, None), (12, 30, None), (50, 10, 6)])
def test_factor_directions_match_the_preconditioner(mode, ridge, shape):
    N, D, rank = shape
    task, theta = _stack_and_dense(5, N, D, rank)
    gram = GramStack(task.factor_H.features(theta), D)
    term = gram.term("ill")
    L, R = FactorPreconditioner(task.factor_H, mode, ridge).parts(theta, gram, term, [2.0, 3.0])
    pre = Preconditioner(task.K_H, mode, ridge, task.X_H)
    for b, w in enumerate((2.0, 3.0)):
        Z = task.X_H @ theta[b]
        want = w * pre(theta[b], hessian_regularizer(Z, "ill").G)
        got = L[b] @ R[b]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-8 * np.abs(want).max())


def test_a_stack_wider_than_a_cache_chunk_gives_each_run_its_own_bits():
    """Adam steps a stack a cache-sized chunk at a time: three 120×120 θ's (43,200 entries) are
    cut inside a run and inside a row, one run alone (14,400) is one chunk; the bits agree."""
    rng = np.random.default_rng(0)
    X_P, X_H = rng.standard_normal((40, 120)), rng.standard_normal((40, 120))
    task = LinearTask(X_P, rng.standard_normal(40), X_H, rng.standard_normal(40))
    kw = dict(epochs=2, batch_size=None, init="random")
    stack = immunize_batch(
        task, "opt_kappa", rngs=[np.random.default_rng(s) for s in range(3)], **kw
    )
    for seed, res in enumerate(stack):
        alone = immunize(task, "opt_kappa", rng=np.random.default_rng(seed), **kw)
        np.testing.assert_array_equal(res.theta, alone.theta)


def test_house_price_batches_keep_seed_free_methods_whole_and_split_the_rest():
    from experiments import common, house_price

    imm = common.Immunizer("strict", {})
    jobs = house_price.batches(["identity", "r_ill_only", "ours", "imma"], [0, 1, 2, 3, 4], imm, 2)
    assert ("r_ill_only", (0, 1, 2, 3, 4)) in jobs and ("identity", (0, 1, 2, 3, 4)) in jobs
    assert [j for j in jobs if j[0] == "ours"] == [("ours", (0, 1, 2)), ("ours", (3, 4))]
    assert jobs[0] == ("ours", (0, 1, 2))  # the costliest first
    seeds = sorted(s for m, ss in jobs if m == "imma" for s in ss)
    assert seeds == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("method", LOOPS)
def test_a_task_with_zero_inputs_is_a_spectrum_error(method):
    from pycore import SpectrumError

    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 4))
    task = LinearTask(X, rng.standard_normal(30), np.zeros((30, 4)), rng.standard_normal(30))
    with pytest.raises(SpectrumError, match="zero"):
        immunize(task, method, rng=rng, preset="house_price", epochs=2)
