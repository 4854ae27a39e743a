"""The spectral rule exists twice on the CPU: the C++ op (csrc/spectral_summary.h via
csrc/cond_reg.cpp) and the PyTorch fallback (pycore/ops.py ``_spectral_summary``); the CUDA
launcher shares the header.  This test drives both through the same edge cases -- ties at either
end, rank deficiency on both paths, explicit rtol / tie_rtol, undefined R_ill, the zero matrix,
float32 -- and compares EVERY diagnostic field, so that a change made to one copy and not the
other fails CI (docs/design.md §2)."""
import math

import numpy as np
import pytest
import torch

from pycore import ops
from pycore.ops import _DIAG_FIELDS

pytestmark = pytest.mark.skipif(not ops.extension_available(), reason="the C++ op is not built")

EXACT = ("rank", "tie", "degenerate", "gram_path")


def with_singular_values(N, D, s, *, seed=0, dtype=torch.float64):
    """Z (N×D) whose nonzero singular values are exactly ``s`` (so H = ZᵀZ has eigenvalues s²)."""
    rng = np.random.default_rng(seed)
    r = len(s)
    U, _ = np.linalg.qr(rng.standard_normal((N, r)))
    V, _ = np.linalg.qr(rng.standard_normal((D, r)))
    return torch.tensor((U * np.asarray(s, dtype=float)) @ V.T, dtype=dtype).contiguous()


CASES = {
    # name: (Z, kind, rtol, tie_rtol, is the gradient unique)
    "generic covariance": (with_singular_values(40, 9, np.geomspace(6, 1, 9)), "ill", None, None, True),
    "generic gram": (with_singular_values(7, 20, np.geomspace(6, 1, 7), seed=1), "well", None, None, True),
    "tie at sigma_max": (with_singular_values(30, 6, [3, 3, 2, 1.5, 1, 0.5]), "well", None, None, False),
    "tie at sigma_min": (with_singular_values(30, 6, [5, 4, 3, 2, 1, 1]), "ill", None, None, False),
    "tie at sigma_min, gram": (with_singular_values(5, 16, [5, 4, 2, 1, 1], seed=2), "ill", None, None,
                               False),
    "rank deficient covariance": (with_singular_values(30, 8, [4, 3, 2, 1, 0.5], seed=3), "ill", None, None,
                                  True),
    "rank deficient gram": (with_singular_values(6, 12, [4, 2, 1], seed=4), "ill", None, None, True),
    "rank deficient, well": (with_singular_values(30, 8, [4, 3, 2, 1], seed=5), "well", None, None, True),
    # eigenvalues of H: 16, 4, 1, 1e-4; rtol = 1e-3 cuts the last one (rank 3, σ_min = 1).
    "explicit rtol cuts": (with_singular_values(20, 4, [4, 2, 1, 1e-2], seed=6), "ill", 1e-3, None, True),
    # λ = 16, 4, 1, 0.16: λ_min/λ_max = 0.01 lies within 10× of rtol = 2e-3, so the rule must keep it.
    "explicit rtol keeps": (with_singular_values(20, 4, [4, 2, 1, 0.4], seed=6), "ill", 2e-3, None, True),
    # gap 1 − 0.95² ≈ 0.0975 relative to λ_k = 0.9025: tied for tie_rtol = 0.2, not for 0.05.
    "explicit tie_rtol ties": (with_singular_values(20, 4, [3, 2, 1, 0.95], seed=7), "ill", None, 0.2, False),
    "explicit tie_rtol no tie": (with_singular_values(20, 4, [3, 2, 1, 0.95], seed=7), "ill", None, 0.05,
                                 True),
    "R_ill undefined, rank 1": (with_singular_values(10, 5, [2.0], seed=8), "ill", None, None, False),
    "R_ill undefined, flat": (with_singular_values(10, 3, [2.0, 2.0, 2.0], seed=9), "ill", None, None, False),
    "zero matrix, well": (torch.zeros(6, 4, dtype=torch.float64), "well", None, None, False),
    "float32": (with_singular_values(40, 9, np.geomspace(6, 1, 9), dtype=torch.float32), "ill", None, None,
                True),
}


def _close(a, b, scale, rtol):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), scale)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("with_grad", [False, True])
def test_cpp_op_and_python_fallback_agree_on_every_diagnostic(name, with_grad):
    Z, kind, rtol, tie_rtol, unique = CASES[name]
    v_c, g_c, d_c = torch.ops.pycore.cond_reg(Z, kind, rtol, tie_rtol, with_grad)
    v_p, g_p, d_p = ops._cond_reg_torch(Z, kind, rtol, tie_rtol, with_grad)
    dc, dp = dict(zip(_DIAG_FIELDS, d_c.tolist())), dict(zip(_DIAG_FIELDS, d_p.tolist()))
    tol = 1e-4 if Z.dtype == torch.float32 else 1e-9
    scale = dc["sigma_max"]
    for f in _DIAG_FIELDS:
        if f in EXACT:
            assert dc[f] == dp[f], f"{name}: {f} C++ {dc[f]} vs Python {dp[f]}"
        elif f == "eigvec_method":
            # With a gradient the op may pick inverse iteration (0) or eigh (1); without, both "none".
            assert (dc[f] == dp[f] == 2.0) if not with_grad else (dc[f] in (0.0, 1.0) and dp[f] == 1.0), name
        elif f == "eigengap" and dc["tie"] and abs(dc[f]) <= 1e-6 * scale:
            # An exact tie: the gap is eigensolver round-off in both, which need not agree.
            assert abs(dp[f]) <= 1e-6 * scale, (name, dc[f], dp[f])
        elif f in ("kappa", "value64") and dc["degenerate"]:
            assert _close(dc[f], dp[f], 0.0, 1e-6), (name, f, dc[f], dp[f])
        else:
            gap_scale = scale if f in ("sigma_min", "eigengap") else 0.0
            assert _close(dc[f], dp[f], gap_scale, tol), f"{name}: {f} C++ {dc[f]!r} vs Python {dp[f]!r}"
    assert _close(float(v_c), float(v_p), 0.0, tol), (name, float(v_c), float(v_p))
    if with_grad and unique:
        assert torch.allclose(g_c.double(), g_p.double(), rtol=tol, atol=tol * float(g_p.abs().max())), name


def test_the_cases_cover_every_branch_of_the_rule():
    # The table above must keep exercising each flag on both paths (a case that silently stops
    # tying or degenerating would weaken the comparison).
    seen = {"tie": set(), "degenerate": False, "gram": False, "rank_deficient": False, "rtol_cut": False}
    for name, (Z, kind, rtol, tie_rtol, _) in CASES.items():
        d = dict(zip(_DIAG_FIELDS, torch.ops.pycore.cond_reg(Z, kind, rtol, tie_rtol, False)[2].tolist()))
        if d["tie"]:
            seen["tie"].add(kind)
        seen["degenerate"] |= bool(d["degenerate"])
        seen["gram"] |= bool(d["gram_path"])
        seen["rank_deficient"] |= 0 < d["rank"] < min(Z.shape)
        seen["rtol_cut"] |= rtol is not None and d["rank"] == 3
    assert seen == {"tie": {"ill", "well"}, "degenerate": True, "gram": True, "rank_deficient": True,
                    "rtol_cut": True}
