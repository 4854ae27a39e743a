"""Test helpers: matrices with a prescribed spectrum, central differences."""

from __future__ import annotations

import numpy as np


def orthogonal(n: int, rng: np.random.Generator) -> np.ndarray:
    Q, R = np.linalg.qr(rng.standard_normal((n, n)))
    return Q * np.sign(np.diag(R))


def with_spectrum(s, rng: np.random.Generator, shape=None) -> np.ndarray:
    """(U*s)@Vᵀ with Haar U, V: a matrix whose singular values are exactly ``s``."""
    s = np.asarray(s, dtype=float)
    m, n = shape if shape is not None else (s.size, s.size)
    U = orthogonal(m, rng)[:, : s.size]
    V = orthogonal(n, rng)[:, : s.size]
    return (U * s) @ V.T


def psd_with_spectrum(lam, rng: np.random.Generator) -> np.ndarray:
    lam = np.asarray(lam, dtype=float)
    Q = orthogonal(lam.size, rng)
    return (Q * lam) @ Q.T


def separated_spectrum(
    n: int, rng: np.random.Generator, lo=0.1, hi=10.0, min_gap=1e-2
) -> np.ndarray:
    """Descending values in [lo, hi] with relative gaps ≥ min_gap (away from ties)."""
    while True:
        s = np.sort(rng.uniform(lo, hi, n))[::-1]
        if n < 2 or np.min(-np.diff(s)) >= min_gap * s[0]:
            return s


def central_diff(f, X: np.ndarray, h: float = 1e-6) -> np.ndarray:
    G = np.zeros_like(X)
    for idx in np.ndindex(X.shape):
        E = np.zeros_like(X)
        E[idx] = h
        G[idx] = (f(X + E) - f(X - E)) / (2 * h)
    return G


def rel_err(A, B) -> float:
    return float(np.linalg.norm(A - B) / max(np.linalg.norm(B), 1e-300))
