// gemm_packed: prefill-sized projections, y [n][out] columns [c0, c1) = x [n][in] · wᵀ, in the
// run-time kernel sets. Each panel of kPanelRows weight rows is packed once, transposed (and
// widened from bf16), into the thread's panel [in][kPanelRows]; register tiles of R tokens ×
// kPanelRows outputs then read it: on AVX-512 a depth block at a time (BLIS's packed panel: a
// block's slice of kPackedDepth × 64 floats stays in L1 while every tile of tokens reads it); the
// AVX2 tiles still run the whole depth per tile of tokens.
// Every output sums `in` in index order, in blocks of kPackedDepth added to y; with bf16 weights x
// must already be rounded to bf16 (round_to_bf16), so every product is exact as the GEMV's
// (gemv.hpp's rule). gemm_packed_pairs, the avx512bf16 set's GEMM of bf16 weights, keeps the
// panel in bf16, two depths to a dword, and multiplies it by x rounded to bf16 rows with
// vdpbf16ps: the same exact products, two per lane and instruction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"        // kPanelRows, KVDECODE_UNROLL (gemv.hpp)
#include "kvdecode/detail/gemm_lanes.hpp"  // pack_pairs_avx512, kLaneRows
#include "kvdecode/detail/prefetch.hpp"
#include "kvdecode/detail/transpose.hpp"

namespace kvdecode::detail {

/// panel [in][kPanelRows] columns [0, rows) = w [rows][in]ᵀ widened to float, element by element
/// (the portable set's pack and the reference of the vectorized ones); columns past rows are left
/// as they are (the kernels never store them).
template <class W>
inline void pack_panel(float* panel, const W* w, std::size_t rows, std::size_t in) {
  for (std::size_t j = 0; j < rows; ++j) {
    const W* row = w + j * in;
    for (std::size_t k = 0; k < in; ++k) panel[k * kPanelRows + j] = widen<float>(row[k]);
  }
}

/// Depth summed in registers before it is added to y: a sum of `in` terms then errs like one of
/// kPackedDepth + in / kPackedDepth terms, not of `in` (blocked summation).
inline constexpr std::size_t kPackedDepth = 64;

/// Bytes of weights to be packed next, asked for while the current panel's tiles run: those are
/// compute bound and leave the memory idle, and the pack would otherwise wait for every line of
/// a matrix that does not fit in cache. Each tile asks for its share a line per depth step, so
/// the requests never pile up beyond what the memory system holds in flight.
struct NextWeights {
  const char* p = nullptr;
  std::size_t bytes = 0;

  /// Part [t0, t1) of n equal parts (the share of the tiles of tokens [t0, t1) of n).
  NextWeights part(std::size_t t0, std::size_t t1, std::size_t n) const {
    const std::size_t lo = t0 * bytes / n / 64 * 64;
    const std::size_t hi = t1 * bytes / n;
    return hi > lo ? NextWeights{p + lo, hi - lo} : NextWeights{};
  }
  /// Asks for lines [first, last) of these bytes (those that exist).
  KVDECODE_PREFETCH_INLINE void lines(std::size_t first, std::size_t last) const {
#if defined(__GNUC__)
    for (std::size_t o = first * 64; o < last * 64 && o < bytes; o += 64)
      __builtin_prefetch(p + o, 0, 2);
#else
    static_cast<void>(first), static_cast<void>(last);
#endif
  }
};

/// The loop of the packed GEMMs over one panel and n tokens: depth blocks of `step` units outer,
/// so that a block's slice of the panel stays in L1 while every tile reads it (each output still
/// adds its blocks to y in depth order), tiles of R tokens inner, then pairs and a single token.
/// tile(std::integral_constant<int, rows>{}, t, d0, d1, next) runs the tile of `rows` tokens from
/// token t over depth units [d0, d1) of `depth`, asking for next's lines one per depth step. The
/// next weights are shared out over the R-token tiles of every depth block; the rest of each
/// share, and all of them when there is no such tile, is asked for here.
template <int R, class Tile>
void panel_tile_loop(std::size_t n, std::size_t depth, std::size_t step, NextWeights next,
                     const Tile& tile) {
  const std::size_t nr = n / R * R;
  const std::size_t blocks = (depth + step - 1) / step;
  const std::size_t units = blocks * (nr / R);
  std::size_t u = 0;
  for (std::size_t d0 = 0; d0 < depth; d0 += step) {
    const std::size_t d1 = std::min(depth, d0 + step);
    std::size_t t = 0;
    for (; t < nr; t += R, ++u) {
      const NextWeights share = next.part(u, u + 1, units);
      tile(std::integral_constant<int, R>{}, t, d0, d1, share);
      share.lines(d1 - d0, share.bytes / 64 + 1);  // what a depth step each did not cover
    }
    for (; t + 2 <= n; t += 2) tile(std::integral_constant<int, 2>{}, t, d0, d1, NextWeights{});
    if (t < n) tile(std::integral_constant<int, 1>{}, t, d0, d1, NextWeights{});
  }
  if (units == 0) next.lines(0, next.bytes / 64 + 1);
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// ---------------------------------------------------------------------------------------------
// Packing: the panel is written in 16 × 16 (AVX-512) or 8 × 8 (AVX2) blocks, each block of weight
// rows loaded (and widened) a row at a time and transposed in registers, so every load and store
// is a whole vector.
// ---------------------------------------------------------------------------------------------

/// Lanes [0, count) of p widened to float bits, the rest zero.
template <class W>
KVDECODE_TARGET_AVX512 inline __m512i load_widened_avx512(const W* p, std::size_t count) {
  const auto m = static_cast<__mmask16>(count >= 16 ? 0xFFFFu : (1u << count) - 1u);
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_maskz_loadu_epi32(m, p);
  } else {
    static_assert(std::is_same_v<W, bf16>);
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16);
  }
}

/// pack_panel in 16 × 16 blocks; columns past rows up to the next multiple of 16 become zero.
template <class W>
KVDECODE_TARGET_AVX512 inline void pack_panel_avx512(float* panel, const W* w, std::size_t rows,
                                                     std::size_t in) {
  for (std::size_t j0 = 0; j0 < rows; j0 += 16) {
    const std::size_t jn = std::min<std::size_t>(16, rows - j0);
    for (std::size_t k0 = 0; k0 < in; k0 += 16) {
      const std::size_t kn = std::min<std::size_t>(16, in - k0);
      __m512i r[16];               // r[j]: weight row j0 + j, depths [k0, k0 + 16)
      if (jn == 16 && kn == 16) {  // a whole block: plain loads
        KVDECODE_UNROLL
        for (std::size_t j = 0; j < 16; ++j) r[j] = load_widened_avx512(w + (j0 + j) * in + k0, 16);
      } else {
        for (std::size_t j = 0; j < 16; ++j)
          r[j] = j < jn ? load_widened_avx512(w + (j0 + j) * in + k0, kn) : _mm512_setzero_si512();
      }
      transpose_16x16(r);  // r[k]: depth k0 + k, weight rows [j0, j0 + 16)
      for (std::size_t k = 0; k < kn; ++k)
        _mm512_storeu_si512(panel + (k0 + k) * kPanelRows + j0, r[k]);
    }
  }
}

/// 8 elements of p widened to float.
template <class W>
KVDECODE_TARGET_AVX2 inline __m256 load8_widened_avx2(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else {
    static_assert(std::is_same_v<W, bf16>);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

/// pack_panel in 8 × 8 blocks (depths past the last multiple of 8 element by element); columns
/// past rows up to the next multiple of 8 become zero.
template <class W>
KVDECODE_TARGET_AVX2 inline void pack_panel_avx2(float* panel, const W* w, std::size_t rows,
                                                 std::size_t in) {
  const std::size_t in8 = in / 8 * 8;
  for (std::size_t j0 = 0; j0 < rows; j0 += 8) {
    const std::size_t jn = std::min<std::size_t>(8, rows - j0);
    for (std::size_t k0 = 0; k0 < in8; k0 += 8) {
      __m256 r[8];  // r[j]: weight row j0 + j, depths [k0, k0 + 8)
      for (std::size_t j = 0; j < 8; ++j)
        r[j] = j < jn ? load8_widened_avx2(w + (j0 + j) * in + k0) : _mm256_setzero_ps();
      transpose_8x8(r);  // r[k]: depth k0 + k, weight rows [j0, j0 + 8)
      for (std::size_t k = 0; k < 8; ++k)
        _mm256_storeu_ps(panel + (k0 + k) * kPanelRows + j0, r[k]);
    }
    for (std::size_t j = j0; j < j0 + jn; ++j)
      for (std::size_t k = in8; k < in; ++k)
        panel[k * kPanelRows + j] = widen<float>(w[j * in + k]);
  }
}

/// A register tile's sums into y rows [0, R) columns [0, cols), cols ≤ 16 C: stored when first,
/// else added to what y holds; columns past cols are not touched.
template <int R, int C>
KVDECODE_TARGET_AVX512 inline void store_tile_avx512(float* y, std::size_t y_stride,
                                                     std::size_t cols, const __m512 (&acc)[R][C],
                                                     bool first) {
  KVDECODE_UNROLL
  for (int j = 0; j < C; ++j) {
    const std::size_t lo = 16 * static_cast<std::size_t>(j);
    const std::size_t left = cols > lo ? cols - lo : 0;
    const auto m = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      float* out = y + static_cast<std::size_t>(i) * y_stride + 16 * j;
      const __m512 sum =
          first ? acc[i][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), acc[i][j]);
      _mm512_mask_storeu_ps(out, m, sum);
    }
  }
}

/// y rows [0, R) columns [0, cols) (+)= x [R][k0, k1) · panel [k0, k1)[0, cols), cols ≤ 16 C,
/// k1 - k0 ≤ kPackedDepth: stored when k0 = 0, else added to y. R × C accumulators, C panel
/// loads and R broadcasts per R C multiply-adds. next's lines are asked for one per depth step.
template <int R, int C>
KVDECODE_TARGET_AVX512 inline void packed_tile_avx512(float* y, std::size_t y_stride,
                                                      const float* x, std::size_t in,
                                                      const float* panel, std::size_t cols,
                                                      std::size_t k0, std::size_t k1,
                                                      NextWeights next = {}) {
  __m512 acc[R][C];
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (std::size_t k = k0; k < k1; ++k) {
    next.lines(k - k0, k - k0 + 1);
    const float* p = panel + k * kPanelRows;
    __m512 w[C];
    KVDECODE_UNROLL
    for (int j = 0; j < C; ++j) w[j] = _mm512_loadu_ps(p + 16 * j);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(x[static_cast<std::size_t>(i) * in + k]);
      KVDECODE_UNROLL
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
  store_tile_avx512<R, C>(y, y_stride, cols, acc, k0 == 0);
}

/// packed_panel_avx512 for a panel of cols ≤ 16 C columns, through panel_tile_loop: tiles of R
/// tokens (about 24 accumulators, so a narrow panel at the end of a slice computes no zero
/// columns) over depth blocks of kPackedDepth (kPackedDepth × 64 floats of panel).
template <int R, int C>
KVDECODE_TARGET_AVX512 inline void packed_tiles_avx512(float* y, std::size_t y_stride,
                                                       const float* x, std::size_t n,
                                                       std::size_t in, const float* panel,
                                                       std::size_t cols, NextWeights next) {
  panel_tile_loop<R>(
      n, in, kPackedDepth, next,
      [&](auto rows, std::size_t t, std::size_t k0, std::size_t k1, NextWeights share) {
        packed_tile_avx512<decltype(rows)::value, C>(y + t * y_stride, y_stride, x + t * in, in,
                                                     panel, cols, k0, k1, share);
      });
}

KVDECODE_TARGET_AVX512 inline void packed_panel_avx512(float* y, std::size_t y_stride,
                                                       const float* x, std::size_t n,
                                                       std::size_t in, const float* panel,
                                                       std::size_t cols, NextWeights next) {
  if (cols > 48) return packed_tiles_avx512<6, 4>(y, y_stride, x, n, in, panel, cols, next);
  if (cols > 32) return packed_tiles_avx512<8, 3>(y, y_stride, x, n, in, panel, cols, next);
  if (cols > 16) return packed_tiles_avx512<12, 2>(y, y_stride, x, n, in, panel, cols, next);
  packed_tiles_avx512<12, 1>(y, y_stride, x, n, in, panel, cols, next);
}

/// AVX2: half a panel (32 columns) at a time, 3 × 4 accumulators of 16 registers.
template <int R>
KVDECODE_TARGET_AVX2 inline void packed_tile_avx2(float* y, std::size_t y_stride, const float* x,
                                                  std::size_t in, const float* panel,
                                                  std::size_t cols, NextWeights next = {}) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i m[4];
  KVDECODE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const std::size_t lo = 8 * static_cast<std::size_t>(j);
    const std::size_t left = std::min<std::size_t>(8, cols > lo ? cols - lo : 0);
    m[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), idx);
  }
  for (std::size_t k0 = 0; k0 < in; k0 += kPackedDepth) {
    const std::size_t k1 = std::min(in, k0 + kPackedDepth);
    __m256 acc[R][4];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (std::size_t k = k0; k < k1; ++k) {
      next.lines(k, k + 1);
      const float* p = panel + k * kPanelRows;
      __m256 xb[R];
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i)
        xb[i] = _mm256_broadcast_ss(x + static_cast<std::size_t>(i) * in + k);
      KVDECODE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256 w = _mm256_loadu_ps(p + 8 * j);
        KVDECODE_UNROLL
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xb[i], w, acc[i][j]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      float* out = y + static_cast<std::size_t>(i) * y_stride + 8 * j;
      const __m256 sum =
          k0 == 0 ? acc[i][j] : _mm256_add_ps(_mm256_maskload_ps(out, m[j]), acc[i][j]);
      _mm256_maskstore_ps(out, m[j], sum);
    }
  }
}

KVDECODE_TARGET_AVX2 inline void packed_panel_avx2(float* y, std::size_t y_stride, const float* x,
                                                   std::size_t n, std::size_t in,
                                                   const float* panel, std::size_t cols,
                                                   NextWeights next) {
  for (std::size_t h = 0; h < cols; h += 32) {
    const std::size_t c = std::min<std::size_t>(32, cols - h);
    std::size_t t = 0;
    const std::size_t halves = (cols + 31) / 32;  // the next weights shared over both halves
    for (; t + 3 <= n; t += 3) {
      const NextWeights share = next.part((h / 32) * n + t, (h / 32) * n + t + 3, halves * n);
      packed_tile_avx2<3>(y + t * y_stride + h, y_stride, x + t * in, in, panel + h, c, share);
      share.lines(in, share.bytes / 64 + 1);
    }
    next.part((h / 32) * n + t, (h / 32 + 1) * n, halves * n).lines(0, n * in);
    for (; t < n; ++t)
      packed_tile_avx2<1>(y + t * y_stride + h, y_stride, x + t * in, in, panel + h, c);
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 pairs (the avx512bf16 set, bf16 weights): the panel keeps the weights as bf16, depths 2p
// and 2p + 1 of a row in one dword, and x comes as bf16 rows; vdpbf16ps adds a lane's two exact
// products to its f32 sum, so one instruction does the work of two f32 fmas at the same rate.
// ---------------------------------------------------------------------------------------------

/// packed_tile_avx512 on pairs: y rows [0, R) columns [0, cols) (+)= x [R][2 p0, 2 p1) · panel
/// pairs [p0, p1), x rows ldx bf16 apart; stored when p0 = 0, else added to y.
template <int R, int C>
KVDECODE_TARGET_AVX512BF16 inline void pairs_tile_avx512bf16(float* y, std::size_t y_stride,
                                                             const bf16* x, std::size_t ldx,
                                                             const bf16* panel, std::size_t cols,
                                                             std::size_t p0, std::size_t p1,
                                                             NextWeights next = {}) {
  __m512 acc[R][C];
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
  for (std::size_t p = p0; p < p1; ++p) {
    next.lines(p - p0, p - p0 + 1);
    const bf16* q = panel + 2 * p * kPanelRows;
    __m512bh w[C];
    KVDECODE_UNROLL
    for (int j = 0; j < C; ++j) w[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      std::int32_t pair;  // x's depths 2p, 2p + 1 of token i
      std::memcpy(&pair, x + static_cast<std::size_t>(i) * ldx + 2 * p, sizeof pair);
      const auto xb = (__m512bh)_mm512_set1_epi32(pair);
      KVDECODE_UNROLL
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  store_tile_avx512<R, C>(y, y_stride, cols, acc, p0 == 0);
}

/// packed_tiles_avx512 on pairs: depth blocks of kPackedDepth pairs (2 kPackedDepth depths: the
/// same 16 KiB slice of the panel in L1 as an f32 block).
template <int R, int C>
KVDECODE_TARGET_AVX512BF16 inline void pairs_tiles_avx512bf16(float* y, std::size_t y_stride,
                                                              const bf16* x, std::size_t ldx,
                                                              std::size_t n, const bf16* panel,
                                                              std::size_t cols, NextWeights next) {
  panel_tile_loop<R>(
      n, ldx / 2, kPackedDepth, next,
      [&](auto rows, std::size_t t, std::size_t p0, std::size_t p1, NextWeights share) {
        pairs_tile_avx512bf16<decltype(rows)::value, C>(y + t * y_stride, y_stride, x + t * ldx,
                                                        ldx, panel, cols, p0, p1, share);
      });
}

KVDECODE_TARGET_AVX512BF16 inline void pairs_panel_avx512bf16(float* y, std::size_t y_stride,
                                                              const bf16* x, std::size_t ldx,
                                                              std::size_t n, const bf16* panel,
                                                              std::size_t cols, NextWeights next) {
  if (cols > 48) return pairs_tiles_avx512bf16<6, 4>(y, y_stride, x, ldx, n, panel, cols, next);
  if (cols > 32) return pairs_tiles_avx512bf16<8, 3>(y, y_stride, x, ldx, n, panel, cols, next);
  if (cols > 16) return pairs_tiles_avx512bf16<12, 2>(y, y_stride, x, ldx, n, panel, cols, next);
  pairs_tiles_avx512bf16<12, 1>(y, y_stride, x, ldx, n, panel, cols, next);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// Whether set ks has gemm_packed for these types: f32 activations, f32 or bf16 weights, x86.
template <class T, class W>
constexpr bool has_gemm_packed(KernelSet ks) {
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> &&
         (std::is_same_v<W, float> || std::is_same_v<W, bf16>)&&ks != KernelSet::kPortable;
}

/// pack_panel with set ks's vectorized pack (the portable set: element by element). Columns past
/// rows up to the next multiple of 16 may become zero.
template <class W>
void pack_panel(KernelSet ks, float* panel, const W* w, std::size_t rows, std::size_t in) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2) return pack_panel_avx2(panel, w, rows, in);
  if (ks != KernelSet::kPortable) return pack_panel_avx512(panel, w, rows, in);
#endif
  static_cast<void>(ks);
  pack_panel(panel, w, rows, in);
}

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ with set ks (has_gemm_packed), on
/// the thread's panel [in][kPanelRows].
template <class W>
void gemm_packed(KernelSet ks, float* y, const float* x, const W* w, std::size_t n, std::size_t in,
                 std::size_t out, std::size_t c0, std::size_t c1, float* panel) {
  for (std::size_t b = c0; b < c1; b += kPanelRows) {
    const std::size_t cols = std::min(kPanelRows, c1 - b);
    pack_panel(ks, panel, w + b * in, cols, in);
    NextWeights next;
    if (b + cols < c1)
      next = {reinterpret_cast<const char*>(w + (b + cols) * in),
              std::min(kPanelRows, c1 - b - cols) * in * sizeof(W)};
#if KVDECODE_X86_KERNELS
    if (ks == KernelSet::kAvx2)
      packed_panel_avx2(y + b, out, x, n, in, panel, cols, next);
    else
      packed_panel_avx512(y + b, out, x, n, in, panel, cols, next);
#else
    static_cast<void>(y), static_cast<void>(x), static_cast<void>(n), static_cast<void>(out),
        static_cast<void>(next);
#endif
  }
}

/// Elements in a row of x as bf16 pairs (gemm_packed_pairs): in rounded up to even.
constexpr std::size_t pair_depth(std::size_t in) { return (in + 1) / 2 * 2; }

/// Whether set ks runs the packed GEMM of bf16 weights on bf16 pairs (gemm_packed_pairs):
/// f32 activations, bf16 weights, the avx512bf16 set.
template <class T, class W>
constexpr bool has_gemm_packed_pairs(KernelSet ks) {
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> && std::is_same_v<W, bf16> &&
         ks == KernelSet::kAvx512Bf16;
}

/// xb [n][pair_depth(in)] = x [n][in] rounded to bf16 (bf16.hpp's rounding, subnormal inputs
/// zero), the pad zero: gemm_packed_pairs's input (has_gemm_packed_pairs must hold).
inline void round_rows_to_pairs(bf16* xb, const float* x, std::size_t n, std::size_t in) {
#if KVDECODE_X86_KERNELS
  round_rows_bf16_avx512bf16(xb, pair_depth(in), x, n, in);
#else
  static_cast<void>(xb), static_cast<void>(x), static_cast<void>(n), static_cast<void>(in);
#endif
}

/// y [n][out] columns [c0, c1) = xb [n][pair_depth(in)] · w [c0..c1)[in]ᵀ on bf16 pairs
/// (has_gemm_packed_pairs must hold; xb from round_rows_to_pairs), on the thread's panel of
/// kPanelRows × pair_depth(in) bf16. Every output sums `in` in order of the pairs, one per
/// instruction (depth 2p + 1's product added before 2p's, each rounded), in blocks of
/// 2 kPackedDepth added to y (with vdpbf16ps's flush of subnormal inputs and outputs).
inline void gemm_packed_pairs(float* y, const bf16* xb, const bf16* w, std::size_t n,
                              std::size_t in, std::size_t out, std::size_t c0, std::size_t c1,
                              bf16* panel) {
#if KVDECODE_X86_KERNELS
  for (std::size_t b = c0; b < c1; b += kPanelRows) {
    const std::size_t cols = std::min(kPanelRows, c1 - b);
    // panel [pair_depth(in) / 2][kPanelRows] dwords: (w[j][2p], w[j][2p + 1]) at p · kPanelRows
    // + j, the batched steps' pair pack with the panel's width
    pack_pairs_avx512<kPanelRows / kLaneRows>(reinterpret_cast<float*>(panel), w + b * in, in, cols,
                                              0, in);
    NextWeights next;
    if (b + cols < c1)
      next = {reinterpret_cast<const char*>(w + (b + cols) * in),
              std::min(kPanelRows, c1 - b - cols) * in * sizeof(bf16)};
    pairs_panel_avx512bf16(y + b, out, xb, pair_depth(in), n, panel, cols, next);
  }
#else
  static_cast<void>(y), static_cast<void>(xb), static_cast<void>(w), static_cast<void>(n);
  static_cast<void>(in), static_cast<void>(out), static_cast<void>(c0), static_cast<void>(c1);
  static_cast<void>(panel);
#endif
}

}  // namespace kvdecode::detail
