"""The layout of the linear loops as ratios measured in one run (docs/design.md §6), one BLAS
thread, every pair of callables interleaved and timed best-of-N:

- batched: the 5 seeds of a strict-protocol method stepped together (``immunize_batch``) against
  the same 5 runs one at a time (``immunize``);
- small side: the regularizer spectra and extreme vector of ``H = ZᵀZ`` from the r×r ``W = FFᵀ``
  (:class:`pycore.linalg.GramStack`) against the D×D H and, where N < D, the N×N Gram of the
  formed ``Z = Xθ`` (:func:`pycore.linalg.hessian_regularizer`), features included;
- warm start: the smallest eigenpair of the harmful Hessian along a real strict-protocol run, by
  shift-invert Lanczos (ARPACK) started from the previous step's vector, against the dense
  reduction (:class:`pycore._spectral.SymmetricEigen`), and the same on a slowly varying r = 600
  matrix.

    python bench/bench_speed.py [--repeat 5]
    python -m pytest bench/bench_speed.py --benchmark-only -s

The op against autograd is ``bench/bench_ops.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.sparse.linalg  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import interleaved_best  # noqa: E402
from pycore import immunize, immunize_batch  # noqa: E402
from pycore._spectral import SymmetricEigen  # noqa: E402
from pycore.linalg import GramStack, hessian_regularizer  # noqa: E402

SEEDS = range(5)


def strict_task():
    from pycore import strict_protocol
    from pycore.data import load_house_price

    d = load_house_price()
    return strict_protocol(d.train, d.heldout, d.feature_names)[0]


def mnist_task():
    from pycore.data import pair_task, split_digits
    from pycore.data._mnist import load_mnist_5k

    digits = load_mnist_5k()
    return pair_task(digits, split_digits(digits, 100, np.random.default_rng(0), 100), 0, 1)


def batched_calls(task, method, epochs=10):
    kw = dict(preset="strict", epochs=epochs)
    return {
        "one at a time": lambda: [
            immunize(task, method, rng=np.random.default_rng(s), **kw) for s in SEEDS
        ],
        "batched": lambda: immunize_batch(
            task, method, rngs=[np.random.default_rng(s) for s in SEEDS], **kw
        ),
    }


def small_side_calls(task, kind="ill"):
    """The spectra and the gradient's extreme vector of H(θ) for one θ, three ways: the D×D
    ``H = ZᵀZ``; ``Z = Xθ`` and its N×N Gram when N < D (``hessian_regularizer``); the r×r
    ``W = FFᵀ`` of ``F = Aθ`` (``GramStack``, the loops' way)."""
    rng = np.random.default_rng(0)
    theta = np.eye(task.D) + 0.01 * rng.standard_normal((task.D, task.D))
    X, f = task.X_H, task.factor_H

    def small():
        g = GramStack(f.features(theta[None]), task.D)
        return g.term(kind), g.v(g.rank - 1 if kind == "ill" else 0)

    def from_z():
        reg = hessian_regularizer(X @ theta, kind, matrices=False)
        return reg.vector(reg.info.rank - 1 if kind == "ill" else 0)

    def dxd():
        Z = X @ theta
        eig = SymmetricEigen(Z.T @ Z)
        return eig.vector(task.D - 1)

    out = {"D×D": dxd, "small side": small}
    if task.X_H.shape[0] < task.D:
        out = {"D×D": dxd, "N×N from Z": from_z, "small side": small}
    return out


def trajectory(task, steps=30):
    """The r×r Gram matrices W_H of consecutive steps of a strict Algorithm 1 run."""
    seen = []
    real = GramStack.__init__

    def spy(self, F, D, **kw):  # a benchmark of the loop's internals: it spies on its GramStack
        real(self, F, D, **kw)
        seen.append(self.W[0].copy())

    GramStack.__init__ = spy
    try:
        immunize(task, "ours", rng=np.random.default_rng(0), preset="strict", epochs=steps // 4)
    finally:
        GramStack.__init__ = real
    return seen[1::2]  # H's of every step (P's are the even ones)


def drifting(r=600, steps=10, seed=0):
    """Slowly varying SPD matrices (eigenvalues 1e-6 … 1, eigenvectors rotating by ~1e-3)."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((r, r)))[0]
    lam = np.geomspace(1e-6, 1.0, r)
    out = []
    for _ in range(steps):
        A = 1e-3 * rng.standard_normal((r, r))
        Q = np.linalg.qr(Q + Q @ (A - A.T))[0]
        out.append((Q * lam) @ Q.T)
    return out


def warm_calls(mats):
    """Smallest eigenpair of every matrix of a sequence: dense, or shift-invert Lanczos (ARPACK,
    ``eigsh(sigma=0)``) started from the previous step's vector (the first from the dense one);
    both must agree (checked)."""
    x0 = SymmetricEigen(mats[0]).vector(0)

    def dense():
        return [SymmetricEigen(W).vector(0) for W in mats[1:]]

    def warm():
        x, out = x0, []
        for W in mats[1:]:
            _, X = scipy.sparse.linalg.eigsh(W, k=1, sigma=0.0, v0=x, tol=1e-13)
            x = X[:, 0]
            out.append(x)
        return out

    a, b = dense(), warm()
    assert all(abs(abs(u @ v) - 1) < 1e-8 for u, v in zip(a, b)), "Lanczos did not converge"
    return {"dense": dense, "warm Lanczos": warm}


def rows(repeat: int):
    strict, mnist = strict_task(), mnist_task()
    for method in ("ours", "opt_kappa", "imma"):
        t = interleaved_best(batched_calls(strict, method), repeat)
        yield "5 seeds batched vs one at a time", f"strict {method}, 10 epochs", t
    for name, task in (("House Prices strict", strict), ("MNIST 0→1", mnist)):
        for kind in ("ill", "well"):
            t = interleaved_best(small_side_calls(task, kind), repeat * 4)
            small = t.pop("small side")
            for way, sec in t.items():
                yield "small side vs D×D", f"{name}, R_{kind}", {way: sec, "small side": small}
    t = interleaved_best(warm_calls(trajectory(strict)), repeat)
    yield "warm vs cold eigensolver", "strict W_H, r = 72, 30 steps", t
    t = interleaved_best(warm_calls(drifting()), max(1, repeat // 2))
    yield "warm vs cold eigensolver", "drifting SPD, r = 600, 10 steps", t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="best of this many rounds (default 5)")
    args = ap.parse_args(argv)
    print("| comparison | case | baseline (ms) | new (ms) | ratio |\n|---|---|---|---|---|")
    for what, case, t in rows(max(1, args.repeat)):
        (a, ta), (b, tb) = t.items()
        print(f"| {what} | {case}: {a} → {b} | {ta * 1e3:.2f} | {tb * 1e3:.2f} | {ta / tb:.2f}× |")
    return 0


@pytest.mark.parametrize("method", ["ours", "imma"])
@pytest.mark.parametrize("way", ["one at a time", "batched"])
def test_batched(benchmark, method, way):
    benchmark.group = f"strict {method}: 5 seeds"
    benchmark.pedantic(batched_calls(strict_task(), method, 4)[way], rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("task", ["strict", "mnist"])
@pytest.mark.parametrize("way", ["D×D", "small side"])
def test_small_side(benchmark, task, way):
    benchmark.group = f"regularizer spectra: {task}"
    t = strict_task() if task == "strict" else mnist_task()
    benchmark.pedantic(small_side_calls(t)[way], rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("way", ["dense", "warm Lanczos"])
def test_warm_start(benchmark, way):
    benchmark.group = "smallest eigenpair along a strict run"
    benchmark.pedantic(warm_calls(trajectory(strict_task(), 12))[way], rounds=3, warmup_rounds=1)


if __name__ == "__main__":
    sys.exit(main())
