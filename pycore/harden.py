"""Spectrum-preserving hardening of an immunized extractor: θ → θQ with Q orthogonal (docs/attacks.md §2).

Every Hessian maps to ``QᵀH(θ)Q``: the same eigenvalues, hence the same κ's, RIR, Definition 3.1
and best D_P loss (the head ω becomes Qᵀω).  What changes is the feature basis, which
coordinate-wise attackers (Adam, Jacobi-preconditioned CG) depend on: the closed form's Hessians
are diagonal, a perfect fit for a diagonal preconditioner.  An attacker who whitens is invariant
to any change of basis, so hardening cannot stop them.  Rotations (:data:`HARDENINGS`):

* ``"haar"``: one Haar draw on O(D) from the run's generator (QR of a Gaussian matrix with the
  signs of R's diagonal moved into Q; Mezzadri 2007).
* ``"equalize"``: deterministic, ``diag(QᵀHQ) = (tr H/D)·1`` for the harmful Hessian H (Schur–Horn:
  the constant diagonal is majorized by every spectrum of that trace), built from H's
  eigenvectors, the orthonormal DCT-II and at most D − 1 Givens rotations (Bendel & Mickey 1978;
  Davies & Higham 2000).  With an equal diagonal, Jacobi-preconditioned CG is CG.

:func:`hardening_rotation` gives Q, :func:`harden` applies it to θ and ω, :func:`harden_result`
to an :class:`pycore.immunize.ImmunizationResult`.  Plain NumPy: the deep side uses them too.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import scipy.fft

from pycore.validation import ParameterError, as_float_matrix, check_choice, check_number

__all__ = ["HARDENINGS", "haar_rotation", "equalizing_rotation", "hardening_rotation", "harden",
           "harden_result", "orthogonality_defect", "check_orthogonal", "diagonal_spread",
           "ORTHOGONALITY_RTOL"]

HARDENINGS = ("none", "haar", "equalize")

# A rotation built here is orthogonal to ~D·eps (QR, eigh and Givens are backward stable);
# 1e-10 is far above that at every D of this project (D ≤ 784: D·eps ≈ 2e-13) and far below any
# matrix that is not a rotation (a test perturbs Q by 1e-6).
ORTHOGONALITY_RTOL = 1e-10


def orthogonality_defect(Q) -> float:
    """``‖QᵀQ − I‖_max``: 0 for an orthogonal matrix (round-off ~D·eps)."""
    Q = np.asarray(Q, dtype=np.float64)
    return float(np.max(np.abs(Q.T @ Q - np.eye(Q.shape[1]))))


def check_orthogonal(Q, name: str = "Q", *, tol: float = ORTHOGONALITY_RTOL) -> np.ndarray:
    """``Q`` as a square float64 matrix, or :class:`ParameterError` if ``‖QᵀQ − I‖_max > tol``."""
    Q = as_float_matrix(Q, name)
    if Q.shape[0] != Q.shape[1]:
        raise ParameterError(name, f"{name} must be square, got shape {Q.shape}")
    defect = orthogonality_defect(Q)
    if not defect <= tol:
        raise ParameterError(name, f"{name} is not orthogonal: ‖QᵀQ − I‖_max = {defect:.3e} > {tol:g}; "
                                   "hardening must preserve every spectrum")
    return Q


def haar_rotation(D: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-distributed orthogonal D×D matrix drawn from ``rng`` (Mezzadri 2007).

    ``Q R = G`` with G standard Gaussian; multiplying Q's columns by ``sign(diag R)`` makes the
    factorisation unique and the law of Q exactly uniform on O(D) (without it LAPACK's sign
    convention biases the distribution).
    """
    check_number(D, "D", low=1, integer=True)
    if not isinstance(rng, np.random.Generator):
        raise ParameterError("rng", f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    Q, R = np.linalg.qr(rng.standard_normal((D, D)))
    s = np.sign(np.diag(R))
    s[s == 0] = 1.0
    return Q * s


def _dct_matrix(D: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``C`` (``C @ x = dct(x, norm="ortho")``), columns = samples."""
    return scipy.fft.dct(np.eye(D), type=2, norm="ortho", axis=0)


def _givens_equalize(M: np.ndarray, Q: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """Givens rotations of M (symmetric, updated in place as ``GᵀMG``) and Q (``QG``) until every
    diagonal entry equals ``target`` = mean(diag M) (Bendel–Mickey / Davies–Higham).

    Each rotation acts in a plane (i, j) with ``M_ii < target < M_jj`` and sets the new
    ``M_ii`` to ``target`` exactly; the trace keeps the sum, so after at most D − 1 rotations
    every entry is at the target. The tangent is the root of
    ``(M_jj − t)τ² − 2M_ij τ + (M_ii − t) = 0`` of smaller magnitude, computed without
    cancellation as ``(M_ii − t)/(M_ij + sign(M_ij)·√disc)``.
    """
    D = M.shape[0]
    scale = max(float(np.max(np.abs(np.diag(M)))), np.finfo(float).tiny)
    done = np.abs(np.diag(M) - target) <= 4 * D * np.finfo(float).eps * scale
    for _ in range(D):
        d = np.diag(M)
        lo = [k for k in range(D) if not done[k] and d[k] < target]
        hi = [k for k in range(D) if not done[k] and d[k] > target]
        if not lo or not hi:
            break
        i = min(lo, key=lambda k: target - d[k])      # the entries nearest the target: small rotations
        j = min(hi, key=lambda k: d[k] - target)
        a, b, c = M[i, i] - target, M[i, j], M[j, j] - target
        disc = b * b - a * c                           # > 0: a < 0 < c
        tau = a / (b + np.copysign(np.sqrt(disc), b if b != 0 else 1.0))
        cs = 1.0 / np.sqrt(1.0 + tau * tau)
        sn = tau * cs
        # columns i, j ← (c·col_i − s·col_j, s·col_i + c·col_j); then the same on the rows
        ci, cj = M[:, i].copy(), M[:, j].copy()
        M[:, i], M[:, j] = cs * ci - sn * cj, sn * ci + cs * cj
        ri, rj = M[i, :].copy(), M[j, :].copy()
        M[i, :], M[j, :] = cs * ri - sn * rj, sn * ri + cs * rj
        M[i, i] = target                               # exact by construction (round-off removed)
        qi, qj = Q[:, i].copy(), Q[:, j].copy()
        Q[:, i], Q[:, j] = cs * qi - sn * qj, sn * qi + cs * qj
        done[i] = True
        if abs(M[j, j] - target) <= 4 * D * np.finfo(float).eps * scale:
            done[j] = True
    return M, Q


def equalizing_rotation(H) -> np.ndarray:
    """A deterministic orthogonal Q with ``diag(QᵀHQ) = (tr H/D)·1`` (module docstring).

    ``Q = V·Cᵀ·G``: V the eigenvectors of H (signs fixed so each column's largest entry is
    positive, which makes Q independent of LAPACK's sign choice), Cᵀ the transposed orthonormal
    DCT-II matrix (each eigen-direction spread over every coordinate; the diagonal of
    ``C Λ Cᵀ`` is already close to the mean), then Givens rotations G that make it exact.
    Exactness: every diagonal entry within ``~D·eps·max|diag|`` of the mean (tested).
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
    C = _dct_matrix(D)
    Q = V @ C.T
    M = (C * lam) @ C.T                                # = QᵀHQ, formed from the exact spectrum
    M = 0.5 * (M + M.T)
    target = float(np.mean(np.diag(M)))
    _, Q = _givens_equalize(M, Q, target)
    return Q


def hardening_rotation(kind: str, D: int | None = None, *, rng: np.random.Generator | None = None,
                       H=None, Z=None) -> np.ndarray | None:
    """The rotation Q of hardening ``kind`` (:data:`HARDENINGS`); None for ``"none"``.

    ``"haar"`` needs ``D`` (or H / Z to read it from) and ``rng``; ``"equalize"`` needs the
    harmful Hessian ``H`` (D×D) or the harmful features ``Z`` (N×D, then ``H = ZᵀZ``).
    """
    check_choice(kind, "harden", HARDENINGS)
    if kind == "none":
        return None
    if H is not None:
        H = as_float_matrix(H, "H")
    elif Z is not None:
        Z = as_float_matrix(Z, "Z")
        H = Z.T @ Z
    if D is None:
        if H is None:
            raise ParameterError("D", "hardening needs the dimension D, or H / Z to read it from")
        D = H.shape[0]
    if H is not None and H.shape != (D, D):
        raise ParameterError("H", f"H must be {D}×{D}, got shape {H.shape}")
    if kind == "haar":
        if rng is None:
            raise ParameterError("rng", "harden 'haar' draws Q from the run's generator: pass rng")
        return haar_rotation(D, rng)
    if H is None:
        raise ParameterError("H", "harden 'equalize' needs the harmful Hessian H (or features Z)")
    return equalizing_rotation(H)


def harden(theta, Q, omega=None):
    """``(θQ, Qᵀω)``: the hardened extractor and the D_P head that predicts exactly as before
    (``(XθQ)(Qᵀω) = Xθω``); ``omega`` may be None. Q must be orthogonal (checked)."""
    theta = as_float_matrix(theta, "theta")
    Q = check_orthogonal(Q)
    if Q.shape[0] != theta.shape[1]:
        raise ParameterError("Q", f"Q is {Q.shape[0]}×{Q.shape[0]} but θ has {theta.shape[1]} columns")
    head = None if omega is None else Q.T @ np.asarray(omega, dtype=np.float64)
    return theta @ Q, head


def harden_result(res, task, kind: str, *, rng: np.random.Generator | None = None):
    """``res`` (an :class:`pycore.immunize.ImmunizationResult` of ``task``) hardened by ``kind``:
    θ → θQ, ω → Qᵀω, keeping ``theta_unhardened`` and ``rotation``; ``"none"`` returns ``res``.
    ``"haar"`` draws Q from ``rng``: pass the generator the run used, after the run, and θ is the
    same for the same seed; ``"equalize"`` equalizes H_H(θ) on ``task``'s harmful rows."""
    Q = hardening_rotation(kind, task.D, rng=rng, Z=task.X_H @ res.theta if kind == "equalize" else None)
    if Q is None:
        return res
    theta, omega = harden(res.theta, Q, res.omega)
    return replace(res, theta=theta, omega=omega, theta_unhardened=res.theta, rotation=Q, diagnostics={
        **res.diagnostics, "harden": {"kind": kind, "orthogonality_defect": orthogonality_defect(Q)}})


def diagonal_spread(H) -> float:
    """``max diag(H) / min diag(H)`` over the positive entries: 1 when the diagonal is equal (what
    a diagonal preconditioner sees; the Jacobi-scaled condition number is κ(H) at spread 1)."""
    d = np.diag(np.asarray(H, dtype=np.float64))
    d = d[d > 0]
    return float(d.max() / d.min()) if d.size else float("nan")
