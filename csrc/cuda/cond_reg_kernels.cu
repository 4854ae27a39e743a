// CUDA kernels of pycore::cond_reg (DESIGN §2, §5).  Torch-free: raw pointers, cudaStream_t and
// extern "C" launchers, so `nvcc -c` compile-checks this file on machines without a GPU or a
// CUDA build of torch.  The ATen side (GEMMs through cuBLAS, eigh through cuSOLVER, dispatch
// registration) is cond_reg_cuda.cpp.
//
// Pipeline, no host synchronisation anywhere:
//   1. summary_kernel:  eigenvalues of M (ascending) -> rank, R, coefficients of ∇_H R, diag,
//      and the index of the eigenpair used, all into a device float64 buffer;
//   2. the rank-1 factors of 2 Z ∇_H R: gathers the eigenvector column chosen on the device and
//      forms Zᵀu (Gram path) or Z v (covariance path);
//   3. apply_grad_kernel: out = 2 c_vec a bᵀ − 2 c_mat P in one pass over P = A Z or Z H.
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
    pycore::finish_summary(lam, n, D, kind, tie_rtol, eps, i0, partial[0], gram != 0, out);
}

// x[r] = V[r, idx] for the eigenvector column chosen by summary_kernel (V row-major n×n).
__global__ void gather_column_kernel(const double* __restrict__ V, int64_t n,
                                     const double* __restrict__ summary, double* __restrict__ x) {
  const int64_t idx = static_cast<int64_t>(summary[pycore::kIndex]);
  for (int64_t r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x)
    x[r] = V[r * n + idx];
}

// y[j] = Σ_i Z[i, j] x[i]  (Zᵀx, Z row-major N×D): consecutive threads read consecutive j.
template <typename scalar_t>
__global__ void zt_x_kernel(const scalar_t* __restrict__ Z, const double* __restrict__ x, int64_t N,
                            int64_t D, double* __restrict__ y) {
  for (int64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < D; j += gridDim.x * blockDim.x) {
    double acc = 0.0;
    for (int64_t i = 0; i < N; ++i) acc += static_cast<double>(Z[i * D + j]) * x[i];
    y[j] = acc;
  }
}

// y[i] = Σ_j Z[i, j] x[j]  (Z x): one warp per row, shuffle reduction.
template <typename scalar_t>
__global__ void z_x_kernel(const scalar_t* __restrict__ Z, const double* __restrict__ x, int64_t N,
                           int64_t D, double* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x >> 5;
  for (int64_t i = blockIdx.x * warps_per_block + (threadIdx.x >> 5); i < N;
       i += gridDim.x * warps_per_block) {
    double acc = 0.0;
    for (int64_t j = lane; j < D; j += 32) acc += static_cast<double>(Z[i * D + j]) * x[j];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[i] = acc;
  }
}

// out[i, j] = 2 c_vec a[i] b[j] − 2 c_mat P[i, j]: builds 2 Z ∇_H R from the extreme eigenpair and
// applies it in one pass.  Coefficients are read on the device (NaN for an undefined R_ill).
template <typename scalar_t>
__global__ void apply_grad_kernel(const scalar_t* __restrict__ P, const double* __restrict__ a,
                                  const double* __restrict__ b, const double* __restrict__ summary,
                                  int64_t N, int64_t D, scalar_t* __restrict__ out) {
  const double alpha = 2.0 * summary[pycore::kCVec];
  const double beta = -2.0 * summary[pycore::kCMat];
  const int64_t total = N * D;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / D, j = t - i * D;
    out[t] = static_cast<scalar_t>(alpha * a[i] * b[j] + beta * static_cast<double>(P[t]));
  }
}

inline int blocks_for(int64_t work, int threads) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 4096) b = 4096;
  return static_cast<int>(b);
}

template <typename scalar_t>
cudaError_t launch_grad(const scalar_t* Z, const scalar_t* P, const double* V, const double* summary,
                        int64_t N, int64_t D, int gram, double* work, scalar_t* out,
                        cudaStream_t stream) {
  // work holds x (n), then the other factor (N or D): a = u, b = Zᵀu (Gram) or a = Zv, b = v.
  const int64_t n = gram ? N : D;
  double* x = work;
  double* y = work + n;
  gather_column_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(V, n, summary, x);
  const double *a, *b;
  if (gram) {
    zt_x_kernel<scalar_t><<<blocks_for(D, 256), 256, 0, stream>>>(Z, x, N, D, y);
    a = x; b = y;
  } else {
    z_x_kernel<scalar_t><<<blocks_for(N * 32, 256), 256, 0, stream>>>(Z, x, N, D, y);
    a = y; b = x;
  }
  apply_grad_kernel<scalar_t><<<blocks_for(N * D, 256), 256, 0, stream>>>(P, a, b, summary, N, D, out);
  return cudaGetLastError();
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

// out = 2 Z ∇_H R (N×D, row-major, Z's dtype).  V: eigenvectors of M (row-major n×n, float64,
// columns are eigenvectors); P = A Z (Gram) or Z H (covariance); work: n + max(N, D) doubles.
cudaError_t pycore_cond_reg_grad_f32(const float* Z, const float* P, const double* V,
                                     const double* summary, int64_t N, int64_t D, int gram,
                                     double* work, float* out, cudaStream_t stream) {
  return launch_grad<float>(Z, P, V, summary, N, D, gram, work, out, stream);
}

cudaError_t pycore_cond_reg_grad_f64(const double* Z, const double* P, const double* V,
                                     const double* summary, int64_t N, int64_t D, int gram,
                                     double* work, double* out, cudaStream_t stream) {
  return launch_grad<double>(Z, P, V, summary, N, D, gram, work, out, stream);
}

}  // extern "C"
