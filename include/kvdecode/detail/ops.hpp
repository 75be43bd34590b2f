// Dense building blocks of the cached path: RMSNorm, the [out][in] projection, SwiGLU. Each takes
// raw row-major buffers and maps them with Eigen, so callers keep ownership of every byte.
#pragma once

#include <cmath>
#include <cstddef>

#include "kvdecode/detail/cpu.hpp"

// Eigen inside the intrinsics bracket of cpu.hpp: built with -march flags its kernels inline the
// AVX-512 intrinsics, which GCC 12 reports as uninitialized (a false positive) at every use.
KVDECODE_INTRINSICS_BEGIN
#include <Eigen/Core>
KVDECODE_INTRINSICS_END

namespace kvdecode::detail {

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using StridedMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstStridedMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using VectorMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstVectorMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;

/// out[r] = gain ⊙ x[r] / sqrt(mean(x[r]²) + eps) for each of n rows of length dim
/// (= llama2.c rmsnorm(): eps inside the sqrt).
template <class T>
void rmsnorm(T* out, const T* x, const T* gain, std::size_t n, std::size_t dim, double eps) {
  const auto d = static_cast<Eigen::Index>(dim);
  const ConstVectorMap<T> g(gain, d);
  for (std::size_t r = 0; r < n; ++r) {
    const ConstVectorMap<T> xr(x + r * dim, d);
    const T ms = xr.squaredNorm() / static_cast<T>(dim);
    const T inv = T(1) / std::sqrt(ms + static_cast<T>(eps));
    VectorMap<T>(out + r * dim, d) = g.cwiseProduct(xr) * inv;
  }
}

/// y [n][out] = x [n][in] · wᵀ, w [out][in] row-major (nn.Linear). One row is a GEMV that reads
/// the weights once; more rows are a GEMM that reuses each weight across the rows.
template <class T>
void matmul(T* y, const T* x, const T* w, std::size_t n, std::size_t in, std::size_t out) {
  const auto ii = static_cast<Eigen::Index>(in);
  const auto oo = static_cast<Eigen::Index>(out);
  const Eigen::Map<const RowMatrix<T>> wm(w, oo, ii);
  if (n == 1) {
    VectorMap<T>(y, oo).noalias() = wm * ConstVectorMap<T>(x, ii);
  } else {
    const auto nn = static_cast<Eigen::Index>(n);
    Eigen::Map<RowMatrix<T>>(y, nn, oo).noalias() =
        Eigen::Map<const RowMatrix<T>>(x, nn, ii) * wm.transpose();
  }
}

/// a = silu(a) ⊙ b over count elements: SwiGLU with gate a = w1·x and up b = w3·x.
template <class T>
void swiglu(T* a, const T* b, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const T g = a[i];
    a[i] = g / (T(1) + std::exp(-g)) * b[i];
  }
}

}  // namespace kvdecode::detail
