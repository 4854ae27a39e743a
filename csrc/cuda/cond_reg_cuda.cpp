// CUDA registration of pycore::cond_reg (compiled only when setup.py builds a CUDAExtension,
// which defines WITH_CUDA).  GEMMs go through cuBLAS and eigh through cuSOLVER via ATen; the
// fused steps are the hand-written kernels of cond_reg_kernels.cu.  The host reads two small
// things, as the CPU kernel does: whether M's diagonal is finite, and the 13-double spectral
// summary that the input checks of cond_reg.cpp need.  The eigenvector comes from the full eigh
// (rank, eigenpair index and coefficients stay on the device for the gradient kernel).
#ifdef WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "../cond_reg.h"
#include "../spectral_summary.h"

extern "C" {
cudaError_t pycore_cond_reg_summary(const double* lam, int64_t n, int64_t D, int kind, double rtol,
                                    double tie_rtol, double eps, int gram, double* summary,
                                    cudaStream_t stream);
cudaError_t pycore_cond_reg_grad_matrix_f32(const double* M, const double* V, const double* summary,
                                            int64_t n, float* B, cudaStream_t stream);
cudaError_t pycore_cond_reg_grad_matrix_f64(const double* M, const double* V, const double* summary,
                                            int64_t n, double* B, cudaStream_t stream);
}

namespace pycore {

std::tuple<at::Tensor, at::Tensor, at::Tensor> cond_reg_cuda(const at::Tensor& Z,
                                                            c10::string_view kind_str,
                                                            c10::optional<double> rtol_opt,
                                                            c10::optional<double> tie_rtol_opt,
                                                            bool with_grad) {
  const int kind = parse_kind(kind_str);
  check_cond_reg_inputs(Z, rtol_opt, tie_rtol_opt);
  const c10::cuda::CUDAGuard guard(Z.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const double eps = dtype_eps(Z.scalar_type());
  const int64_t N = Z.size(0), D = Z.size(1);
  const bool gram = N < D;
  const int64_t n = gram ? N : D;

  const at::Tensor M = gram ? at::mm(Z, Z.t()) : at::mm(Z.t(), Z);  // cuBLAS, Z's dtype
  check_finite_gram(M);
  const at::Tensor M64 = M.to(at::kDouble).contiguous();
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
  check_summary(summary.to(at::kCPU).data_ptr<double>(), kind, Z.scalar_type());
  at::Tensor grad = at::empty({0}, Z.options());
  if (with_grad) {
    summary.select(0, kEigvecMethod).fill_(1.0);  // full eigh
    // 2 Z ∇_H R = Z B or B Z with the n×n matrix B built on the device from the eigenpair the
    // summary chose (grad_matrix_kernel), then one cuBLAS GEMM: the second product of the op.
    at::Tensor B = at::empty({n, n}, Z.options());
    if (Z.scalar_type() == at::kFloat) {
      C10_CUDA_CHECK(pycore_cond_reg_grad_matrix_f32(M64.data_ptr<double>(), V.data_ptr<double>(),
                                                     summary.data_ptr<double>(), n,
                                                     B.data_ptr<float>(), stream));
    } else {
      C10_CUDA_CHECK(pycore_cond_reg_grad_matrix_f64(M64.data_ptr<double>(), V.data_ptr<double>(),
                                                     summary.data_ptr<double>(), n,
                                                     B.data_ptr<double>(), stream));
    }
    grad = gram ? at::mm(B, Z) : at::mm(Z, B);
  }
  // A copy even when Z is float64: the value must not be a view into the summary buffer (the
  // fake implementation returns a fresh 0-dim tensor; opcheck compares storage offsets).
  at::Tensor value = summary.select(0, kValue64).to(Z.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  return {value, grad, summary.narrow(0, 0, kDiagSize).clone()};
}

TORCH_LIBRARY_IMPL(pycore, CUDA, m) { m.impl("cond_reg", &cond_reg_cuda); }

}  // namespace pycore
#endif  // WITH_CUDA
