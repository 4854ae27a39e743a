// Helpers of pycore::cond_reg shared by the CPU kernel (cond_reg.cpp) and the CUDA
// registration (cuda/cond_reg_cuda.cpp).  Needs ATen; the torch-free part is spectral_summary.h.
// Every check raises TORCH_CHECK_VALUE (Python ValueError) with a message that starts with the
// name of the argument at fault (pycore/_ops.py turns it into CondRegError(parameter=that name)).
#pragma once

#include <ATen/ATen.h>

namespace pycore {

// Checks of Z (2-D, float32/float64, non-empty) and of the tolerances.
void check_cond_reg_inputs(const at::Tensor& Z, c10::optional<double> rtol,
                           c10::optional<double> tie_rtol);
// RegKind (kIll / kWell) of "ill" / "well", or an error naming the bad value.
int parse_kind(c10::string_view kind);
// Machine epsilon of Z's dtype (the precision H is formed in).
double dtype_eps(at::ScalarType t);
// Defaults: rtol = D·eps (numpy.linalg.matrix_rank for the D×D matrix H), tie_rtol = sqrt(eps).
double default_rtol(const at::Tensor& Z, c10::optional<double> rtol);
double default_tie_rtol(const at::Tensor& Z, c10::optional<double> tie_rtol);
// NaN/Inf in Z, from the diagonal of M = ZᵀZ or ZZᵀ (one host sync).
void check_finite_gram(const at::Tensor& M);
// No value of R in Z's dtype (host summary, spectral_summary.h layout): H = 0, undefined R_ill, overflow.
void check_summary(const double* summary, int kind, at::ScalarType t);

}  // namespace pycore
