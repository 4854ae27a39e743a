"""Benchmarks run single-threaded (docs/design.md §5: a second busy core makes multi-threaded BLAS
timings meaningless on shared machines).  Set before any benchmark body runs."""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

torch.set_num_threads(1)
