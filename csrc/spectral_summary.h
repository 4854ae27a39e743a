// Spectral summary shared by the CPU kernel (cond_reg.cpp) and the CUDA kernels
// (cuda/cond_reg_kernels.cu).  Torch-free on purpose: nvcc compiles it without ATen.
//
// Input: the eigenvalues of M (ascending, float64), where M is H = ZᵀZ (covariance path,
// n = D) or A = ZZᵀ (Gram path, n = N < D).  A and H share their nonzero eigenvalues, so
// everything below is the same function of the spectrum on both paths (docs/design.md §2).
//
// Output: R(H), the coefficients of  G = ∇_H R = c_vec · v vᵀ − c_mat · H  (docs/theory.md §3), the
// index of the eigenpair v belongs to, and the diagnostics the caller sees.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define PYCORE_HD __host__ __device__
#else
#define PYCORE_HD
#endif

namespace pycore {

enum RegKind : int { kIll = 0, kWell = 1 };

// Layout of the float64 summary buffer.  The first kDiagSize entries are returned to Python as
// the `diag` output of pycore::cond_reg (keep in sync with pycore/_ops.py::_DIAG_FIELDS).
enum SummaryIndex : int {
  kSigmaMax = 0,    // λ_max(H)
  kSigmaMin = 1,    // smallest eigenvalue of H above the rank tolerance (σ_k)
  kKappa = 2,       // σ_max/σ_min over the nonzero spectrum (NaN for H = 0)
  kRank = 3,        // k = #{λ > tol}, tol = rtol·λ_max
  kGap = 4,         // λ₁−λ₂ (R_well) or λ_{k−1}−λ_k (R_ill): gap at the extreme used
  kTie = 5,         // 1 at a (near-)tie of the extreme used, where R is not differentiable
                    // (subgradient): R_well gap ≤ tie_rtol·λ₁; R_ill gap ≤ max(tie_rtol·λ_k, tol)
  kDegenerate = 6,  // 1 if R_ill is undefined (rank ≤ 1 or all nonzero eigenvalues equal)
  kGramPath = 7,    // 1 if computed in the N×N Gram space
  kEigvecMethod = 8,// 0: shifted inverse iteration, 1: full eigh, 2: not computed
  kValue64 = 9,     // R(H) in float64 (the returned value is cast to Z's dtype)
  kDiagSize = 10,
  // internal, not part of diag:
  kCVec = 10,       // c_vec
  kCMat = 11,       // c_mat
  kIndex = 12,      // ascending index of the eigenpair used (as a double)
  kSummarySize = 13,
};

// NAN / INFINITY (not std::numeric_limits, whose constexpr members are host-only for nvcc).
PYCORE_HD inline double quiet_nan() { return static_cast<double>(NAN); }
PYCORE_HD inline double pos_inf() { return static_cast<double>(INFINITY); }

// First index i with lam[i] > tol (lam ascending); n if none.  Binary search: O(log n).
PYCORE_HD inline int64_t first_above(const double* lam, int64_t n, double tol) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (lam[mid] > tol) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// (a − b)(a + b) = a² − b² without the cancellation of forming both squares: every term of
// the sums below is ≥ 0, so R_well ≥ 0 and d ≥ 0 hold in floating point too (docs/theory.md §5).
PYCORE_HD inline double diff_squares(double a, double b) { return (a - b) * (a + b); }

// The sum that both regularizers need, over the k eigenvalues above tolerance:
//   R_well:  S = Σ_{i≤k} (λ₁² − λ_i²)        R_ill:  S = Σ_{i≤k} (λ_i² − λ_k²)
// `ref` is λ₁ (well) or λ_k (ill); lam[i0..n) are the nonzero eigenvalues.
PYCORE_HD inline double summary_term(int kind, double lam_i, double ref) {
  return kind == kWell ? diff_squares(ref, lam_i) : diff_squares(lam_i, ref);
}

// Everything after the sum.  D is the size of H (p = D for R_well; Theorem 4.2 / docs/theory.md §4).
//   R_well = ½λ₁² − ‖H‖²_F/(2p) = (1/2p)[Σ_{i≤k}(λ₁²−λ_i²) + (p−k)λ₁²],  G = λ₁v₁v₁ᵀ − H/p
//   d      = ‖H‖²_F/(2k) − ½λ_k² = (1/2k) Σ_{i≤k}(λ_i²−λ_k²),  R_ill = 1/d,
//   G      = (λ_k v_k v_kᵀ − H/k)/d²
// Eigenvalues below tol = rtol·λ_max count as exact zeros (numerical rank, docs/theory.md §2).
PYCORE_HD inline void finish_summary(const double* lam, int64_t n, int64_t D, int kind,
                                     double rtol, double tie_rtol, double eps, int64_t i0,
                                     double sum, bool gram, double* out) {
  for (int i = 0; i < kSummarySize; ++i) out[i] = 0.0;
  const double lmax = n > 0 ? lam[n - 1] : 0.0;
  const int64_t k = n - i0;
  out[kGramPath] = gram ? 1.0 : 0.0;
  out[kEigvecMethod] = 2.0;
  out[kRank] = static_cast<double>(k);
  if (!(lmax == lmax)) {  // NaN eigenvalues (Z is checked for NaN first; kept as a safeguard)
    for (int i = 0; i < kSummarySize; ++i) out[i] = quiet_nan();
    out[kDegenerate] = 1.0;
    return;
  }
  out[kSigmaMax] = lmax > 0.0 ? lmax : 0.0;
  out[kSigmaMin] = k > 0 ? lam[i0] : 0.0;
  out[kKappa] = k > 0 ? lmax / lam[i0] : quiet_nan();
  if (kind == kWell) {
    const double p = static_cast<double>(D);
    const double l1 = k > 0 ? lmax : 0.0;
    // next eigenvalue of H below λ₁: lam[n−2], or an exact zero of H when n < D
    const double below = n >= 2 ? lam[n - 2] : (D > n ? 0.0 : -pos_inf());
    const double gap = k > 0 ? lmax - below : 0.0;
    const double value = (sum + (p - static_cast<double>(k)) * l1 * l1) / (2.0 * p);
    out[kValue64] = value;
    out[kCVec] = l1;
    out[kCMat] = 1.0 / p;
    out[kIndex] = static_cast<double>(n - 1);
    out[kGap] = gap;
    out[kTie] = (gap <= tie_rtol * out[kSigmaMax]) ? 1.0 : 0.0;
    return;
  }
  // R_ill
  const double lk = k > 0 ? lam[i0] : 0.0;
  const double gap = k >= 2 ? lam[i0 + 1] - lk : pos_inf();
  out[kGap] = gap;
  out[kIndex] = static_cast<double>(i0 < n ? i0 : n - 1);
  // A near-tie is relative to λ_k itself (a relative gap of √eps at the bottom of the spectrum is
  // as non-differentiable as one at the top), or at the rank tolerance, below which two computed
  // eigenvalues cannot be told apart.  Scaling by λ_max instead would flag every step of an
  // ill-conditioned H, whose small eigenvalues are all within √eps·λ_max of each other.
  const double tie_tol = tie_rtol * lk > rtol * lmax ? tie_rtol * lk : rtol * lmax;
  out[kTie] = (k >= 2 && gap <= tie_tol) ? 1.0 : 0.0;
  const double kk = static_cast<double>(k);
  const double d = k > 0 ? sum / (2.0 * kk) : 0.0;
  // d is round-off when the nonzero spectrum is flat: eigenvalues carry errors ~eps·λ_max,
  // so d ≤ 4k·eps·λ_max² is indistinguishable from κ = 1, where R_ill is undefined.
  if (k < 2 || !(d > 4.0 * kk * eps * lmax * lmax)) {
    out[kDegenerate] = 1.0;
    out[kValue64] = pos_inf();
    out[kCVec] = quiet_nan();
    out[kCMat] = quiet_nan();
    return;
  }
  out[kValue64] = 1.0 / d;
  out[kCVec] = lk / (d * d);
  out[kCMat] = 1.0 / (kk * d * d);
}

// Sequential version used on the host.
PYCORE_HD inline void spectral_summary(const double* lam, int64_t n, int64_t D, int kind,
                                       double rtol, double tie_rtol, double eps, bool gram,
                                       double* out) {
  const double lmax = n > 0 ? lam[n - 1] : 0.0;
  const double tol = lmax > 0.0 ? rtol * lmax : 0.0;
  const int64_t i0 = (lmax > 0.0) ? first_above(lam, n, tol) : n;
  const double ref = (i0 < n) ? (kind == kWell ? lmax : lam[i0]) : 0.0;
  double sum = 0.0;
  for (int64_t i = i0; i < n; ++i) sum += summary_term(kind, lam[i], ref);
  finish_summary(lam, n, D, kind, rtol, tie_rtol, eps, i0, sum, gram, out);
}

}  // namespace pycore
