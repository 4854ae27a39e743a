// CUDA registration of pycore::cond_reg (compiled only when setup.py builds a CUDAExtension,
// which defines WITH_CUDA).  GEMMs go through cuBLAS and eigh through cuSOLVER via ATen; the
// fused steps are the hand-written kernels of cond_reg_kernels.cu.  Unlike the CPU kernel
// there is no host synchronisation: the rank, the eigenpair index and the coefficients stay on
// the device, so the eigenvector comes from the full eigh (inverse iteration would need the
// eigenvalues on the host), and Z is not pre-checked for NaN/Inf (a non-finite Z gives NaN
// outputs and diag.degenerate = 1).
#ifdef WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>

#include "../cond_reg.h"
#include "../spectral_summary.h"

extern "C" {
cudaError_t pycore_cond_reg_summary(const double* lam, int64_t n, int64_t D, int kind, double rtol,
                                    double tie_rtol, double eps, int gram, double* summary,
                                    cudaStream_t stream);
cudaError_t pycore_cond_reg_grad_f32(const float* Z, const float* P, const double* V,
                                     const double* summary, int64_t N, int64_t D, int gram,
                                     double* work, float* out, cudaStream_t stream);
cudaError_t pycore_cond_reg_grad_f64(const double* Z, const double* P, const double* V,
                                     const double* summary, int64_t N, int64_t D, int gram,
                                     double* work, double* out, cudaStream_t stream);
}

namespace pycore {

std::tuple<at::Tensor, at::Tensor, at::Tensor> cond_reg_cuda(const at::Tensor& Z,
                                                            c10::string_view kind_str,
                                                            c10::optional<double> rtol_opt,
                                                            c10::optional<double> tie_rtol_opt,
                                                            bool with_grad) {
  const int kind = parse_kind(kind_str);
  check_cond_reg_inputs(Z, rtol_opt, tie_rtol_opt);
  TORCH_CHECK(Z.is_cuda(), "cond_regularizer: expected a CUDA tensor, got ", Z.device());
  const c10::cuda::CUDAGuard guard(Z.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const double eps = dtype_eps(Z.scalar_type());
  const int64_t N = Z.size(0), D = Z.size(1);
  const bool gram = N < D;
  const int64_t n = gram ? N : D;

  const at::Tensor M = gram ? at::mm(Z, Z.t()) : at::mm(Z.t(), Z);  // cuBLAS, Z's dtype
  const at::Tensor M64 = M.to(at::kDouble);
  at::Tensor lam, V;
  if (with_grad) {
    auto eig = at::linalg_eigh(M64);  // cuSOLVER syevd
    lam = std::get<0>(eig).contiguous();
    // eigenvectors as columns; make them row-major so V[r*n + c] is entry (r, c)
    V = std::get<1>(eig).contiguous();
  } else {
    lam = at::linalg_eigvalsh(M64).contiguous();
  }
  at::Tensor summary = at::empty({kSummarySize}, Z.options().dtype(at::kDouble));
  C10_CUDA_CHECK(pycore_cond_reg_summary(lam.data_ptr<double>(), n, D, kind,
                                         default_rtol(Z, rtol_opt), default_tie_rtol(Z, tie_rtol_opt),
                                         eps, gram ? 1 : 0, summary.data_ptr<double>(), stream));
  at::Tensor grad = at::empty({0}, Z.options());
  if (with_grad) {
    summary.select(0, kEigvecMethod).fill_(1.0);  // full eigh
    const at::Tensor P = gram ? at::mm(M, Z) : at::mm(Z, M);
    at::Tensor work = at::empty({n + std::max(N, D)}, Z.options().dtype(at::kDouble));
    grad = at::empty_like(Z);
    if (Z.scalar_type() == at::kFloat) {
      C10_CUDA_CHECK(pycore_cond_reg_grad_f32(Z.data_ptr<float>(), P.data_ptr<float>(),
                                              V.data_ptr<double>(), summary.data_ptr<double>(), N, D,
                                              gram ? 1 : 0, work.data_ptr<double>(),
                                              grad.data_ptr<float>(), stream));
    } else {
      C10_CUDA_CHECK(pycore_cond_reg_grad_f64(Z.data_ptr<double>(), P.data_ptr<double>(),
                                              V.data_ptr<double>(), summary.data_ptr<double>(), N, D,
                                              gram ? 1 : 0, work.data_ptr<double>(),
                                              grad.data_ptr<double>(), stream));
    }
  }
  at::Tensor value = summary.select(0, kValue64).to(Z.scalar_type());
  return {value, grad, summary.narrow(0, 0, kDiagSize).clone()};
}

TORCH_LIBRARY_IMPL(pycore, CUDA, m) { m.impl("cond_reg", &cond_reg_cuda); }

}  // namespace pycore
#endif  // WITH_CUDA
