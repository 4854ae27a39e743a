// CUDA kernels of pycore::cond_reg (docs/design.md §2, §5).  Torch-free: raw pointers, cudaStream_t and
// extern "C" launchers, so `nvcc -c` compile-checks this file on machines without a GPU or a
// CUDA build of torch.  The ATen side (GEMMs through cuBLAS, eigh through cuSOLVER, dispatch
// registration) is cond_reg_cuda.cpp.
//
// Pipeline (the kernels never synchronise with the host):
//   1. summary_kernel: eigenvalues of M (ascending) -> rank, R, coefficients of ∇_H R, diag,
//      and the index of the eigenpair used, all into a device float64 buffer;
//   2. grad_matrix_kernel: builds the n×n matrix B = 2 c_vec x xᵀ − 2 c_mat M (x = the chosen
//      eigenvector, gathered on the device), with which 2 Z ∇_H R = Z B (covariance path) or
//      B Z (Gram path, since Z v vᵀ = u uᵀ Z there);
//   3. one cuBLAS GEMM applies B (cond_reg_cuda.cpp) -- the second product the op needs anyway.
#include <cuda_runtime.h>

#include <cstdint>

#include "../spectral_summary.h"

namespace {

constexpr int kSummaryThreads = 256;

// One block.  The rank is a binary search on the sorted eigenvalues; the O(n) sum of
// (λ_i − ref)(λ_i + ref) is a block reduction; thread 0 applies the shared formulas.
__global__ void summary_kernel(const double* __restrict__ lam, int64_t n, int64_t D, int kind,
                               double rtol, double tie_rtol, double eps, int gram,
                               double* __restrict__ out) {
  __shared__ double partial[kSummaryThreads];
  __shared__ int64_t s_i0;
  __shared__ double s_ref;
  if (threadIdx.x == 0) {
    const double lmax = n > 0 ? lam[n - 1] : 0.0;
    const double tol = lmax > 0.0 ? rtol * lmax : 0.0;
    s_i0 = lmax > 0.0 ? pycore::first_above(lam, n, tol) : n;
    s_ref = s_i0 < n ? (kind == pycore::kWell ? lmax : lam[s_i0]) : 0.0;
  }
  __syncthreads();
  const int64_t i0 = s_i0;
  const double ref = s_ref;
  double acc = 0.0;
  for (int64_t i = i0 + threadIdx.x; i < n; i += blockDim.x) acc += pycore::summary_term(kind, lam[i], ref);
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    pycore::finish_summary(lam, n, D, kind, rtol, tie_rtol, eps, i0, partial[0], gram != 0, out);
}

// B[r, c] = 2 c_vec x[r] x[c] − 2 c_mat M[r, c] with x = column idx of V (row-major n×n, columns
// are eigenvectors) and idx, c_vec, c_mat read from the device summary; float64 arithmetic, one
// rounding to Z's dtype at the store.  NaN coefficients (undefined R_ill) give a NaN gradient.
template <typename scalar_t>
__global__ void grad_matrix_kernel(const double* __restrict__ M, const double* __restrict__ V,
                                   const double* __restrict__ summary, int64_t n,
                                   scalar_t* __restrict__ B) {
  const int64_t idx = static_cast<int64_t>(summary[pycore::kIndex]);
  const double alpha = 2.0 * summary[pycore::kCVec];
  const double beta = -2.0 * summary[pycore::kCMat];
  const int64_t total = n * n;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / n, c = t - r * n;
    B[t] = static_cast<scalar_t>(alpha * V[r * n + idx] * V[c * n + idx] + beta * M[t]);
  }
}

inline int blocks_for(int64_t work, int threads) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 4096) b = 4096;
  return static_cast<int>(b);
}

}  // namespace

extern "C" {

// Writes pycore::kSummarySize doubles to `summary` (device).  lam: n eigenvalues, ascending.
cudaError_t pycore_cond_reg_summary(const double* lam, int64_t n, int64_t D, int kind, double rtol,
                                    double tie_rtol, double eps, int gram, double* summary,
                                    cudaStream_t stream) {
  summary_kernel<<<1, kSummaryThreads, 0, stream>>>(lam, n, D, kind, rtol, tie_rtol, eps, gram, summary);
  return cudaGetLastError();
}

// B (n×n, row-major, Z's dtype) such that 2 Z ∇_H R = Z B (covariance) or B Z (Gram).
// M: the float64 n×n matrix whose spectrum was summarised; V: its eigenvectors (row-major n×n,
// float64, columns are eigenvectors).
cudaError_t pycore_cond_reg_grad_matrix_f32(const double* M, const double* V, const double* summary,
                                            int64_t n, float* B, cudaStream_t stream) {
  grad_matrix_kernel<float><<<blocks_for(n * n, 256), 256, 0, stream>>>(M, V, summary, n, B);
  return cudaGetLastError();
}

cudaError_t pycore_cond_reg_grad_matrix_f64(const double* M, const double* V, const double* summary,
                                            int64_t n, double* B, cudaStream_t stream) {
  grad_matrix_kernel<double><<<blocks_for(n * n, 256), 256, 0, stream>>>(M, V, summary, n, B);
  return cudaGetLastError();
}

}  // extern "C"
