"""Test helpers: matrices with a prescribed spectrum, central differences, the memory a call
takes, a named pipe that cannot hang a test."""

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


def added_peak_rss(imports: str, expression: str, *argv: str) -> tuple[int, str]:
    """``(bytes, printed)``: how much ``expression`` (evaluated after ``imports``, with ``argv`` as
    ``sys.argv[1:]``) raises a fresh interpreter's peak RSS, and what ``print`` makes of its
    value; a failure is an AssertionError with the child's stderr."""
    import subprocess
    import sys

    code = (
        f"import resource, sys\n{imports}\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"value = {expression}\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
        "print(value)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    added, printed = out.stdout.split("\n", 1)
    return int(added), printed.strip()


def known_kappa(seed=0, N=50, D=20):
    """X with κ(XᵀX) = 10 and θ with κ(θᵀXᵀXθ) = 1000 exactly (the singular values multiply)."""
    rng = np.random.default_rng(seed)
    U, V, Q = (np.linalg.qr(rng.standard_normal((n, D)))[0] for n in (N, D, D))
    X = (U * np.sqrt(np.logspace(0, -1, D))) @ V.T
    return X, V @ np.diag(np.logspace(0, -1, D)) @ Q.T, rng.standard_normal(N)


def traced_peak(call, error=ValueError, match=None):
    """``(the exception, tracemalloc's peak in bytes)`` of a call that must raise ``error``
    (matching ``match``): numpy traces its buffers, so a refusal that comes before an allocation
    peaks far below it."""
    import tracemalloc

    import pytest

    tracemalloc.start()
    try:
        with pytest.raises(error, match=match) as info:
            call()
        return info.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def fifo(path):
    """A named pipe at ``path`` that a (wrongly) blocked reader gets fed after 3 s, so a test
    fails instead of hanging."""
    import os
    import threading
    import time

    os.mkfifo(path)

    def feed():
        time.sleep(3)
        try:
            # ENXIO without a reader, as it should be
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"a,b\n1,2\n")
            os.close(fd)
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    return path


def lying_checkpoint(path, **kwargs):
    """A few hundred bytes of safetensors in :func:`pycore.deep.save_model`'s format whose
    metadata asks for a timm ViT built with ``kwargs`` (one tensor, the class token)."""
    import json
    import tempfile

    import torch
    from safetensors.torch import save_file

    from pycore.deep import ImmunizedNet, create_model, save_model
    from pycore.deep._checkpoint import read_weights

    with tempfile.TemporaryDirectory() as tmp:
        net = ImmunizedNet(create_model("test_resnet", 2, seed=0))
        fmt = read_weights(save_model(net, f"{tmp}/m.safetensors"))[1]["format"]
    meta = {"format": fmt, "model": "vit_tiny_patch16_224", "num_classes": "2"}
    save_file(
        {"net.cls_token": torch.ones(1, 1, 192)},
        path,
        metadata={**meta, "model_kwargs": json.dumps(kwargs)},
    )
    return path


def image_root(root, classes=("a", "b"), n=3, side=16):
    """An ImageFolder root: ``n`` seeded random ``side``-px RGB PNGs per class folder."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 255, size=(side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.png")
    return root
