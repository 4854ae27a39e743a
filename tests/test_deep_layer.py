"""The immunization layer as the linear problem (:func:`pycore.deep._layer.adaptive_layer`;
docs/design.md §4): its steps from the small side of the Gram matrices equal the D×D ones, the
default starts from the closed form at its window's balanced exponent (whose margin no step
improves), that exponent lies inside the window, and features float32 does not resolve are refused
before any step."""

import numpy as np
import pytest
import torch

from pycore import LinearTask, ParameterError, def31_exponent_window, immunize, rir, rir_ceiling
from pycore._adaptive import AdaptiveSettings, adaptive_descent
from pycore._precondition import precondition
from pycore._regularizers import grad_theta_and_regularizer
from pycore.deep._layer import adaptive_layer, attainability, closed_form_layer


def _pair(seed, N_P, N_H, D):
    """Two tasks whose column scales run opposite ways: an open Definition 3.1 window."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(1.0, 0.05, D)
    X_P = rng.standard_normal((N_P, D)) * scales
    X_H = rng.standard_normal((N_H, D)) * scales[::-1] + 0.1 * rng.standard_normal((N_H, D))
    return X_P, X_H


def _margin(theta, X_P, X_H):
    r = rir(theta, X_P, X_H)
    return min(np.log(r.harmful_ratio), -np.log(r.pretrain_ratio))


def _dense_rule(X_P, X_H, ref, mode):
    """The adaptive rule's two callables from the D×D matrices: H = θᵀKθ, its eigh, G and K⁺
    (or K⁻¹) times ∇_θR = 2KθG (docs/theory.md §4); ``ref``: κ(K_P), κ(K_H)."""
    K = (X_P.T @ X_P, X_H.T @ X_H)

    def log_ratios(theta):
        kP, kH = (grad_theta_and_regularizer(theta, k, "well")[1].info.kappa for k in K)
        return np.log(kH / ref[1]), np.log(kP / ref[0])

    def directions(theta):
        return tuple(
            precondition(theta, grad_theta_and_regularizer(theta, k, kind)[1].G, k, mode)
            for k, kind in zip(K, ("well", "ill"))
        )

    return log_ratios, directions


@pytest.mark.parametrize("N,D", [(12, 20), (40, 9)])
def test_the_small_side_equals_the_dxd_computation(N, D):
    """Twenty steps of the layer's rule from θ = I, every κ and preconditioned direction from the
    r×r W = FFᵀ (N < D: K⁺; N > D: the exact preconditioner), follow the rule run on the D×D
    H = θᵀKθ, its eigen-decomposition, G and K⁺, to round-off."""
    X_P, X_H = _pair(1, N, N + 3, D)
    sol = adaptive_layer(X_P, X_H, steps=20, patience=1000, lr=0.05, start="identity")
    c = rir_ceiling(X_P, X_H)
    rule = _dense_rule(X_P, X_H, (c.kappa_K_P, c.kappa_K_H), "pinv" if N < D else "exact")
    dense = adaptive_descent(np.eye(D), *rule, AdaptiveSettings(lr=0.05, epochs=20, patience=1000))
    assert sol.steps == dense.steps == 20
    for key in ("harmful_ratio", "pretrain_ratio"):
        np.testing.assert_allclose(sol.history[key], dense.history[key], rtol=1e-9)
    assert np.linalg.norm(sol.theta - dense.theta) <= 1e-9 * np.linalg.norm(dense.theta)


def test_the_default_starts_from_the_closed_form_and_no_step_gains_margin():
    """From the closed form at the window's balanced exponent the margin is min(½ ln ceiling,
    ln κ(K_P)), a bound no θ reading range(K_P) exceeds: the default takes no step, and 200 steps
    of the rule without the bound find no larger margin."""
    X_P, X_H = _pair(3, 30, 40, 12)
    sol = adaptive_layer(X_P, X_H, steps=5000, patience=300)
    c = rir_ceiling(X_P, X_H)
    window = def31_exponent_window(c)
    bound = min(0.5 * np.log(c.range_restricted), np.log(c.kappa_K_P))
    assert not window.empty and window.balanced > window.low
    assert sol.start == "closed_form" and sol.steps == 0 and sol.immunized
    assert _margin(sol.theta, X_P, X_H) == pytest.approx(bound, rel=1e-8)
    # at the middle of the window (i) = 1/(ii) = √ceiling, the closed form's own θ
    assert sol.harmful_ratio == pytest.approx(1 / sol.pretrain_ratio, rel=1e-8)
    np.testing.assert_allclose(sol.theta, closed_form_layer(X_P, X_H).theta, rtol=0, atol=0)
    S = sol.theta[:, : c.rank_K_P]
    rule = _dense_rule(X_P @ S, X_H @ S, (c.kappa_K_P, c.kappa_K_H), "exact")
    width = S.shape[1]  # the layer's lr, 0.27/√width (docs/design.md §4)
    run = adaptive_descent(
        np.eye(width),
        *rule,
        AdaptiveSettings(lr=0.03 * np.sqrt(79 / width), epochs=200, patience=1000),
    )
    h = run.history
    margins = np.minimum(np.log(h["harmful_ratio"]), -np.log(h["pretrain_ratio"]))
    assert run.steps == 200 and run.best_step == 0 and margins.max() <= bound + 1e-9


def test_the_rule_from_identity_meets_definition_3_1_where_the_window_is_open():
    X_P, X_H = _pair(4, 60, 60, 6)
    sol = adaptive_layer(X_P, X_H, steps=2000, patience=300, start="identity")
    assert sol.start == "identity" and 0 < sol.steps and sol.immunized
    assert sol.harmful_ratio == pytest.approx(rir(sol.theta, X_P, X_H).harmful_ratio, rel=1e-9)
    with pytest.raises(ParameterError) as e:
        adaptive_layer(X_P, X_H, steps=5, patience=3, start="I")
    assert e.value.parameter == "start"


def test_the_balanced_exponent_lies_inside_the_window_and_has_the_largest_margin():
    """D_P sees two of three inputs; D_H's nonzero spectrum is flat (κ(K_H) = 1) but it is nearly
    singular on D_P's inputs, so κ(C) > κ(K_H)·κ(K_P) and the middle of the unclamped window is
    below 0: the balanced exponent is then the window's low end, 0 (H_P = I), where the margin
    −ln(ii) = ln κ(K_P) is the largest any exponent has."""
    X_P = np.array([[1.0, 0.0, 0.0], [0.0, np.sqrt(2.0), 0.0]])
    X_H = np.array([[1.0, 0.0, 0.0], [0.0, 0.1, np.sqrt(1 - 0.01)]])
    c = rir_ceiling(X_P, X_H)
    assert c.kappa_C > c.kappa_K_H * c.kappa_K_P  # the middle of the unclamped window is < 0
    w = def31_exponent_window(c)
    assert not w.empty and w.low <= w.balanced < w.high and w.balanced == 0.0
    assert attainability(X_P, X_H)[1] == w

    def margin(a):
        task = LinearTask(X_P, np.zeros(2), X_H, np.zeros(2))
        theta = immunize(task, "closed_form", rng=np.random.default_rng(0), exponent=a).theta
        return _margin(theta, X_P, X_H)

    best = margin(w.balanced)
    assert best == pytest.approx(np.log(c.kappa_K_P), rel=1e-9)
    assert all(margin(a) < best for a in np.linspace(w.low, w.high, 7)[1:-1])


def test_unresolved_features_are_refused_before_any_step():
    """Float32 features whose rows sum to zero (a LayerNorm without bias): no step, no window,
    no ceiling (NaN), θ = I."""
    rng = np.random.default_rng(3)
    D = 24
    X = (rng.standard_normal((200, D)) * np.linspace(1.0, 3.0, D)).astype(np.float32)
    X_P = X - X.mean(axis=1, keepdims=True)
    X_H = (X_P[::-1] * np.linspace(3.0, 1.0, D)).astype(np.float32)
    X_H = X_H - X_H.mean(axis=1, keepdims=True)
    sol = adaptive_layer(X_P, X_H, steps=5000, patience=300, precision=torch.float32)
    assert sol.steps == 0 and sol.start == "none" and not sol.immunized and not sol.history
    assert sol.window is None and np.isnan(sol.ceiling) and np.array_equal(sol.theta, np.eye(D))
    assert np.isnan(attainability(X_P, X_H, precision=torch.float32)[0])
    # the same features, exact: resolved, so the rule runs
    assert adaptive_layer(X_P, X_H, steps=2, patience=300).start != "none"
