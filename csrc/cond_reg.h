// Helpers of pycore::cond_reg shared by the CPU kernel (cond_reg.cpp) and the CUDA
// registration (cuda/cond_reg_cuda.cpp).  Needs ATen; the torch-free part is spectral_summary.h.
// Every refusal is PYCORE_CHECK_ARG: a Python ValueError that carries the argument at fault as a
// tag before the sentence a user reads (pycore/_ops.py raises CondRegError(parameter=the tag's
// name, the sentence)); the name is never read from the sentence.
#pragma once

#include <ATen/ATen.h>

// Refuses argument `arg` unless `cond`: "pycore.argument=<arg>;<message>" (pycore/_ops.py ARGUMENT_TAG).
#define PYCORE_CHECK_ARG(cond, arg, ...) TORCH_CHECK_VALUE(cond, "pycore.argument=", arg, ";", __VA_ARGS__)

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
