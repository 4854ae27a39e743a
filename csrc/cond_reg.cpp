// Fused condition-number regularizer (docs/theory.md §3-4, docs/design.md §2): schemas and CPU kernels.
//
//   pycore::cond_reg(Z, kind, rtol, tie_rtol, with_grad) -> (value, dR/dZ, diag)
//       value = R_kind(H), H = ZᵀZ; when with_grad, also dR/dZ = 2 Z ∇_H R(H) (docs/theory.md §4),
//       computed in the same call so that autograd's backward is a single scale.
//   pycore::precond_linear(X, W, bias, lambda_reg, precondition) -> X Wᵀ + b
//   pycore::precond_linear_backward(...) -> (grad_X, grad_W) with
//       grad_W = (grad_outᵀ X)(XᵀX + λI)⁻¹  (right side: docs/theory.md §4 "orientation matters").
//
// Precision policy of cond_reg: the two products (forming H or the Gram matrix, and the
// product that forms dR/dZ) run in Z's dtype, like any BLAS product of that dtype; every
// spectral and scalar step (eigenvalues, rank, eigenvector, R, the n×n matrix 2∇R that the
// second product applies) runs in float64.  Pass float64 Z for float64 products (the paper's
// setting).
// Input checks live here, once: PYCORE_CHECK_ARG (cond_reg.h), a Python ValueError tagged with the
// argument at fault; pycore/_ops.py re-raises them as CondRegError(parameter=that argument).
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cond_reg.h"
#include "spectral_summary.h"

extern "C" {
// `import pycore._C` only has to load this library (its static TORCH_LIBRARY blocks register
// the ops); an empty module keeps it independent of pybind11 and of the Python ABI details.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace pycore {

int parse_kind(c10::string_view kind) {
  if (kind == "ill") return kIll;
  if (kind == "well") return kWell;
  PYCORE_CHECK_ARG(false, "kind", "kind must be 'ill' or 'well', got '", std::string(kind), "'");
}

double dtype_eps(at::ScalarType t) {
  return t == at::kFloat ? static_cast<double>(std::numeric_limits<float>::epsilon())
                         : std::numeric_limits<double>::epsilon();
}

void check_cond_reg_inputs(const at::Tensor& Z, c10::optional<double> rtol,
                           c10::optional<double> tie_rtol) {
  PYCORE_CHECK_ARG(Z.dim() == 2, "Z", "Z must be a 2-D (N x D) feature matrix, got ", Z.dim(),
                    "-D with shape ", Z.sizes());
  PYCORE_CHECK_ARG(Z.scalar_type() == at::kFloat || Z.scalar_type() == at::kDouble, "Z",
                    "Z must be float32 or float64, got ", Z.scalar_type());
  PYCORE_CHECK_ARG(Z.size(0) >= 1 && Z.size(1) >= 1, "Z", "Z must be non-empty, got shape ", Z.sizes());
  // rtol >= 1 would cut λ_max itself (rank 0).
  PYCORE_CHECK_ARG(!rtol.has_value() || (*rtol >= 0.0 && *rtol < 1.0), "rtol",
                    "rtol must be a number in [0, 1), got ", rtol.value_or(0.0));
  PYCORE_CHECK_ARG(!tie_rtol.has_value() || (*tie_rtol >= 0.0 && std::isfinite(*tie_rtol)), "tie_rtol",
                    "tie_rtol must be a finite number >= 0, got ", tie_rtol.value_or(0.0));
}

// Every entry of Z enters a diagonal entry of M = ZᵀZ or ZZᵀ as a square: one O(n) scan finds
// NaN/Inf in Z (instead of an O(ND) pass) before the eigensolver sees them.
void check_finite_gram(const at::Tensor& M) {
  PYCORE_CHECK_ARG(at::isfinite(M.diagonal()).all().item<bool>(), "Z",
                    "Z contains NaN or Inf (or ZᵀZ overflows ", M.scalar_type(), ")");
}

// Refuses a spectrum on which R has no value in Z's dtype (docs/theory.md §2-3): H = 0 (zero or
// underflowing features), squares of eigenvalues or an R (or a gradient coefficient) that
// overflow, an undefined R_ill (rank <= 1, or κ = 1 up to round-off).
void check_summary(const double* sp, int kind, at::ScalarType t) {
  const double lmax = sp[kSigmaMax], value = sp[kValue64];
  PYCORE_CHECK_ARG(lmax == lmax, "Z", "Z gives NaN eigenvalues of ZᵀZ");
  PYCORE_CHECK_ARG(sp[kRank] > 0.0, "Z", "Z gives ZᵀZ = 0 in ", t,
                    " (zero or underflowing features): R is undefined without a nonzero eigenvalue");
  const double vmax = t == at::kFloat ? static_cast<double>(std::numeric_limits<float>::max())
                                      : std::numeric_limits<double>::max();
  const bool overflow = !std::isfinite(lmax * lmax) ||
                        (sp[kDegenerate] == 0.0 && !(std::abs(value) <= vmax && std::isfinite(sp[kCVec]) &&
                                                     std::isfinite(sp[kCMat])));
  PYCORE_CHECK_ARG(!overflow, "Z", "Z gives R_", kind == kIll ? "ill" : "well", " = ", value,
                    " or a gradient that overflows ", t, " (λ_max of ZᵀZ = ", lmax, "): rescale the features");
  PYCORE_CHECK_ARG(sp[kDegenerate] == 0.0, "Z", "Z gives an undefined R_ill: ZᵀZ has rank ",
                    static_cast<int64_t>(sp[kRank]), " and κ = ", sp[kKappa],
                    ", R_ill needs two distinct nonzero eigenvalues");
}

// Defaults: rank tolerance of numpy.linalg.matrix_rank for the D×D matrix H in Z's precision
// (H is formed in that precision, so eigenvalues below D·eps·λ_max are round-off), and a tie
// when the gap at the extreme is below sqrt(eps)·λ_max: the extreme eigenvector then carries
// an error ~eps·λ_max/gap ≥ sqrt(eps), i.e. fewer than half the digits (pycore.spectral does
// the same in float64).
double default_rtol(const at::Tensor& Z, c10::optional<double> rtol) {
  return rtol.has_value() ? *rtol : static_cast<double>(Z.size(1)) * dtype_eps(Z.scalar_type());
}
double default_tie_rtol(const at::Tensor& Z, c10::optional<double> tie_rtol) {
  return tie_rtol.has_value() ? *tie_rtol : std::sqrt(dtype_eps(Z.scalar_type()));
}

namespace {

// Solves (L Lᵀ) z = x in place (L row-major lower triangular, n×n), both sweeps reading L by rows.
void cholesky_solve_inplace(const double* L, int64_t n, double* x) {
  for (int64_t i = 0; i < n; ++i) {  // L y = x
    const double* Li = L + i * n;
    double acc = x[i];
    for (int64_t j = 0; j < i; ++j) acc -= Li[j] * x[j];
    x[i] = acc / Li[i];
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // Lᵀ z = y, column-oriented so that row i of L is read
    const double* Li = L + i * n;
    x[i] /= Li[i];
    const double zi = x[i];
    for (int64_t j = 0; j < i; ++j) x[j] -= Li[j] * zi;
  }
}

double norm2(const double* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return std::sqrt(s);
}

// Unit eigenvector of the symmetric M (float64, n×n, contiguous) for its extreme eigenvalue
// lam[idx] (idx = 0 or n−1), by inverse iteration with a definite shift: (M − μI) with μ just
// outside the spectrum is positive (or negative) definite, so one Cholesky factorisation
// (n³/3) and a few O(n²) triangular sweeps replace the full eigh (~2.5x the cost of
// eigvalsh).  The shift sits δ = 1e-3·gap beyond the eigenvalue, so each step shrinks the other
// components by ≤ δ/(gap+δ) ≈ 1e-3.  Returns an undefined tensor when the shortcut does not
// apply (interior eigenvalue, tiny gap, failed factorisation, no convergence, large residual);
// the caller then uses eigh.
at::Tensor extreme_eigvec_inverse_iteration(const at::Tensor& M, const double* lam, int64_t n,
                                            int64_t idx) {
  if (n == 1) return at::ones({1}, M.options());
  const bool top = (idx == n - 1);
  if (!top && idx != 0) return at::Tensor();
  const double lmax = std::max(std::abs(lam[n - 1]), std::abs(lam[0]));
  const double gap = top ? lam[n - 1] - lam[n - 2] : lam[1] - lam[0];
  const double eps = std::numeric_limits<double>::epsilon();
  const double delta = 1e-3 * gap;
  if (!(delta > 64.0 * static_cast<double>(n) * eps * lmax)) return at::Tensor();
  const double mu = top ? lam[idx] + delta : lam[idx] - delta;
  at::Tensor B = top ? at::neg(M) : M.clone();
  B.diagonal().add_(top ? mu : -mu);  // B = ±(M − μI), positive definite
  auto chol = at::linalg_cholesky_ex(B, /*upper=*/false, /*check_errors=*/false);
  if (std::get<1>(chol).item<int64_t>() != 0) return at::Tensor();
  const at::Tensor L = std::get<0>(chol).contiguous();
  const double* Lp = L.data_ptr<double>();
  // Deterministic start with no special structure (a fixed LCG, not a global RNG): a start
  // orthogonal to the target would need exact cancellation against these values.
  at::Tensor xt = at::empty({n}, M.options());
  double* x = xt.data_ptr<double>();
  uint64_t s = 0x9E3779B97F4A7C15ULL;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    x[i] = 0.5 + static_cast<double>(s >> 11) * (1.0 / 9007199254740992.0);
  }
  double nx = norm2(x, n);
  for (int64_t i = 0; i < n; ++i) x[i] /= nx;
  std::vector<double> y(n);
  // Stop at the round-off floor: successive iterates agree to ~eps, or stop improving.
  double diff = 1.0, prev = 2.0;
  for (int it = 0; it < 12; ++it) {
    std::copy(x, x + n, y.begin());
    cholesky_solve_inplace(Lp, n, y.data());
    const double ny = norm2(y.data(), n);
    double dot = 0.0;
    for (int64_t i = 0; i < n; ++i) dot += y[i] * x[i];
    const double scale = (dot < 0 ? -1.0 : 1.0) / ny;
    double d2 = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double yi = y[i] * scale;
      d2 += (yi - x[i]) * (yi - x[i]);
      x[i] = yi;
    }
    diff = std::sqrt(d2);
    if (diff <= 16.0 * eps * std::sqrt(static_cast<double>(n))) break;
    if (it >= 3 && diff > 0.5 * prev) break;  // stagnated at the floor (or not converging)
    prev = diff;
  }
  // the last step shrank the error by ~1e-3 more than `diff`
  if (!(diff <= 1e-8)) return at::Tensor();
  // Backward-stable check: ‖Mx − λx‖ at the level a full eigensolver would reach.
  const double* Mp = M.data_ptr<double>();
  double r2 = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double* Mi = Mp + i * n;
    double acc = -lam[idx] * x[i];
    for (int64_t j = 0; j < n; ++j) acc += Mi[j] * x[j];
    r2 += acc * acc;
  }
  if (!(std::sqrt(r2) <= 16.0 * static_cast<double>(n) * eps * lmax)) return at::Tensor();
  return xt;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cond_reg_cpu(const at::Tensor& Z,
                                                           c10::string_view kind_str,
                                                           c10::optional<double> rtol_opt,
                                                           c10::optional<double> tie_rtol_opt,
                                                           bool with_grad) {
  const int kind = parse_kind(kind_str);
  check_cond_reg_inputs(Z, rtol_opt, tie_rtol_opt);
  const double rtol = default_rtol(Z, rtol_opt);
  const double tie_rtol = default_tie_rtol(Z, tie_rtol_opt);
  const int64_t N = Z.size(0), D = Z.size(1);
  const bool gram = N < D;  // Gram space: A = ZZᵀ (N×N) has the nonzero eigenvalues of H
  const int64_t n = gram ? N : D;

  const at::Tensor M = gram ? at::mm(Z, Z.t()) : at::mm(Z.t(), Z);  // Z's dtype
  check_finite_gram(M);
  const at::Tensor M64 = M.to(at::kDouble).contiguous();
  const at::Tensor lam = at::linalg_eigvalsh(M64).contiguous();  // ascending
  at::Tensor summary = at::empty({kSummarySize}, Z.options().dtype(at::kDouble));
  double* sp = summary.data_ptr<double>();
  spectral_summary(lam.data_ptr<double>(), n, D, kind, rtol, tie_rtol, dtype_eps(Z.scalar_type()),
                   gram, sp);
  check_summary(sp, kind, Z.scalar_type());

  at::Tensor grad = at::empty({0}, Z.options());
  if (with_grad) {
    const int64_t idx = static_cast<int64_t>(sp[kIndex]);
    at::Tensor x = (sp[kTie] == 0.0)
                       ? extreme_eigvec_inverse_iteration(M64, lam.data_ptr<double>(), n, idx)
                       : at::Tensor();
    sp[kEigvecMethod] = 0.0;
    if (!x.defined()) {  // ties, interior eigenvalues (rank-deficient R_ill), hard cases
      x = std::get<1>(at::linalg_eigh(M64)).select(1, idx).contiguous();
      sp[kEigvecMethod] = 1.0;
    }
    // dR/dZ = 2 Z G with G = c_vec v vᵀ − c_mat H is ONE product with an n×n matrix
    //   B = 2 c_vec x xᵀ − 2 c_mat M   (float64, O(n²), x the unit eigenvector of M):
    //   covariance path (M = H, x = v):  2 Z G = Z B;
    //   Gram path (M = A = ZZᵀ, x = u, v = Zᵀu/√λ, so Z v vᵀ = A u uᵀZ/λ = u uᵀ Z):  2 Z G = B Z.
    // The rank-1 part of ∇_H R is folded into the second GEMM the op has to do anyway, so
    // nothing beyond the two GEMMs touches an N×D array.
    const at::Tensor B = at::addr(M64, x, x, /*beta=*/-2.0 * sp[kCMat], /*alpha=*/2.0 * sp[kCVec])
                             .to(Z.scalar_type());
    grad = gram ? at::mm(B, Z) : at::mm(Z, B);  // the second product, Z's dtype
  }
  at::Tensor value = at::scalar_tensor(sp[kValue64], Z.options());
  return {value, grad, summary.narrow(0, 0, kDiagSize).clone()};
}

// ---------------------------------------------------------------------------------------------
// Immunization head (paper Appendix C.3 "dummy layer"): Z = X Wᵀ (+ b), preconditioned weight
// gradient.  Composed of ATen calls only (GEMM, Cholesky), so one kernel serves every device:
// registered as CompositeExplicitAutograd (cuBLAS/cuSOLVER through ATen on CUDA).
// ---------------------------------------------------------------------------------------------

namespace {

void check_head_inputs(const at::Tensor& X, const at::Tensor& W, double lambda_reg) {
  PYCORE_CHECK_ARG(X.dim() == 2 && X.layout() == at::kStrided, "X",
                    "X must be a dense 2-D (N x D_in) matrix, got a ", X.dim(), "-D ", X.layout(),
                    " tensor");
  PYCORE_CHECK_ARG(W.dim() == 2 && X.size(1) == W.size(1), "W", "W must have shape (D_out, ", X.size(1),
                    ") to match X, got ", W.sizes());
  PYCORE_CHECK_ARG(X.scalar_type() == at::kFloat || X.scalar_type() == at::kDouble, "X",
                    "X must be float32 or float64, got ", X.scalar_type());
  PYCORE_CHECK_ARG(W.scalar_type() == X.scalar_type() && W.device() == X.device(), "W", "W is ",
                    W.scalar_type(), " on ", W.device(), " but X is ", X.scalar_type(), " on ",
                    X.device());
  PYCORE_CHECK_ARG(lambda_reg >= 0.0 && std::isfinite(lambda_reg), "lambda_reg",
                    "lambda_reg must be a finite number >= 0, got ", lambda_reg);
}

}  // namespace

at::Tensor precond_linear(const at::Tensor& X, const at::Tensor& W,
                          const c10::optional<at::Tensor>& bias, double lambda_reg,
                          bool precondition) {
  check_head_inputs(X, W, lambda_reg);
  if (!bias.has_value() || !bias->defined()) return at::mm(X, W.t());
  PYCORE_CHECK_ARG(bias->dim() == 1 && bias->size(0) == W.size(0) &&
                        bias->scalar_type() == W.scalar_type() && bias->device() == W.device(), "bias",
                    "bias must be a ", W.scalar_type(), " vector of length ", W.size(0), " on ",
                    W.device(), ", got ", bias->scalar_type(), " ", bias->sizes(), " on ",
                    bias->device());
  return at::addmm(*bias, X, W.t());
}

// grad_W (XᵀX + λI)⁻¹ with grad_W = grad_outᵀ X, in float64 (λ = 1e-7 next to eigenvalues of
// order 1e2-1e4 gives a condition number far beyond float32's 1e7).
//   N ≥ D_in: Cholesky of the D_in×D_in matrix K + λI.
//   N < D_in: push-through identity  X(XᵀX + λI)⁻¹ = (XXᵀ + λI)⁻¹X, so
//             grad_W (K + λI)⁻¹ = [(XXᵀ + λI)⁻¹ grad_out]ᵀ X  with an N×N Cholesky:
//             O(N²D + N³).  This is Woodbury's identity applied to the product, without the
//             (1/λ)(I − Xᵀ(XXᵀ+λI)⁻¹X) form, whose 1/λ = 1e7 would cancel catastrophically.
//             With λ = 0 it gives grad_W K⁺ for X of full row rank (docs/theory.md §5: K⁺ when K is singular).
std::tuple<at::Tensor, at::Tensor> precond_linear_backward(const at::Tensor& grad_out,
                                                           const at::Tensor& X,
                                                           const at::Tensor& W, double lambda_reg,
                                                           bool precondition, bool need_input,
                                                           bool need_weight) {
  check_head_inputs(X, W, lambda_reg);
  PYCORE_CHECK_ARG(grad_out.dim() == 2 && grad_out.size(0) == X.size(0) &&
                        grad_out.size(1) == W.size(0) && grad_out.scalar_type() == X.scalar_type() &&
                        grad_out.device() == X.device(), "grad_out",
                    "grad_out must be ", X.scalar_type(), " of shape (", X.size(0), ", ", W.size(0),
                    ") on ", X.device(), ", got ", grad_out.scalar_type(), " ", grad_out.sizes(), " on ",
                    grad_out.device());
  at::Tensor grad_X = need_input ? at::mm(grad_out, W) : at::empty({0}, X.options());
  if (!need_weight) return {grad_X, at::empty({0}, W.options())};
  if (!precondition) return {grad_X, at::mm(grad_out.t(), X)};
  const int64_t N = X.size(0), Din = X.size(1);
  const at::Tensor X64 = X.to(at::kDouble);
  const at::Tensor G64 = grad_out.to(at::kDouble);
  const bool gram = N < Din;
  at::Tensor S = gram ? at::mm(X64, X64.t()) : at::mm(X64.t(), X64);
  S.diagonal().add_(lambda_reg);
  auto chol = at::linalg_cholesky_ex(S, /*upper=*/false, /*check_errors=*/false);
  if (!X.is_meta() && std::get<1>(chol).item<int64_t>() != 0) {
    // A NaN/Inf batch fails the factorisation too: name it (checked only on failure, no sync otherwise).
    const int64_t bad = (~at::isfinite(X)).sum().item<int64_t>();
    PYCORE_CHECK_ARG(bad == 0, "X", "X contains NaN or Inf (", bad, " of ", X.numel(), " entries)");
    PYCORE_CHECK_ARG(false, "lambda_reg", "lambda_reg = ", lambda_reg, " leaves ", gram ? "XXᵀ + λI" : "XᵀX + λI",
                      " not positive definite in float64 (rank-deficient batch features): use a larger "
                      "lambda_reg");
  }
  const at::Tensor& L = std::get<0>(chol);
  at::Tensor gW;
  if (gram) {
    gW = at::mm(at::cholesky_solve(G64, L, /*upper=*/false).t(), X64);  // (D_out×N)(N×D_in)
  } else {
    // (K+λI) symmetric:  grad_W (K+λI)⁻¹ = [(K+λI)⁻¹ grad_Wᵀ]ᵀ
    gW = at::cholesky_solve(at::mm(X64.t(), G64), L, /*upper=*/false).t();
  }
  return {grad_X, gW.to(W.scalar_type()).contiguous()};
}

TORCH_LIBRARY(pycore, m) {
  m.def("cond_reg(Tensor Z, str kind, float? rtol=None, float? tie_rtol=None, bool with_grad=False)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("precond_linear(Tensor X, Tensor W, Tensor? bias, float lambda_reg, bool precondition)"
        " -> Tensor");
  m.def("precond_linear_backward(Tensor grad_out, Tensor X, Tensor W, float lambda_reg,"
        " bool precondition, bool need_input, bool need_weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pycore, CPU, m) { m.impl("cond_reg", &cond_reg_cpu); }

TORCH_LIBRARY_IMPL(pycore, CompositeExplicitAutograd, m) {
  m.impl("precond_linear", &precond_linear);
  m.impl("precond_linear_backward", &precond_linear_backward);
}

}  // namespace pycore
