"""Spectrum-preserving hardening of a linear θ.

θ → θQ with Q orthogonal (docs/findings.md §5). Every Hessian becomes ``QᵀH(θ)Q`` (same κ's, RIR
and best D_P loss with ω → Qᵀω); only the basis changes, which coordinate-wise attackers see.

The kinds of hardening of both sides are one table, :data:`HARDENINGS`
(``HARDENINGS["linear"]``, ``HARDENINGS["deep"]``; :data:`pycore.deep._hardening.HARDENINGS` is
the same object); a name means one operation on both sides:

* ``"haar"`` (both): Q a Haar draw on O(D) from the run's generator, :func:`haar_rotation`, the
  one implementation both sides use.
* ``"equalize"`` (linear only): Q deterministic, giving the harmful Hessian θᵀK_Hθ an equal
  diagonal (:func:`equalizing_rotation`; Schur–Horn; Bendel & Mickey 1978, Davies & Higham 2000).
  The deep layer has no equalizing kind.
* ``"label_subspace"`` (deep only): not a rotation and not spectrum-preserving; the span of D_H's
  centred class means squashed, then a Haar rotation
  (:func:`pycore.deep._hardening.label_subspace`). It needs D_H's class labels and changes the
  spectra, which every linear kind keeps.

Here :func:`harden` applies a given Q to (θ, ω) and :func:`harden_result` a kind to a result; on
the deep side :func:`pycore.deep._hardening.harden` applies a kind to a model's immunization layer.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np
import scipy.fft

from pycore._threads import bounded_blas
from pycore._validation import (
    ParameterError,
    as_float_matrix,
    check_choice,
    check_number,
    check_rng,
    check_work,
)

# The one table of the hardening kinds, per side (the module docstring says what each is).
HARDENINGS = MappingProxyType(
    {"linear": ("none", "haar", "equalize"), "deep": ("none", "haar", "label_subspace")}
)

# Rotations built here are orthogonal to ~D·eps (≈ 2e-13 at D = 784); 1e-10 is far above that and
# far below any matrix that is not a rotation.
ORTHOGONALITY_RTOL = 1e-10


def invariant_change(hardened: float, plain: float, floor: float = 0.0) -> float:
    """The relative change of a number hardening keeps.

    ``|hardened − plain| / max(|plain|, floor)``, for the κ ratios, the RIR and the best D_P loss.
    ``floor`` is the size below which the number is round-off: a best loss of an exact fit
    (N ≤ D) is ~1e-31 with θ and ~9e-31 with θQ, and without a floor their "change" reads 900 %.

    Parameters
    ----------
    hardened : float
        The number measured on the hardened θQ.
    plain : float
        The same number on θ.
    floor : float, default 0.0
        The size below which the number is round-off (:func:`loss_floor` for a best loss).

    Returns
    -------
    float
        The relative change; 0 when the two are equal.
    """
    return abs(hardened - plain) / max(abs(plain), floor) if hardened != plain else 0.0


def loss_floor(loss: str, Y) -> float:
    """:func:`invariant_change`'s floor for a best loss on given targets.

    √eps × the loss of the zero head: a best loss below it is an exact fit's round-off.

    Parameters
    ----------
    loss : {"mse", "bce"}
        The loss of the head.
    Y : array_like
        The targets.

    Returns
    -------
    float
        The floor.
    """
    from pycore._losses import residual

    Y = np.asarray(Y, dtype=np.float64)
    return float(np.sqrt(np.finfo(np.float64).eps) * residual(loss, np.zeros_like(Y), Y)[0])


def orthogonality_defect(Q) -> float:
    """``‖QᵀQ − I‖_max``: 0 for an orthogonal matrix (round-off ~D·eps).

    Parameters
    ----------
    Q : array_like, shape (D, k)
        The matrix.

    Returns
    -------
    float
        The largest entry of ``|QᵀQ − I|``.
    """
    Q = np.asarray(Q, dtype=np.float64)
    return float(np.max(np.abs(Q.T @ Q - np.eye(Q.shape[1]))))


def check_orthogonal(Q, name: str = "Q", *, tol: float = ORTHOGONALITY_RTOL) -> np.ndarray:
    """``Q`` as a float64 matrix, checked square and orthogonal.

    Or :class:`ParameterError` unless square and orthogonal to ``tol``.
    """
    Q = as_float_matrix(Q, name)
    if Q.shape[0] != Q.shape[1]:
        raise ParameterError(name, f"{name} must be square, got shape {Q.shape}")
    defect = orthogonality_defect(Q)
    if not defect <= tol:
        raise ParameterError(
            name,
            f"{name} is not orthogonal: ‖QᵀQ − I‖_max = {defect:.3e} > {tol:g}; "
            "hardening must preserve every spectrum",
        )
    return Q


def haar_rotation(D: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-distributed orthogonal D×D matrix.

    ``QR = G`` Gaussian, Q's columns times ``sign(diag R)`` (LAPACK's sign convention would bias
    the law; Mezzadri 2007).

    Parameters
    ----------
    D : int
        The size, at least 1.
    rng : numpy.random.Generator
        The generator of G.

    Returns
    -------
    ndarray, shape (D, D)
        The orthogonal matrix.

    Raises
    ------
    ParameterError
        ``D`` not a positive integer or ``rng`` not a Generator.
    """
    check_number(D, "D", low=1, integer=True)
    Q, R = np.linalg.qr(check_rng(rng).standard_normal((D, D)))
    s = np.sign(np.diag(R))
    s[s == 0] = 1.0
    return Q * s


def _givens_equalize(M: np.ndarray, Q: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """At most D − 1 Givens rotations that equalize a symmetric matrix's diagonal.

    At most D − 1 Givens rotations of symmetric M (in place, ``GᵀMG``) and Q (``QG``), each in a
    plane ``M_ii < t < M_jj`` setting ``M_ii = t``: tan is the smaller root of
    ``(M_jj − t)τ² − 2M_ijτ + (M_ii − t)``, without cancellation.
    """
    D = M.shape[0]
    close = (
        4 * D * np.finfo(float).eps * max(float(np.max(np.abs(np.diag(M)))), np.finfo(float).tiny)
    )
    done = np.abs(np.diag(M) - target) <= close
    for _ in range(D):
        d = np.diag(M)
        lo = [k for k in range(D) if not done[k] and d[k] < target]
        hi = [k for k in range(D) if not done[k] and d[k] > target]
        if not lo or not hi:
            break
        i = min(lo, key=lambda k: target - d[k])  # the entries nearest the target: small rotations
        j = min(hi, key=lambda k: d[k] - target)
        a, b, c = M[i, i] - target, M[i, j], M[j, j] - target
        disc = b * b - a * c  # > 0: a < 0 < c
        tau = a / (b + np.copysign(np.sqrt(disc), b if b != 0 else 1.0))
        cs = 1.0 / np.sqrt(1.0 + tau * tau)
        sn = tau * cs
        # columns, then rows
        M[:, i], M[:, j] = (cs * M[:, i] - sn * M[:, j], sn * M[:, i] + cs * M[:, j])
        M[i, :], M[j, :] = cs * M[i, :] - sn * M[j, :], sn * M[i, :] + cs * M[j, :]
        M[i, i] = target  # exact by construction (round-off removed)
        Q[:, i], Q[:, j] = cs * Q[:, i] - sn * Q[:, j], sn * Q[:, i] + cs * Q[:, j]
        done[i] = True
        done[j] = abs(M[j, j] - target) <= close
    return M, Q


@bounded_blas
def equalizing_rotation(H) -> np.ndarray:
    """A deterministic orthogonal Q with ``diag(QᵀHQ) = (tr H/D)·1``.

    ``Q = VCᵀG``: V H's eigenvectors (largest entry positive), C the orthonormal DCT-II (it spreads
    them over all coordinates), G Givens rotations.

    Parameters
    ----------
    H : array_like, shape (D, D)
        A symmetric matrix (its symmetric part is used).

    Returns
    -------
    ndarray, shape (D, D)
        The orthogonal Q.

    Raises
    ------
    ParameterError
        ``H`` not square.
    ValueError
        ``H`` not a finite real matrix.
    """
    H = as_float_matrix(H, "H")
    if H.shape[0] != H.shape[1]:
        raise ParameterError("H", f"H must be square, got shape {H.shape}")
    H = 0.5 * (H + H.T)
    D = H.shape[0]
    lam, V = np.linalg.eigh(H)
    lam, V = lam[::-1], V[:, ::-1]
    idx = np.argmax(np.abs(V), axis=0)
    V = V * np.sign(V[idx, np.arange(D)])
    C = scipy.fft.dct(np.eye(D), type=2, norm="ortho", axis=0)  # C @ x = dct(x, norm="ortho")
    Q = V @ C.T
    M = (C * lam) @ C.T  # = QᵀHQ, formed from the exact spectrum
    M = 0.5 * (M + M.T)
    target = float(np.mean(np.diag(M)))
    _, Q = _givens_equalize(M, Q, target)
    return Q


@bounded_blas
def hardening_rotation(kind: str, D: int, *, rng: np.random.Generator | None = None, Z=None):
    """The rotation Q of a kind of hardening.

    Parameters
    ----------
    kind : str
        One of ``HARDENINGS["linear"]``: ``"none"``, ``"haar"`` (a Haar rotation drawn from
        ``rng``) or ``"equalize"`` (:func:`equalizing_rotation` of ``ZᵀZ``).
    D : int
        The size of θ.
    rng : numpy.random.Generator, optional
        Required by ``"haar"``.
    Z : array_like, shape (N, D), optional
        The harmful features; required by ``"equalize"``.

    Returns
    -------
    ndarray of shape (D, D), or None
        Q; None for ``"none"``.

    Raises
    ------
    ParameterError
        An unknown kind, or the ``rng`` or ``Z`` the kind needs missing (``.parameter`` names it).
    ValueError
        The work would exceed :data:`pycore.limits.MAX_WORK_BYTES`.
    """
    check_choice(kind, "harden", HARDENINGS["linear"])
    if kind == "none":
        return None
    rows = 0 if Z is None else np.shape(Z)[0]
    check_work(D, rows, *((5, 0) if kind == "haar" else (8, 1)), f"harden {kind!r}")
    if kind == "haar":
        if rng is None:
            raise ParameterError("rng", "harden 'haar' draws Q from the run's generator: pass rng")
        return haar_rotation(D, rng)
    if Z is None:
        raise ParameterError(
            "Z", "harden 'equalize' needs the harmful Hessian, from the harmful features Z"
        )
    Z = as_float_matrix(Z, "Z")
    return equalizing_rotation(Z.T @ Z)


def harden(theta, Q, omega=None):
    """Harden θ by an orthogonal Q.

    ``(θQ, Qᵀω)``, the rotated extractor and the head that predicts as before (docs/findings.md
    §5).

    Every Hessian becomes ``QᵀH(θ)Q``: the same spectra, so the same κ's, RIR and best D_P loss;
    only the coordinate basis changes, which coordinate-wise attackers (Adam, Adagrad, Jacobi
    preconditioning) feel.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The extractor to harden.
    Q : array_like, shape (D, D)
        An orthogonal matrix (:func:`haar_rotation`, :func:`equalizing_rotation`), checked to
        :data:`ORTHOGONALITY_RTOL`.
    omega : array_like, shape (D,) or (D, m), optional
        A linear head on θ's features; None gives None back.

    Returns
    -------
    theta_hardened : ndarray, shape (D, D)
    omega_hardened : ndarray or None

    Raises
    ------
    ParameterError
        Q not square, not orthogonal, or of another size than θ's columns.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import rir
    >>> from pycore._hardening import haar_rotation, harden
    >>> rng = np.random.default_rng(0)
    >>> X_P, X_H = rng.standard_normal((20, 3)), rng.standard_normal((20, 3))
    >>> theta, omega = np.diag([1.0, 2.0, 3.0]), np.ones(3)
    >>> hard, head = harden(theta, haar_rotation(3, rng), omega)
    >>> np.allclose(X_P @ hard @ head, X_P @ theta @ omega)  # the same predictions
    True
    >>> bool(np.isclose(rir(hard, X_P, X_H).value, rir(theta, X_P, X_H).value, rtol=1e-12))
    True
    >>> harden(theta, np.diag([1.0, 2.0, 1.0]))
    Traceback (most recent call last):
    ...
    pycore.ParameterError: Q is not orthogonal: ...
    """
    theta = as_float_matrix(theta, "theta")
    Q = check_orthogonal(Q)
    if Q.shape[0] != theta.shape[1]:
        raise ParameterError(
            "Q", f"Q is {Q.shape[0]}×{Q.shape[0]} but θ has {theta.shape[1]} columns"
        )
    head = None if omega is None else Q.T @ np.asarray(omega, dtype=np.float64)
    return theta @ Q, head


@bounded_blas
def harden_result(res, task, kind: str, *, rng: np.random.Generator | None = None):
    """An immunization result hardened: θ → θQ, ω → Qᵀω.

    Every κ, the RIR and the best D_P loss are kept (docs/findings.md §5); only the basis changes.

    Parameters
    ----------
    res : ImmunizationResult
        A result of ``task``.
    task : LinearTask
        The task ``res`` was immunized on (``"equalize"`` reads its harmful rows).
    kind : str
        One of ``HARDENINGS["linear"]``.
    rng : numpy.random.Generator, optional
        For ``"haar"``: the generator the run used, after the run.

    Returns
    -------
    ImmunizationResult
        ``res`` itself for ``"none"``; else a copy with the hardened ``theta`` and ``omega``, the
        ``theta_unhardened`` and ``rotation`` kept, and ``diagnostics["harden"]``.

    Raises
    ------
    ParameterError
        As :func:`hardening_rotation` raises.
    ValueError
        The work would exceed :data:`pycore.limits.MAX_WORK_BYTES`.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, harden_result, immunize
    >>> rng = np.random.default_rng(0)
    >>> X_P, X_H = rng.standard_normal((30, 3)), rng.standard_normal((30, 3)) * [3.0, 1.0, 1.0]
    >>> task = LinearTask(X_P, rng.standard_normal(30), X_H, rng.standard_normal(30))
    >>> res = immunize(task, "closed_form", rng=rng)
    >>> hard = harden_result(res, task, "haar", rng=rng)
    >>> bool(np.isclose(hard.rir, res.rir, rtol=1e-9)), bool(np.allclose(hard.theta, res.theta))
    (True, False)
    """
    Q = hardening_rotation(
        kind, task.D, rng=rng, Z=task.X_H @ res.theta if kind == "equalize" else None
    )
    if Q is None:
        return res
    theta, omega = harden(res.theta, Q, res.omega)
    return replace(
        res,
        theta=theta,
        omega=omega,
        theta_unhardened=res.theta,
        rotation=Q,
        diagnostics={
            **res.diagnostics,
            "harden": {"kind": kind, "orthogonality_defect": orthogonality_defect(Q)},
        },
    )
