"""The fused op against the autograd reference and its own floor, forward + backward, one thread.

    python bench/bench_ops.py [--repeat 40]                   # the table: every ratio from one run
    python -m pytest bench/bench_ops.py --benchmark-only --benchmark-group-by=param:case

Per (N, D, dtype, R): ``fused`` is the call through ``torch.autograd.grad``, ``raw op`` the C++ op
alone, ``reference`` autograd through ``eigvalsh`` of ZᵀZ; the floor is what the op cannot skip:
its two GEMMs in Z's dtype plus ``eigvalsh`` of the float64 min(N, D)² Gram (docs/design.md §6).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pycore._ops as _ops  # noqa: E402
from bench.timing import interleaved_best  # noqa: E402
from pycore import ops  # noqa: E402

SHAPES = [(64, 512), (256, 512), (100, 768), (256, 768), (2048, 512)]
CASES = [
    (N, D, dt, k) for dt in (torch.float64, torch.float32) for N, D in SHAPES for k in _ops.KINDS
]


def calls(N, D, dtype, kind):
    """The timed callables of one row, by name."""
    Z = torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(
        dtype
    )
    Z.requires_grad_(True)
    Zd = Z.detach()
    M64 = Zd.double() @ Zd.double().T if N < D else Zd.double().T @ Zd.double()
    gemms = (lambda: (Zd @ Zd.T) @ Zd) if N < D else (lambda: Zd @ (Zd.T @ Zd))
    return {
        "fused": lambda: torch.autograd.grad(ops.cond_regularizer(Z, kind), Z),
        "raw op": lambda: torch.ops.pycore.cond_reg(Zd, kind, None, None, True),
        "reference": lambda: torch.autograd.grad(_ops.reference_cond_regularizer(Z, kind), Z),
        "gemms": gemms,
        "eigvalsh": lambda: torch.linalg.eigvalsh(M64),
    }


def _id(case):
    N, D, dtype, kind = case
    return f"{N}x{D}-{str(dtype).split('.')[-1]}-{kind}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("impl", ["fused", "raw op", "reference", "gemms", "eigvalsh"])
def test_bench(benchmark, case, impl):
    torch.set_num_threads(1)
    benchmark.pedantic(calls(*case)[impl], rounds=5, warmup_rounds=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--repeat", type=int, default=7, help="best of this many interleaved calls, >= 1 (7)"
    )
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat: expected an integer >= 1, got {args.repeat}")
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, extension built: {_ops.extension_available()}, "
        f"best of {args.repeat}"
    )
    cols = [
        "N × D",
        "dtype",
        "R",
        "fused (ms)",
        "raw op (ms)",
        "reference (ms)",
        "speed-up",
        "floor (ms)",
        "fused / floor",
        "raw op / floor",
    ]
    print("\n| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for N, D, dtype, kind in CASES:
        t = {
            k: v * 1e3 for k, v in interleaved_best(calls(N, D, dtype, kind), args.repeat).items()
        }
        floor = t["gemms"] + t["eigvalsh"]
        row = [
            f"{N} × {D}",
            str(dtype).split(".")[-1],
            kind,
            f"{t['fused']:.2f}",
            f"{t['raw op']:.2f}",
            f"{t['reference']:.1f}",
            f"{t['reference'] / t['fused']:.1f}×",
            f"{floor:.2f}",
            f"{t['fused'] / floor:.2f}",
            f"{t['raw op'] / floor:.2f}",
        ]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
