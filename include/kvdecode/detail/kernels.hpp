// The projection kernels of the cached path, each beside its naive reference:
//   gemv_rows  y[r] = Σ_c w[r][c]·x[c] for a range of rows (decode: weights read once per token,
//              so it is memory bound; AVX-512 when the compiler targets it, Eigen otherwise);
//   gemm_cols  y[n][out] = x[n][in]·wᵀ for a range of output columns (prefill: Eigen's GEMM on
//              each thread's slice of weight rows; bf16 weights are widened panel by panel);
//   gemm_few   the same for a few tokens (a batched decode step): each weight row is streamed
//              once from memory for all tokens, f32 AVX-512 (gemm_cols elsewhere);
//   linear     either one, split across a ThreadPool.
// f32 weights with f32 activations, bf16 weights with f32 activations and f32 accumulation.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// Naive references: the plain loops every optimised kernel is checked against (tests, benches).
// ---------------------------------------------------------------------------------------------

/// y [rows] = w [rows][cols] · x [cols], one double-precision sum per row.
template <class T, class W>
void gemv_naive(T* y, const W* w, const T* x, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::size_t c = 0; c < cols; ++c)
      sum += static_cast<double>(widen<T>(w[r * cols + c])) * static_cast<double>(x[c]);
    y[r] = static_cast<T>(sum);
  }
}

/// y [n][out] = x [n][in] · w [out][in]ᵀ, one double-precision sum per element.
template <class T, class W>
void gemm_naive(T* y, const T* x, const W* w, std::size_t n, std::size_t in, std::size_t out) {
  for (std::size_t i = 0; i < n; ++i) gemv_naive(y + i * out, w, x + i * in, out, in);
}

// ---------------------------------------------------------------------------------------------
// GEMV, f32 weights.
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
inline constexpr int kGemvRows = 1;
inline constexpr int kGemvRowsBf16 = 1;

/// R consecutive rows at once: each 64-byte load of x feeds R rows, and two accumulators per
/// row hide the FMA latency (4 rows × 2 = 8 independent chains). The per-row operation order
/// is the same for every R, so a row's result does not depend on how rows are blocked, nor on
/// which thread computes it.
template <int R>
inline void gemv_block_f32_avx512(float* y, const float* w, const float* x, std::size_t cols) {
  __m512 acc0[R];
  __m512 acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + c);
    const __m512 x1 = _mm512_loadu_ps(x + c + 16);
    for (int i = 0; i < R; ++i) {
      const float* wr = w + static_cast<std::size_t>(i) * cols + c;
      acc0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wr), x0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wr + 16), x1, acc1[i]);
    }
  }
  if (c + 16 <= cols) {
    const __m512 x0 = _mm512_loadu_ps(x + c);
    for (int i = 0; i < R; ++i)
      acc0[i] =
          _mm512_fmadd_ps(_mm512_loadu_ps(w + static_cast<std::size_t>(i) * cols + c), x0, acc0[i]);
    c += 16;
  }
  if (c < cols) {  // 1..15 columns left: masked loads read nothing past the row
    const auto m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    const __m512 x0 = _mm512_maskz_loadu_ps(m, x + c);
    for (int i = 0; i < R; ++i)
      acc1[i] = _mm512_fmadd_ps(
          _mm512_maskz_loadu_ps(m, w + static_cast<std::size_t>(i) * cols + c), x0, acc1[i]);
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}
#endif

/// y[r] = Σ_c w[r][c]·x[c] for r in [r0, r1); w [rows][cols] row-major, y and w indexed by the
/// absolute row.
template <class T>
void gemv_rows(T* y, const T* w, const T* x, std::size_t r0, std::size_t r1, std::size_t cols) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (std::size_t r = r0; r < r1; r += kGemvRows)
      gemv_block_f32_avx512<kGemvRows>(y + r, w + r * cols, x, cols);
    return;
  }
#endif
  const auto ci = static_cast<Eigen::Index>(cols);
  const Eigen::Map<const RowMatrix<T>> wm(w + r0 * cols, static_cast<Eigen::Index>(r1 - r0), ci);
  VectorMap<T>(y + r0, static_cast<Eigen::Index>(r1 - r0)).noalias() =
      wm * ConstVectorMap<T>(x, ci);
}

// ---------------------------------------------------------------------------------------------
// GEMV, bf16 weights: x is rounded to bf16 and the products summed in f32, which is what the
// AVX512_BF16 dot-product instruction computes (two bf16 products, exact in f32, per lane).
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/// R rows at once, 64 columns per step: one 64-byte load of each row's weights per 32 columns,
/// x converted to bf16 once per step for all R rows.
template <int R>
inline void gemv_block_bf16_avx512(float* y, const bf16* w, const float* x, std::size_t cols) {
  __m512 acc0[R];
  __m512 acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const auto row = [&](int i, std::size_t c) {
    return reinterpret_cast<const void*>(w + static_cast<std::size_t>(i) * cols + c);
  };
  std::size_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    const __m512bh x0 = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c));
    const __m512bh x1 =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 48), _mm512_loadu_ps(x + c + 32));
    for (int i = 0; i < R; ++i) {
      acc0[i] = _mm512_dpbf16_ps(acc0[i], (__m512bh)_mm512_loadu_si512(row(i, c)), x0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], (__m512bh)_mm512_loadu_si512(row(i, c + 32)), x1);
    }
  }
  for (; c < cols; c += 32) {  // the last 1..63 columns, 32 at a time, masked past the row
    const std::size_t left = std::min<std::size_t>(32, cols - c);
    const auto m32 = static_cast<__mmask32>(left == 32 ? ~0u : (1u << left) - 1u);
    const auto lo = static_cast<__mmask16>(m32 & 0xFFFFu);
    const auto hi = static_cast<__mmask16>(m32 >> 16);
    const __m512bh x0 = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + c + 16),
                                            _mm512_maskz_loadu_ps(lo, x + c));
    for (int i = 0; i < R; ++i)
      acc0[i] = _mm512_dpbf16_ps(acc0[i], (__m512bh)_mm512_maskz_loadu_epi16(m32, row(i, c)), x0);
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}
#endif

/// The portable bf16 GEMV: the same products (bf16 weight × bf16-rounded x, exact in f32),
/// summed in f32 with four partial sums.
inline void gemv_rows_bf16_portable(float* y, const bf16* w, const float* x, std::size_t r0,
                                    std::size_t r1, std::size_t cols) {
  for (std::size_t r = r0; r < r1; ++r) {
    const bf16* wr = w + r * cols;
    float s[4] = {0, 0, 0, 0};
    std::size_t c = 0;
    for (; c + 4 <= cols; c += 4)
      for (std::size_t k = 0; k < 4; ++k)
        s[k] += static_cast<float>(wr[c + k]) * static_cast<float>(bf16(x[c + k]));
    for (; c < cols; ++c) s[0] += static_cast<float>(wr[c]) * static_cast<float>(bf16(x[c]));
    y[r] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/// The same R-row block with x already converted to bf16 (xb [cols], 64-byte aligned): one
/// load of x and of each row per 32 columns, no conversion in the row loop.
template <int R>
inline void gemv_block_bf16x_avx512(float* y, const bf16* w, const bf16* xb, std::size_t cols) {
  __m512 acc0[R];
  __m512 acc1[R];
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const auto row = [&](int i, std::size_t c) {
    return reinterpret_cast<const void*>(w + static_cast<std::size_t>(i) * cols + c);
  };
  std::size_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    const auto x0 = (__m512bh)_mm512_load_si512(xb + c);
    const auto x1 = (__m512bh)_mm512_load_si512(xb + c + 32);
    for (int i = 0; i < R; ++i) {
      acc0[i] = _mm512_dpbf16_ps(acc0[i], (__m512bh)_mm512_loadu_si512(row(i, c)), x0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], (__m512bh)_mm512_loadu_si512(row(i, c + 32)), x1);
    }
  }
  for (; c < cols; c += 32) {
    const std::size_t left = std::min<std::size_t>(32, cols - c);
    const auto m32 = static_cast<__mmask32>(left == 32 ? ~0u : (1u << left) - 1u);
    const auto x0 = (__m512bh)_mm512_maskz_loadu_epi16(m32, xb + c);
    for (int i = 0; i < R; ++i)
      acc0[i] = _mm512_dpbf16_ps(acc0[i], (__m512bh)_mm512_maskz_loadu_epi16(m32, row(i, c)), x0);
  }
  for (int i = 0; i < R; ++i) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

/// Longest input whose bf16 copy gemv_rows keeps on the stack (16 KiB); longer ones convert x
/// inside the row loop instead.
inline constexpr std::size_t kMaxStackCols = 8192;
#endif

inline void gemv_rows(float* y, const bf16* w, const float* x, std::size_t r0, std::size_t r1,
                      std::size_t cols) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (cols <= kMaxStackCols) {
    // x rounded to bf16 once per call (same RNE rounding as the in-loop conversion, so the
    // result does not depend on the path), then a pure load + dot-product loop.
    alignas(64) bf16 xb[kMaxStackCols];
    std::size_t c = 0;
    for (; c + 32 <= cols; c += 32)
      _mm512_store_si512(xb + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16),
                                                              _mm512_loadu_ps(x + c)));
    for (; c < cols; ++c) xb[c] = bf16(x[c]);
    for (std::size_t r = r0; r < r1; ++r) gemv_block_bf16x_avx512<1>(y + r, w + r * cols, xb, cols);
    return;
  }
  std::size_t r = r0;
  for (; r + kGemvRowsBf16 <= r1; r += kGemvRowsBf16)
    gemv_block_bf16_avx512<kGemvRowsBf16>(y + r, w + r * cols, x, cols);
  for (; r < r1; ++r) gemv_block_bf16_avx512<1>(y + r, w + r * cols, x, cols);
#else
  gemv_rows_bf16_portable(y, w, x, r0, r1, cols);
#endif
}

// ---------------------------------------------------------------------------------------------
// GEMM over a slice of output columns (= weight rows).
// ---------------------------------------------------------------------------------------------

/// Rows of bf16 weights widened at a time for one Eigen GEMM call: 64 rows × 2048 in × 4 bytes
/// = 512 KiB, which stays in a Zen L2 (1 MiB) while the GEMM reuses it n times.
inline constexpr std::size_t kPanelRows = 64;

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ. `panel` is this thread's
/// scratch of kPanelRows × in elements, used only when W is not T.
template <class T, class W>
void gemm_cols(T* y, const T* x, const W* w, std::size_t n, std::size_t in, std::size_t out,
               std::size_t c0, std::size_t c1, T* panel) {
  using Stride = Eigen::OuterStride<>;
  const auto ni = static_cast<Eigen::Index>(n);
  const auto ii = static_cast<Eigen::Index>(in);
  const Eigen::Map<const RowMatrix<T>> xm(x, ni, ii);
  const auto slice = [&](std::size_t b, std::size_t e, const T* rows) {
    const Eigen::Map<const RowMatrix<T>> wm(rows, static_cast<Eigen::Index>(e - b), ii);
    Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Stride>(y + b, ni, static_cast<Eigen::Index>(e - b),
                                                       Stride(static_cast<Eigen::Index>(out)))
        .noalias() = xm * wm.transpose();
  };
  if constexpr (std::is_same_v<T, W>) {
    if (c1 > c0) slice(c0, c1, w + c0 * in);
  } else {
    for (std::size_t b = c0; b < c1; b += kPanelRows) {
      const std::size_t e = std::min(c1, b + kPanelRows);
      std::transform(w + b * in, w + e * in, panel, [](W v) { return widen<T>(v); });
      slice(b, e, panel);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM of a few tokens (batched decode): weights streamed once, every token reusing each load.
// ---------------------------------------------------------------------------------------------

/// Most tokens gemm_few takes; more are a prefill-sized GEMM, where Eigen's packing pays.
inline constexpr std::size_t kMaxFewTokens = 16;

#if defined(__AVX512F__)
// The register-tile loops must unroll fully, or the accumulators live on the stack.
#if defined(__clang__)
#define KVDECODE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVDECODE_UNROLL _Pragma("GCC unroll 16")
#else
#define KVDECODE_UNROLL
#endif

/// Whether gemm_few has a kernel for these types on this target (else it calls gemm_cols).
template <class T, class W>
inline constexpr bool kHasGemmFew = std::is_same_v<T, float>&& std::is_same_v<W, float>;

/// R weight rows × N tokens: each 64-byte load of a weight row feeds N tokens and each load of
/// a token's input feeds R rows. Each (row, token) sums exactly as gemv_block_f32_avx512 does
/// (two accumulators over alternate 16-column halves of every 32, the tail in the second), so
/// a token's output does not depend on the batch it runs in and equals the GEMV's bit for bit.
template <int R, int N>
inline void gemm_few_block_avx512(float* y, std::size_t y_stride, const float* w, const float* x,
                                  std::size_t cols) {
  __m512 acc0[R][N];
  __m512 acc1[R][N];
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
  const auto wr = [&](int i) { return w + static_cast<std::size_t>(i) * cols; };
  const auto xr = [&](int j) { return x + static_cast<std::size_t>(j) * cols; };
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_loadu_ps(wr(i) + c);
      const __m512 w1 = _mm512_loadu_ps(wr(i) + c + 16);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j) {
        acc0[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr(j) + c), acc0[i][j]);
        acc1[i][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr(j) + c + 16), acc1[i][j]);
      }
    }
  }
  if (c + 16 <= cols) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_loadu_ps(wr(i) + c);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc0[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr(j) + c), acc0[i][j]);
    }
    c += 16;
  }
  if (c < cols) {
    const auto m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_maskz_loadu_ps(m, wr(i) + c);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc1[i][j] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, xr(j) + c), acc1[i][j]);
    }
  }
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j)
    y[static_cast<std::size_t>(j) * y_stride + static_cast<std::size_t>(i)] =
        _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j]));
}

/// Rows [r0, r1) of R at a time for tokens [0, n), N ≤ 4 tokens at a time (2 × 4 × 2 = 16
/// accumulators leave registers for the loads).
template <int R>
inline void gemm_few_rows_avx512(float* y, const float* x, const float* w, std::size_t n,
                                 std::size_t in, std::size_t out, std::size_t r) {
  std::size_t t = 0;
  for (; t + 4 <= n; t += 4)
    gemm_few_block_avx512<R, 4>(y + t * out + r, out, w + r * in, x + t * in, in);
  switch (n - t) {
    case 3:
      gemm_few_block_avx512<R, 3>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    case 2:
      gemm_few_block_avx512<R, 2>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    case 1:
      gemm_few_block_avx512<R, 1>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    default:
      break;
  }
}
#else
template <class T, class W>
inline constexpr bool kHasGemmFew = false;
#endif

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ for n ≤ kMaxFewTokens tokens:
/// two weight rows at a time, read from memory once and from L1 by every later group of
/// tokens. Without a kernel for the types/target it is gemm_cols.
template <class T, class W>
void gemm_few(T* y, const T* x, const W* w, std::size_t n, std::size_t in, std::size_t out,
              std::size_t c0, std::size_t c1, T* panel) {
#if defined(__AVX512F__)
  if constexpr (kHasGemmFew<T, W>) {
    std::size_t r = c0;
    for (; r + 2 <= c1; r += 2) gemm_few_rows_avx512<2>(y, x, w, n, in, out, r);
    if (r < c1) gemm_few_rows_avx512<1>(y, x, w, n, in, out, r);
    return;
  }
#endif
  gemm_cols(y, x, w, n, in, out, c0, c1, panel);
}

// ---------------------------------------------------------------------------------------------
// The threaded projection.
// ---------------------------------------------------------------------------------------------

/// Below this many weights a projection runs on one thread: waking the pool (~1-2 µs) would
/// cost more than the ~1 µs of work it shares out.
inline constexpr std::size_t kMinParallelWeights = std::size_t{1} << 15;

/// y [n][out] = x [n][in] · w [out][in]ᵀ (nn.Linear), output rows split across pool's threads
/// in blocks of 16 weight rows. One token is a GEMV (memory bound); more are a GEMM. panels is
/// [pool threads][kPanelRows][in] scratch, needed only for n > 1 with W ≠ T.
template <class T, class W>
void linear(T* y, const T* x, const W* w, std::size_t n, std::size_t in, std::size_t out,
            ThreadPool* pool, std::type_identity_t<T>* panels, std::size_t panel_stride) {
  ThreadPool* p = out * in >= kMinParallelWeights ? pool : nullptr;
  if (n == 1) {
    parallel_run(p, [&](std::size_t t, std::size_t nt) {
      const auto [r0, r1] = ThreadPool::share(out, nt, t, 16);
      if (r1 > r0) gemv_rows(y, w, x, r0, r1, in);
    });
  } else {
    parallel_run(p, [&](std::size_t t, std::size_t nt) {
      const auto [c0, c1] = ThreadPool::share(out, nt, t, 16);
      gemm_cols(y, x, w, n, in, out, c0, c1,
                panels == nullptr ? nullptr : panels + t * panel_stride);
    });
  }
}

}  // namespace kvdecode::detail
