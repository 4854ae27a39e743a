// Helpers of pycore::cond_reg shared by the CPU kernel (cond_reg.cpp) and the CUDA
// registration (cuda/cond_reg_cuda.cpp).  Needs ATen; the torch-free part is spectral_summary.h.
#pragma once

#include <ATen/ATen.h>

namespace pycore {

// TORCH_CHECKs on Z (2-D, float32/float64, non-empty, contiguous) and on the tolerances.
void check_cond_reg_inputs(const at::Tensor& Z, c10::optional<double> rtol,
                           c10::optional<double> tie_rtol);
// RegKind (kIll / kWell) of "ill" / "well", or a TORCH_CHECK error naming the bad value.
int parse_kind(c10::string_view kind);
// Machine epsilon of Z's dtype (the precision H is formed in).
double dtype_eps(at::ScalarType t);
// Defaults: rtol = D·eps (numpy.linalg.matrix_rank for the D×D matrix H), tie_rtol = sqrt(eps).
double default_rtol(const at::Tensor& Z, c10::optional<double> rtol);
double default_tie_rtol(const at::Tensor& Z, c10::optional<double> tie_rtol);

}  // namespace pycore
