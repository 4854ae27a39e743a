"""Linear probes in float64 NumPy (pycore/deep/_probes.py; paper Eq. (4), Figure 3): the Adam grid
is its settings run alone and torch.optim.Adam's arithmetic, the GD probe is scale-free, and
whitening undoes any invertible linear map of the features."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pycore.deep._probes import (
    AdamProbe,
    GDProbe,
    linear_probe_curve,
    preprocess_features,
    probe_inputs,
)
from pycore.deep._slowdown import Eval

LRS = (1e-3, 1e-2, 1e-1)


@pytest.fixture(scope="module")
def task():
    """300 rows of 6 features, 3 classes a shift apart: train 200, validation 50, test 50."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    Z = rng.standard_normal((300, 6)) + 1.5 * np.eye(3, 6)[y]
    return Z, y


def _adam(task, lrs, *, Z=None, batch_size=32, seed=3):
    Zs, y = task
    Zs = Zs if Z is None else Z
    A, Av, At = probe_inputs(Zs[:200], Zs[200:250], Zs[250:])
    return AdamProbe(
        A,
        y[:200],
        (Av, y[200:250]),
        (At, y[250:]),
        lrs=lrs,
        classes=3,
        batch_size=batch_size,
        seed=seed,
    )


def test_an_adam_grid_steps_each_rate_as_it_would_alone(task):
    """The heads of a grid, advanced together or in turns (as a race does after widening), end
    bit for bit where one probe per rate ends after the same steps, with the same accuracies."""
    grid = _adam(task, LRS)
    got = [[] for _ in LRS]
    for active in ([True, True, True], [True, False, True], [False, False, True]) * 5:
        targets = [int(grid.steps[g]) + 1 if on else None for g, on in enumerate(active)]
        for g, e in enumerate(grid.advance(targets)):
            if e is not None:
                got[g].append(e)
    for g, lr in enumerate(LRS):
        alone = _adam(task, (lr,))
        want = [alone.advance([k])[0] for k in range(1, int(grid.steps[g]) + 1)]
        assert np.array_equal(grid.W[g], alone.W[0]), lr
        assert grid.test(g) == alone.test(0)
        assert [(e.step, e.validation) for e in got[g]] == [
            (e.step, e.validation) for e in want if e.step in {x.step for x in got[g]}
        ]
    assert grid.steps.tolist() == [10, 5, 15]  # the heads ended at different steps
    assert not np.array_equal(grid.W[0], grid.W[2])


def test_each_head_is_torch_adam_on_the_same_batches(task):
    """torch.optim.Adam (its defaults) on the softmax cross-entropy of the same mini-batches (a
    permutation per epoch from ``default_rng([seed, epoch])``, the incomplete batch dropped):
    the same weights to float64 round-off."""
    Z, y = task
    probe = _adam(task, LRS, batch_size=32, seed=3)
    steps = 15  # two epochs of 6 batches and a half
    probe.advance([steps] * len(LRS))
    A = torch.from_numpy(probe_inputs(Z[:200])[0])
    Y = torch.from_numpy(y[:200])
    for g, lr in enumerate(LRS):
        W = torch.zeros(A.shape[1], 3, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([W], lr=lr)
        for t in range(steps):
            epoch, k = divmod(t, 200 // 32)
            idx = torch.from_numpy(np.random.default_rng([3, epoch]).permutation(200))
            idx = idx[k * 32 : (k + 1) * 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(A[idx] @ W, Y[idx]).backward()
            opt.step()
        want = W.detach().numpy()
        np.testing.assert_allclose(probe.W[g], want, rtol=0, atol=1e-14 * np.abs(want).max())
        assert np.abs(want).max() > 10 * lr  # it moved: the comparison can fail


def test_the_gd_probe_is_scale_free(task):
    """Features ×100 (or ÷1000) give the same accuracies after every step: the step is 1/L and
    the bias column scales with the features, so no extractor fakes a slow-down by shrinking
    them."""
    Z, y = task
    curves = [
        linear_probe_curve(
            s * Z[:200],
            y[:200],
            s * Z[250:],
            y[250:],
            epochs=15,
            validation=(s * Z[200:250], y[200:250]),
        )
        for s in (1.0, 100.0, 1e-3)
    ]
    assert curves[0].test_accuracy == curves[1].test_accuracy == curves[2].test_accuracy
    assert curves[0].validation_accuracy == curves[1].validation_accuracy
    assert curves[0].test_accuracy[-1] > curves[0].test_accuracy[0] + 20  # it learned


def test_the_gd_probe_takes_its_step_from_the_spectrum():
    A = np.diag([3.0, 1.0, 0.5])
    probe = GDProbe(A, [0, 1, 2], (A, [0, 1, 2]), (A, [0, 1, 2]), classes=3)
    assert probe.eta == pytest.approx(3 / 9.0, rel=1e-15)  # N / λ_max(AᵀA)
    first = probe.advance([1])[0]
    assert isinstance(first, Eval) and first.step == 1


def test_whitening_undoes_an_invertible_linear_map(task):
    """The whitened features of Z and of Z·M (M invertible, condition number 100) differ by a
    rotation, so the GD probe, which is rotation-invariant, gives the same accuracies on both;
    without whitening the map slows it."""
    Z, y = task
    rng = np.random.default_rng(5)
    Q1, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    Q2, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    M = Q1 @ np.diag(np.geomspace(1.0, 100.0, 6)) @ Q2
    # exactly without the eigenvalue floor ...
    (a, a_test), (b, b_test) = (
        preprocess_features(X[:200], X[200:], "whiten", ridge=0.0) for X in (Z, Z @ M)
    )
    np.testing.assert_allclose(np.cov(a.T, bias=True), np.eye(6), atol=1e-10)
    R = np.linalg.lstsq(a, b, rcond=None)[0]  # b = a R, R orthogonal
    np.testing.assert_allclose(R.T @ R, np.eye(6), atol=1e-10)
    np.testing.assert_allclose(b_test, a_test @ R, atol=1e-10)
    # ... and the attacker's (floored at 1e-6 λ_max) gives the same accuracies
    (a, a_test), (b, b_test) = (
        preprocess_features(X[:200], X[200:], "whiten") for X in (Z, Z @ M)
    )

    def curve(tr, te):
        return linear_probe_curve(tr, y[:200], te[50:], y[250:], epochs=10).test_accuracy

    assert curve(a, a_test) == curve(b, b_test)
    raw = curve(Z[:200] @ M, Z[200:] @ M)
    assert raw[5] < curve(a, a_test)[5] - 5  # the map did slow the plain probe


@pytest.mark.parametrize("kind", ["scale", "standardize"])
def test_scaling_and_standardising_are_undone_for_the_adam_probe(task, kind):
    Z, y = task
    runs = []
    for X in (Z, 1e-3 * Z):
        a, b = preprocess_features(X[:200], X[200:], kind)
        probe = _adam((np.vstack([a, b]), y), LRS)
        curve = []
        for k in range(1, 9):
            probe.advance([k] * len(LRS))
            curve.append([probe.test(g) for g in range(len(LRS))])
        runs.append(curve)
    np.testing.assert_allclose(runs[0], runs[1])


def test_probe_inputs_refuse_features_that_are_not_finite(task):
    Z, _ = task
    bad = Z.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError):
        probe_inputs(Z, bad)
    with pytest.raises(ValueError):
        probe_inputs(bad)
    with pytest.raises(ValueError):
        preprocess_features(Z, Z, "pca")
