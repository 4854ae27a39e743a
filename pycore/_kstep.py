"""The k-step remaining fraction of a GD probe (docs/theory.md §11).

How much of its excess squared loss an attacker's linear probe still has after ``k`` gradient
steps, on the attacker's own labels.

The probe (docs/theory.md §11): ``A = Z`` or, with a bias column, ``A = [Z, c·1]``, ``c`` the RMS
row norm of Z (the convention of :func:`pycore.deep._probes.linear_probe_curve`: a rescaling of Z
rescales A exactly); loss ``L(W) = ‖AW − Y‖_F²/(2N)``, GD from ``W₀ = 0`` with step
``η = 1/λ_max(AᵀA/N)``. With ``A = Σ s_j u_j v_jᵀ`` over the nonzero spectrum (the rank rule of
docs/theory.md §2) and ``r_j = s_j²/s_1²``::

    E_k = [L(W_k) − L*] / [L(W₀) − L*] = Σ_j ‖u_jᵀY‖² (1 − r_j)^{2k} / Σ_j ‖u_jᵀY‖²

in [0, 1], unchanged by ``Z → cZ`` and ``Y → cY``, and ``E_k ≤ (1 − 1/κ(AᵀA))^{2k}``.

* :func:`kstep_remaining` is the value from the SVD (exact), :func:`kstep_remaining_grad` also
  ``∂E_k/∂Z``: the adjoint of the GD recursion (only η depends on an eigenpair, the top one;
  no eigenvector derivative), the tie rule of docs/theory.md §3 applied to λ_max.
* :class:`KStepProbe` is E_k of the features ``Xθ`` for one X and many θ, from X's small side
  (:class:`pycore.linalg.RowFactor`: ``Xθ = U(Aθ)``, the targets kept as ``UᵀY`` and, with a
  bias column, the part of ``1`` outside range(U)), with the θ-gradient and its K⁺-preconditioned
  direction: what the ``kstep`` immunizer (:func:`pycore._methods.kstep`) and the deep layer
  (:func:`pycore.deep._layer.kstep_layer`) step on.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import numpy as np

from pycore._regularizers import TieWarning
from pycore._spectral import EPS, TIE_RTOL, RowFactor, SpectrumError, rank_tolerance
from pycore._validation import ParameterError, as_float_matrix, as_target, check_number

# The deep demo's GD-probe epoch count; the bound on k keeps one evaluation (k products each
# way) from running until killed.
DEFAULT_STEPS = 10
MAX_STEPS = 100_000


@dataclass(frozen=True)
class KStepRemaining:
    """E_k of one probe (docs/theory.md §11) and what it is bounded by.

    Attributes
    ----------
    remaining : float
        E_k = [L(W_k) − L*]/[L(W₀) − L*] in [0, 1].
    steps : int
        k.
    kappa : float
        κ(AᵀA) over the nonzero spectrum.
    bound : float
        (1 − 1/κ)^{2k}, the largest E_k that κ allows (E_k ≤ bound).
    rank : int
        The numerical rank of A.
    tie_max : bool
        λ_max is (nearly) repeated (docs/theory.md §3): the gradient of η is not defined there.
    """

    remaining: float
    steps: int
    kappa: float
    bound: float
    rank: int
    tie_max: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _check_steps(steps) -> int:
    return check_number(steps, "steps", low=1, high=MAX_STEPS, integer=True)


def _bias_scale(F: np.ndarray, n: int) -> float:
    """``c = ‖F‖_F/√n``, the RMS row norm of the features.

    On the small side: ``‖Xθ‖_F = ‖Aθ‖_F``.
    """
    return float(np.linalg.norm(F) / np.sqrt(n))


def probe_matrix(Z, bias: bool = False) -> np.ndarray:
    """The probe's design ``A = Z`` or ``[Z, c·1]`` (docs/theory.md §11).

    ``c`` is the RMS row norm of Z.
    """
    Z = as_float_matrix(Z, "Z")
    if not bias:
        return Z
    return np.hstack([Z, np.full((Z.shape[0], 1), _bias_scale(Z, Z.shape[0]))])


def _unseen(part: float, y_norm: float, shape) -> bool:
    """Whether a projection of the targets of norm ``part`` is round-off.

    At most ``max(shape)·eps·‖Y‖``, what projecting Y on orthonormal columns leaves of an
    orthogonal Y.
    """
    return not part > max(shape) * EPS * y_norm


def _core(B, Yt, steps, shape, grad, y_norm):
    """E_k of a design and targets and, with ``grad``, its gradient ``∂E_k/∂B``.

    E_k of the design ``B`` (m×p) and targets ``Yt`` (m×C) and, with ``grad``, ``∂E_k/∂B``
    (docs/theory.md §11); ``shape`` is the full design's, for the rank cut-off, ``y_norm`` the
    full targets' norm. N cancels from E_k and its gradient, so the recursion runs at N = 1:
    ``η = 1/s_1²``.
    """
    U, s, Vt = np.linalg.svd(B, full_matrices=False)
    if not s[0] > 0:
        raise SpectrumError("the probe's features are zero: E_k is undefined")
    r = int(np.count_nonzero(s > rank_tolerance(s[0], shape)))
    Ur, sr, Vr = U[:, :r], s[:r], Vt[:r].T
    P = Ur.T @ Yt  # uⱼᵀY
    q = np.sum(P * P, axis=1)
    den = float(q.sum())
    if _unseen(np.sqrt(den), y_norm, shape):
        raise SpectrumError(
            "the targets are orthogonal to the probe's features: E_k is undefined "
            "(the probe can learn nothing)"
        )
    x = sr / sr[0]
    decay = ((1.0 - x) * (1.0 + x)) ** (2 * steps)  # (1 − r_j)^{2k}, 1 − x² without cancellation
    value = float(np.sum(q * decay) / den)
    info = KStepRemaining(
        remaining=value,
        steps=steps,
        kappa=float((sr[0] / sr[-1]) ** 2),
        bound=float((1.0 - (sr[-1] / sr[0]) ** 2) ** (2 * steps)),
        rank=r,
        tie_max=bool(r >= 2 and sr[0] - sr[1] <= TIE_RTOL * sr[0]),
    )
    if not grad:
        return info, None
    return info, _adjoint(B, Yt, steps, (Ur, sr, Vr), P, value, den)


def _adjoint(B, Yt, k, svd, P, value, den):
    """``∂E_k/∂B`` by the adjoint of the GD recursion (docs/theory.md §11).

    ``svd`` is B's thin SVD over its rank, ``(U_r, s_r, V_r)``. The recursion is
    ``e_{t+1} = (I − ηBᵀB)e_t``, ``e_t = W_t − W*``,
    ``e₀ = −W* = −B⁺Y`` (docs/theory.md §11): ``n = ½‖Be_k‖²``, ``d = ½‖Be₀‖²``, E = n/d. The
    small quantities (``Be_t``) are formed directly, never as a difference of losses. Terms: the
    direct one of n, the iterates' dependence on ``BᵀB`` and on η = 1/s_1² (``∂s_1 = u_1v_1ᵀ``),
    that of W* through ``B⁺`` (fixed rank), and ``∂d = −∂L* = −R*W*ᵀ`` (the envelope theorem),
    ``R* = BW* − Y``.
    """
    Ur, sr, Vr = svd
    eta = 1.0 / sr[0] ** 2
    W_star = Vr @ (P / sr[:, None])
    full_row_rank = Ur.shape[1] == B.shape[0]
    R_star = None if full_row_rank else Ur @ P - Yt  # 0 exactly when B has full row rank
    e = [-W_star]
    Be = [B @ e[0]]
    for _ in range(k):
        e.append(e[-1] - eta * (B.T @ Be[-1]))
        Be.append(B @ e[-1])
    lam = [None] * (k + 1)
    lam[k] = B.T @ Be[k]
    Blam = [None] * (k + 1)
    for t in range(k, 0, -1):
        Blam[t] = B @ lam[t]
        lam[t - 1] = lam[t] - eta * (B.T @ Blam[t])
    E_ = np.concatenate(e[:k], axis=1)  # p × kC
    L_ = np.concatenate(lam[1:], axis=1)
    BE_ = np.concatenate(Be[:k], axis=1)  # m × kC
    BL_ = np.concatenate(Blam[1:], axis=1)
    eta_bar = -float(np.sum(BL_ * BE_))
    g = Be[k] @ e[k].T  # direct: ∂(½‖Be_k‖²)/∂B
    g = g - eta * (BE_ @ L_.T + BL_ @ E_.T)
    g = g + (eta_bar * (-2.0 * eta / sr[0])) * np.outer(Ur[:, 0], Vr[:, 0])
    # through W* = B⁺Y: ⟨λ₀, de₀⟩ with de₀ = −d(B⁺)Y; λ₀ lies in B's row space, so the
    # (I − B⁺B) term of d(B⁺) vanishes
    pinvT_lam0 = Ur @ ((Vr.T @ lam[0]) / sr[:, None])  # (B⁺)ᵀλ₀
    g = g + pinvT_lam0 @ W_star.T
    d_bar = None
    if R_star is not None:
        g = g + R_star @ (((lam[0].T @ Vr) / sr**2) @ Vr.T)  # R*λ₀ᵀB⁺(B⁺)ᵀ
        d_bar = -R_star @ W_star.T
    d = 0.5 * den
    out = g if d_bar is None else g - value * d_bar
    return out / d


def _design_back(Abar, Z, c, n):
    """``∂E/∂Z`` from ``∂E/∂A`` of ``A = [Z, c·1]``, ``c = ‖Z‖_F/√n``: ``∂c/∂Z = Z/(nc)``."""
    return Abar[:, :-1] + (float(Abar[:, -1].sum()) / (n * c)) * Z


def _targets(Y, n_rows: int) -> np.ndarray:
    """Y as an N×C matrix, or a ParameterError naming ``"Y"``."""
    try:
        return as_target(Y, n_rows, "Y")
    except ValueError as exc:
        raise ParameterError("Y", str(exc)) from None


def _inputs(Z, Y, steps):
    Z = as_float_matrix(Z, "Z")
    return Z, _targets(Y, Z.shape[0]), _check_steps(steps)


def kstep_remaining(Z, Y, *, steps: int = DEFAULT_STEPS, bias: bool = False) -> KStepRemaining:
    """E_k of a GD probe on features ``Z`` with targets ``Y`` (docs/theory.md §11).

    Computed from the SVD of the probe's design.

    Parameters
    ----------
    Z : array_like, shape (N, D)
        Features, one row per sample.
    Y : array_like, shape (N,) or (N, C)
        Targets (a real column, or one-hot classes).
    steps : int, default 10
        k, the probe's GD steps.
    bias : bool, default False
        A bias column ``c·1`` (c the RMS row norm of Z).

    Returns
    -------
    KStepRemaining
        E_k, κ(AᵀA), the bound (1 − 1/κ)^{2k}, the rank and the λ_max tie flag.

    Raises
    ------
    ParameterError
        ``Y`` of another row count (``"Y"``), ``steps`` not an integer in [1, 100000].
    ValueError
        Z or Y not finite real 2-D (1-D) arrays.
    SpectrumError
        Z = 0, or Y orthogonal to the features (E_k is 0/0).

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import kstep_remaining
    >>> rng = np.random.default_rng(0)
    >>> Z, y = rng.standard_normal((50, 4)) * [1.0, 1.0, 0.1, 0.01], rng.standard_normal(50)
    >>> e = kstep_remaining(Z, y, steps=10)
    >>> bool(0 < e.remaining <= e.bound <= 1)
    True
    >>> bool(np.isclose(kstep_remaining(7.0 * Z, 3.0 * y).remaining, e.remaining))
    True
    """
    Z, Y, steps = _inputs(Z, Y, steps)
    A = probe_matrix(Z, bias)
    return _core(A, Y, steps, A.shape, False, np.linalg.norm(Y))[0]


def kstep_remaining_grad(
    Z, Y, *, steps: int = DEFAULT_STEPS, bias: bool = False, warn_tie: bool = True
) -> tuple[KStepRemaining, np.ndarray]:
    """E_k of a GD probe and its gradient ``∂E_k/∂Z``, the adjoint of the GD recursion.

    The gradient is that of E_k on the matrices of Z's rank (as R_ill's, docs/theory.md §5 4.1(3)):
    where Z is rank-deficient E_k jumps when the rank changes (docs/theory.md §11).

    Parameters
    ----------
    Z, Y, steps, bias
        As for :func:`kstep_remaining`.
    warn_tie : bool, default True
        Warn :class:`~pycore._regularizers.TieWarning` at a λ_max tie (docs/theory.md §3):
        η = 1/λ_max has no gradient there.

    Returns
    -------
    info : KStepRemaining
        As :func:`kstep_remaining` gives.
    grad : ndarray, shape (N, D)
        ``∂E_k/∂Z``.

    Raises
    ------
    ParameterError, ValueError, SpectrumError
        As :func:`kstep_remaining` raises.
    """
    Z, Y, steps = _inputs(Z, Y, steps)
    A = probe_matrix(Z, bias)
    info, Abar = _core(A, Y, steps, A.shape, True, np.linalg.norm(Y))
    if warn_tie and info.tie_max:
        warnings.warn(
            "E_k gradient at a λ_max tie: η = 1/λ_max has no gradient there", TieWarning, 2
        )
    if bias:
        Abar = _design_back(Abar, Z, A[0, -1], Z.shape[0])
    return info, Abar


class KStepProbe:
    """E_k of the features ``Xθ`` for ONE ``X`` and many θ, from X's small side.

    E_k of the features ``Xθ`` for ONE ``X`` (N×D) with targets ``Y`` and many θ, from X's small
    side (docs/design.md §6).

    With ``X = U diag(s) Vᵀ`` (:class:`pycore.linalg.RowFactor`, X's rank rule) ``Xθ = UF``,
    ``F = diag(s)Vᵀθ`` (r×D), and E_k depends on Y only through its part in range(Xθ) ⊆
    range(U): the probe runs on ``F`` and ``UᵀY``. With a bias column, ``[Xθ, c·1] = [U, q]·B``,
    ``B = [[F, c·Uᵀ1], [0, c·ρ]]``, ``ρq = 1 − UUᵀ1`` (the row dropped when ρ is round-off: 1
    lies in range(X)), and the targets are ``[U, q]ᵀY``. Both are exact reductions (E_k of the
    full design to round-off), for N > D as for N < D.

    :meth:`evaluate` gives E_k and ``∂E_k/∂F``; :meth:`theta_gradient` the θ-gradient
    ``∇_θE_k = V diag(s) ∂E_k/∂F``; :meth:`direction` the K⁺-preconditioned one
    ``K⁺∇_θE_k = V diag(1/s) ∂E_k/∂F`` (docs/theory.md §4, §11).
    """

    def __init__(self, X, Y, *, steps: int = DEFAULT_STEPS, bias: bool = False, factor=None):
        X = as_float_matrix(X, "X")
        Y = _targets(Y, X.shape[0])
        self.steps = _check_steps(steps)
        self.factor = RowFactor.of(X) if factor is None else factor
        if self.factor.rank == 0:
            raise SpectrumError("X is zero: E_k is undefined")
        self.bias, self.n = bool(bias), X.shape[0]
        U = self.factor.U
        Yt = U.T @ Y
        self.shape = (X.shape[0], X.shape[1] + self.bias)
        self.a = self.rho = None
        if self.bias:
            self.a = U.sum(axis=0)  # Uᵀ1
            w = 1.0 - U @ self.a
            rho = float(np.linalg.norm(w))
            # 1 ∈ range(X) to round-off: ‖1 − UUᵀ1‖ at the rounding of U's columns
            if rho > np.sqrt(self.n) * max(self.shape) * EPS:
                self.rho = rho
                Yt = np.vstack([Yt, (w / rho) @ Y])
        self.Yt, self.y_norm = Yt, float(np.linalg.norm(Y))
        if _unseen(float(np.linalg.norm(Yt)), self.y_norm, self.shape):
            raise ParameterError(
                "Y", "Y is orthogonal to every feature the probe can see: E_k is undefined"
            )

    def design(self, F: np.ndarray) -> np.ndarray:
        """The probe's design on the small side for ``F = diag(s)Vᵀθ``."""
        if not self.bias:
            return F
        c = _bias_scale(F, self.n)
        top = np.hstack([F, c * self.a[:, None]])
        if self.rho is None:
            return top
        bottom = np.zeros((1, F.shape[1] + 1))
        bottom[0, -1] = c * self.rho
        return np.vstack([top, bottom])

    def features(self, theta: np.ndarray) -> np.ndarray:
        """``F = diag(s)Vᵀθ``: ``Xθ = UF``."""
        return self.factor.features(theta)

    def evaluate(self, theta, *, grad: bool = True):
        """``(KStepRemaining, ∂E_k/∂F or None)`` at θ."""
        F = self.features(theta)
        B = self.design(F)
        info, Bbar = _core(B, self.Yt, self.steps, self.shape, grad, self.y_norm)
        if Bbar is None or not self.bias:
            return info, Bbar
        r = F.shape[0]
        c_bar = float(Bbar[:r, -1] @ self.a) + (
            0.0 if self.rho is None else Bbar[r, -1] * self.rho
        )
        c = _bias_scale(F, self.n)
        return info, Bbar[:r, :-1] + (c_bar / (self.n * c)) * F

    def remaining(self, theta) -> KStepRemaining:
        """E_k of ``Xθ`` (no gradient)."""
        return self.evaluate(theta, grad=False)[0]

    def theta_gradient(self, theta) -> np.ndarray:
        """``∇_θE_k`` (D×D)."""
        _, Fbar = self.evaluate(theta)
        return self.from_features(Fbar, precondition=False)

    def from_features(self, Fbar: np.ndarray, *, precondition: bool = True) -> np.ndarray:
        """The θ-gradient of a function of ``F`` from its ``∂/∂F``.

        ``V diag(1/s) Fbar`` preconditioned by K⁺ (docs/theory.md §4: the θ-step whose feature
        change is ``U Fbar`` projected on what θ can reach), or ``V diag(s) Fbar``.
        """
        f = self.factor
        return f.V @ ((Fbar / f.s[:, None]) if precondition else (Fbar * f.s[:, None]))

    def direction(self, theta) -> np.ndarray:
        """``K⁺∇_θE_k``: the preconditioned direction that raises E_k."""
        _, Fbar = self.evaluate(theta)
        return self.from_features(Fbar)
