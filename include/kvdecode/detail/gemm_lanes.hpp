// gemm_lanes: y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ for a few tokens of
// different sequences (a batched step), with the outputs in vector lanes: a tile of 16 weight
// rows is transposed chunk by chunk into an L1-resident buffer [k][16], and for each k one
// column of 16 rows is multiplied by x[t][k] broadcast, for every token of the batch.
//
// Summation order: every output (row r, token t) is one f32 chain over k in order,
// s = fma(w[r][k], x[t][k], s) from s = 0, whatever n, the tile, the thread split or the set
// (AVX2 and AVX-512 alike), so a sequence's outputs do not depend on the batch it rides in. It
// is not the GEMV's order (gemv.hpp), so a token here differs from decode() within f32 rounding.
// bf16 weights follow gemv.hpp's rule (x already rounded by the caller, products exact): widened
// at transposition, the same chain; with AVX512_BF16 vdpbf16ps adds the products pair by pair.
// Choice: Model's batched entry points use it for 2..16 rows (linear.hpp FewTokenOrder::kLanes),
// trading bit-equality with decode() (B = 1 stays the GEMV) for speed and batch independence.
// From kTokenLanesMin tokens, f32 weights on AVX-512 (bf16 weights with AVX512_BF16 from
// kTokenPairLanesMin) turn the tile around: the tokens fill the lanes (x transposed once into
// the thread's panel; for bf16, as pairs) and each weight (pair) is broadcast from memory into
// its row's fma (vdpbf16ps), so the weights stream in their own order with no transposes, the
// same sums per output.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/detail/gemv.hpp"
#include "kvdecode/detail/transpose.hpp"

namespace kvdecode::detail {

/// Output rows in one lane tile: one zmm, two ymm.
inline constexpr std::size_t kLaneRows = 16;

/// The transposed chunk of a tile of R × kLaneRows rows holds kLaneChunk / R columns: 16 KiB,
/// so it stays in L1 while every token of the batch reads it.
inline constexpr std::size_t kLaneChunk = 256;

/// Tokens from which f32 weights on AVX-512 run with the tokens in lanes (tokens_tile_avx512):
/// below it most of each fma's 16 lanes would be padding.
inline constexpr std::size_t kTokenLanesMin = 4;

/// The same for bf16 weights with AVX512_BF16 (tokens_tile_dpbf16): a tile costs 16 tokens'
/// vdpbf16ps whatever n, and below 13 the weight-lane tiles' n-token work measures less
/// (kernels_bench BM_FewTokens<bf16>, docs/RESULTS.md).
inline constexpr std::size_t kTokenPairLanesMin = 13;

/// Whether set ks has a gemm_lanes kernel for these types (else gemm_lanes is gemm_few).
template <class T, class W>
constexpr bool has_gemm_lanes(KernelSet ks) {
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> &&
         (std::is_same_v<W, float> || std::is_same_v<W, bf16>)&&ks != KernelSet::kPortable;
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// Streams the next tile's weights [p, end) into L2 while this tile computes, `per` cache lines
/// per step of its k loops: the packs then find them there, instead of stalling on memory.
struct TilePrefetch {
  const char* p;
  const char* end;
  std::size_t per;

  /// For `bytes` from `next`, over `steps` k steps.
  TilePrefetch(const void* next, std::size_t bytes, std::size_t steps)
      : p(static_cast<const char*>(next)),
        end(p + bytes),
        per((bytes / 64 + steps) / std::max<std::size_t>(steps, 1)) {}

  void step() {
    for (std::size_t i = 0; i < per && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 × 16 transposes, tiles of R × 16 rows against up to 16 / R tokens.
// ---------------------------------------------------------------------------------------------

/// Loads 16 rows of 64 bytes (elements [0, cols) of rows [0, rows) of w [][in]; rows past
/// `rows` and elements past `cols` read as zero) and transposes their dwords.
template <class W>
KVDECODE_TARGET_AVX512 inline void load_transpose_16x16(__m512 v[16], const W* w, std::size_t in,
                                                        std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < 16; ++r) {
    if (r >= rows) {
      v[r] = _mm512_setzero_ps();
    } else if constexpr (std::is_same_v<W, float>) {
      const auto m = static_cast<__mmask16>(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
      v[r] = _mm512_maskz_loadu_ps(m, w + r * in);
    } else {
      const auto m = static_cast<__mmask32>(cols >= 32 ? ~0u : (1u << cols) - 1u);
      v[r] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, w + r * in));
    }
  }
  transpose_16x16(v);
}

/// Packs columns [k0, k0 + kc) of rows [r, r + rows) (rows ≤ R × 16) of f32 or bf16 weights
/// into buf [kc][R × 16] f32 (missing rows zero).
template <int R, class W>
KVDECODE_TARGET_AVX512 inline void pack_lanes_avx512(float* buf, const W* w, std::size_t in,
                                                     std::size_t rows, std::size_t k0,
                                                     std::size_t kc) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;  // buf row width
  constexpr std::size_t kPer = std::is_same_v<W, float> ? 16 : 32;     // columns per transpose
  for (int i = 0; i < R; ++i) {
    const std::size_t r0 = static_cast<std::size_t>(i) * kLaneRows;
    const std::size_t here = rows > r0 ? std::min(kLaneRows, rows - r0) : 0;
    for (std::size_t k = 0; k < kc; k += kPer) {
      __m512 v[16];
      const std::size_t cols = std::min(kPer, kc - k);
      load_transpose_16x16(v, w + r0 * in + k0 + k, in, here, cols);
      float* dst = buf + k * kW + r0;
      if constexpr (std::is_same_v<W, float>) {
        for (std::size_t c = 0; c < cols; ++c) _mm512_store_ps(dst + c * kW, v[c]);
      } else {  // dword j holds columns 2j (low half) and 2j + 1 (high half)
        const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
        for (std::size_t j = 0; 2 * j < cols; ++j) {
          const __m512i d = _mm512_castps_si512(v[j]);
          _mm512_store_ps(dst + 2 * j * kW, _mm512_castsi512_ps(_mm512_slli_epi32(d, 16)));
          if (2 * j + 1 < cols)
            _mm512_store_ps(dst + (2 * j + 1) * kW, _mm512_castsi512_ps(_mm512_and_si512(d, hi)));
        }
      }
    }
  }
}

/// acc [N][R × 16] (+)= buf [kc][R × 16] columns × x [N][x_stride] (columns [0, kc)), one fma
/// per k in order for every output.
template <int R, int N>
KVDECODE_TARGET_AVX512 inline void lanes_block_avx512(float* acc, const float* buf, const float* x,
                                                      std::size_t x_stride, std::size_t kc,
                                                      bool first, TilePrefetch& pf) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;
  __m512 a[R][N];
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) KVDECODE_UNROLL
  for (int i = 0; i < R; ++i)
    a[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + j * kW + i * kLaneRows);
  for (std::size_t k = 0; k < kc; ++k) {
    pf.step();
    __m512 col[R];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) col[i] = _mm512_load_ps(buf + k * kW + i * kLaneRows);
    KVDECODE_UNROLL
    for (int j = 0; j < N; ++j) {
      const __m512 b = _mm512_set1_ps(x[static_cast<std::size_t>(j) * x_stride + k]);
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) a[i][j] = _mm512_fmadd_ps(col[i], b, a[i][j]);
    }
  }
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) _mm512_store_ps(acc + j * kW + i * kLaneRows, a[i][j]);
}

/// Packs columns [k0, k0 + kc) of rows [r, r + rows) of bf16 weights as dword pairs into
/// buf [kc / 2][R × 16] (kc even or the chunk's last; missing rows zero). Also the packed
/// GEMM's pair panel (gemm_packed_pairs, R × 16 = kPanelRows), so buf need not be aligned.
template <int R>
KVDECODE_TARGET_AVX512BF16 inline void pack_pairs_avx512(float* buf, const bf16* w, std::size_t in,
                                                         std::size_t rows, std::size_t k0,
                                                         std::size_t kc) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;
  for (int i = 0; i < R; ++i) {
    const std::size_t r0 = static_cast<std::size_t>(i) * kLaneRows;
    const std::size_t here = rows > r0 ? std::min(kLaneRows, rows - r0) : 0;
    for (std::size_t k = 0; k < kc; k += 32) {
      __m512 v[16];
      const std::size_t cols = std::min<std::size_t>(32, kc - k);
      const std::size_t pairs = (cols + 1) / 2;
      load_transpose_16x16(v, w + r0 * in + k0 + k, in, here, cols);
      for (std::size_t j = 0; j < pairs; ++j) _mm512_storeu_ps(buf + (k / 2 + j) * kW + r0, v[j]);
    }
  }
}

/// acc [N][R × 16] (+)= buf [pairs][R × 16] dword pairs · xb [N][xb_stride] (bf16 pairs as
/// dwords), vdpbf16ps per pair in order.
template <int R, int N>
KVDECODE_TARGET_AVX512BF16 inline void lanes_block_dpbf16(float* acc, const float* buf,
                                                          const std::uint32_t* xb,
                                                          std::size_t xb_stride, std::size_t pairs,
                                                          bool first, TilePrefetch& pf) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;
  __m512 a[R][N];
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) KVDECODE_UNROLL
  for (int i = 0; i < R; ++i)
    a[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + j * kW + i * kLaneRows);
  for (std::size_t k = 0; k < pairs; ++k) {
    pf.step();
    __m512bh col[R];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) col[i] = (__m512bh)_mm512_load_si512(buf + k * kW + i * kLaneRows);
    KVDECODE_UNROLL
    for (int j = 0; j < N; ++j) {
      const auto b = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(xb[static_cast<std::size_t>(j) * xb_stride + k]));
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) a[i][j] = _mm512_dpbf16_ps(a[i][j], col[i], b);
    }
  }
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) _mm512_store_ps(acc + j * kW + i * kLaneRows, a[i][j]);
}

/// The floats p[0, min(left, 32)) as 16 bf16 pairs (dword j: p[2j] low, p[2j + 1] high; x is
/// already rounded, so the conversion is exact), missing columns zero.
KVDECODE_TARGET_AVX512BF16 inline __m512i load_x_pairs(const float* p, std::size_t left) {
  const auto lo = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
  const auto hi = static_cast<__mmask16>(left >= 32  ? 0xFFFFu
                                         : left > 16 ? (1u << (left - 16)) - 1u
                                                     : 0u);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16),
                                      _mm512_maskz_loadu_ps(lo, p));
}

/// xb [n][xb_stride] dwords = x [n][in] columns [k0, k0 + kc) as bf16 pairs; an odd last
/// column pairs with zero.
KVDECODE_TARGET_AVX512BF16 inline void pack_x_pairs(std::uint32_t* xb, std::size_t xb_stride,
                                                    const float* x, std::size_t n, std::size_t in,
                                                    std::size_t k0, std::size_t kc) {
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t k = 0; k < kc; k += 32)
      _mm512_storeu_si512(xb + t * xb_stride + k / 2,
                          load_x_pairs(x + t * in + k0 + k, std::min<std::size_t>(32, kc - k)));
}

/// The token groups of one tile: n tokens in groups of at most 16 / R (so R × N ≤ 16
/// accumulators), sizes balanced; block(j, N) runs tokens [j, j + N).
template <int R, class Block>
inline void for_token_groups(std::size_t n, Block&& block) {
  constexpr std::size_t kMax = 16 / static_cast<std::size_t>(R);
  const std::size_t groups = (n + kMax - 1) / kMax;
  for (std::size_t g = 0, j = 0; g < groups; ++g) {
    const std::size_t size = (n - j) / (groups - g);
    block(j, size);
    j += size;
  }
}

/// Writes acc [n][R × 16] to y [n][out] columns [r, r + rows).
inline void store_lanes(float* y, std::size_t out, const float* acc, std::size_t n, std::size_t kw,
                        std::size_t r, std::size_t rows) {
  for (std::size_t t = 0; t < n; ++t)
    std::memcpy(y + t * out + r, acc + t * kw, rows * sizeof(float));
}

/// Calls f(std::integral_constant<int, N>) for N = n in 1..kMax.
template <int kMax, class F>
inline void with_tokens(std::size_t n, F&& f) {
  if constexpr (kMax > 0) {
    if (n == static_cast<std::size_t>(kMax)) return f(std::integral_constant<int, kMax>{});
    with_tokens<kMax - 1>(n, f);
  }
}

/// One tile: rows [r, r + rows) (rows ≤ R × 16) for all n tokens, chunk by chunk of columns,
/// prefetching the next `next` rows.
template <int R, class W>
KVDECODE_TARGET_AVX512 inline void lanes_tile_avx512(float* y, const float* x, const W* w,
                                                     std::size_t n, std::size_t in, std::size_t out,
                                                     std::size_t r, std::size_t rows,
                                                     std::size_t next) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;
  constexpr std::size_t kC = kLaneChunk / static_cast<std::size_t>(R);
  alignas(64) float buf[kC * kW];             // [kc][R × 16] the chunk, transposed
  alignas(64) float acc[kMaxFewTokens * kW];  // [n][R × 16] the outputs so far
  TilePrefetch pf(w + (r + rows) * in, next * in * sizeof(W), (n + 15 / R) / (16 / R) * in);
  for (std::size_t k0 = 0; k0 < in; k0 += kC) {
    const std::size_t kc = std::min(kC, in - k0);
    pack_lanes_avx512<R>(buf, w + r * in, in, rows, k0, kc);
    for_token_groups<R>(n, [&](std::size_t j, std::size_t size) {
      with_tokens<16 / R>(size, [&](auto N) {
        lanes_block_avx512<R, decltype(N)::value>(acc + j * kW, buf, x + j * in + k0, in, kc,
                                                  k0 == 0, pf);
      });
    });
  }
  store_lanes(y, out, acc, n, kW, r, rows);
}

template <int R>
KVDECODE_TARGET_AVX512BF16 inline void lanes_tile_dpbf16(float* y, const float* x, const bf16* w,
                                                         std::size_t n, std::size_t in,
                                                         std::size_t out, std::size_t r,
                                                         std::size_t rows, std::size_t next) {
  constexpr std::size_t kW = static_cast<std::size_t>(R) * kLaneRows;
  constexpr std::size_t kC = 2 * kLaneChunk / static_cast<std::size_t>(R);  // columns (pairs: /2)
  constexpr std::size_t kXb = kC / 2;
  alignas(64) float buf[kXb * kW];                    // [kc / 2][R × 16] bf16 pairs, transposed
  alignas(64) float acc[kMaxFewTokens * kW];          // [n][R × 16] the outputs so far
  alignas(64) std::uint32_t xb[kMaxFewTokens * kXb];  // [n][kc / 2] x's bf16 pairs
  TilePrefetch pf(w + (r + rows) * in, next * in * sizeof(bf16),
                  (n + 15 / R) / (16 / R) * (in + 1) / 2);
  for (std::size_t k0 = 0; k0 < in; k0 += kC) {
    const std::size_t kc = std::min(kC, in - k0);
    pack_pairs_avx512<R>(buf, w + r * in, in, rows, k0, kc);
    pack_x_pairs(xb, kXb, x, n, in, k0, kc);
    for_token_groups<R>(n, [&](std::size_t j, std::size_t size) {
      with_tokens<16 / R>(size, [&](auto N) {
        lanes_block_dpbf16<R, decltype(N)::value>(acc + j * kW, buf, xb + j * kXb, kXb,
                                                  (kc + 1) / 2, k0 == 0, pf);
      });
    });
  }
  store_lanes(y, out, acc, n, kW, r, rows);
}

// ---------------------------------------------------------------------------------------------
// AVX-512, f32 weights, tokens in lanes: 16 rows × 16 tokens per tile, no weight transposes.
// ---------------------------------------------------------------------------------------------

static_assert(kPanelRows >= kLaneRows, "x transposed, [in][16], is kept in a thread's panel");

/// xt [in][16] = x [n][in] transposed (n ≤ 16), lanes past n zero.
KVDECODE_TARGET_AVX512 inline void transpose_tokens_avx512(float* xt, const float* x, std::size_t n,
                                                           std::size_t in) {
  for (std::size_t k = 0; k < in; k += 16) {
    __m512 v[16];
    const std::size_t cols = std::min<std::size_t>(16, in - k);
    load_transpose_16x16(v, x + k, in, n, cols);
    for (std::size_t c = 0; c < cols; ++c) _mm512_storeu_ps(xt + (k + c) * 16, v[c]);
  }
}

/// y [n][out] columns [r, r + 16) = w rows [r, r + 16) · xt [in][16]: for each k, row i's weight
/// broadcast times the column of tokens into accumulator i (one fma chain per output, k in
/// order, as lanes_block_avx512), then the 16 × 16 outputs transposed into y. The next `next`
/// rows (contiguous after these, 16 × in floats at most: in lines) are prefetched into L2 one
/// line per k, while the weights here are read once each from memory.
KVDECODE_TARGET_AVX512 inline void tokens_tile_avx512(float* y, const float* xt, const float* w,
                                                      std::size_t n, std::size_t in,
                                                      std::size_t out, std::size_t r,
                                                      std::size_t next) {
  __m512 a[16];  // a[i] lane t: output (row r + i, token t)
  KVDECODE_UNROLL
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  // Rows i and i + 8 share a pointer (the second at offset 8 × in), so the 16 rows take 9
  // registers and the loop keeps every address in one.
  const float* p[8];  // p[i] = &w[r + i][k]
  KVDECODE_UNROLL
  for (int i = 0; i < 8; ++i) p[i] = w + (r + static_cast<std::size_t>(i)) * in;
  const std::size_t half = 8 * in;
  const char* pf = reinterpret_cast<const char*>(w + (r + kLaneRows) * in);
  const char* const pf_end = pf + next * in * sizeof(float);
  const float* const xt_end = xt + in * 16;
  for (const float* xk = xt; xk != xt_end; xk += 16) {
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    const __m512 xv = _mm512_loadu_ps(xk);
    KVDECODE_UNROLL
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][0]), xv, a[i]);
      a[i + 8] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][half]), xv, a[i + 8]);
      ++p[i];
    }
  }
  transpose_16x16(a);  // a[t] lane i: output (row r + i, token t)
  for (std::size_t t = 0; t < n; ++t) _mm512_storeu_ps(y + t * out + r, a[t]);
}

// ---------------------------------------------------------------------------------------------
// AVX512_BF16, bf16 weights, tokens in lanes: the same tile on bf16 pairs.
// ---------------------------------------------------------------------------------------------

/// xtp [(in + 1) / 2][16] dwords = x [n][in] (n ≤ 16, already rounded to bf16, so exact) as
/// bf16 pairs, transposed: lane t of row k holds token t's columns 2k (low half) and 2k + 1
/// (high half); an odd last column pairs with zero, lanes past n are zero.
KVDECODE_TARGET_AVX512BF16 inline void transpose_token_pairs(std::uint32_t* xtp, const float* x,
                                                             std::size_t n, std::size_t in) {
  for (std::size_t k = 0; k < in; k += 32) {
    const std::size_t left = std::min<std::size_t>(32, in - k);
    __m512 v[16];  // v[t] dword j: token t's pair k / 2 + j
    for (std::size_t t = 0; t < 16; ++t)
      v[t] = t < n ? _mm512_castsi512_ps(load_x_pairs(x + t * in + k, left)) : _mm512_setzero_ps();
    transpose_16x16(v);  // v[j] lane t: token t's pair k / 2 + j
    for (std::size_t j = 0; 2 * j < left; ++j) _mm512_storeu_ps(xtp + (k / 2 + j) * 16, v[j]);
  }
}

/// The dword of bf16 weights p[0] (low half) and p[1] (high half), broadcast.
KVDECODE_TARGET_AVX512BF16 inline __m512bh broadcast_pair(const bf16* p) {
  std::uint32_t d;
  std::memcpy(&d, p, sizeof d);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(d));
}

/// y [n][out] columns [r, r + 16) = w rows [r, r + 16) · xtp [pairs][16]: for each pair k, row
/// i's two weights broadcast into one vdpbf16ps with the tokens' pairs into accumulator i. Each
/// output gets the same vdpbf16ps per pair, in order, as lanes_block_dpbf16 (the products are
/// exact, so which operand holds the weights does not matter): the weight-lane tiles' bits. The
/// next `next` rows are prefetched into L2, one line per pair.
KVDECODE_TARGET_AVX512BF16 inline void tokens_tile_dpbf16(float* y, const std::uint32_t* xtp,
                                                          const bf16* w, std::size_t n,
                                                          std::size_t in, std::size_t out,
                                                          std::size_t r, std::size_t next) {
  __m512 a[16];  // a[i] lane t: output (row r + i, token t)
  KVDECODE_UNROLL
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const bf16* p[8];  // p[i] = &w[r + i][2k]; row i + 8 at p[i] + half, as tokens_tile_avx512
  KVDECODE_UNROLL
  for (int i = 0; i < 8; ++i) p[i] = w + (r + static_cast<std::size_t>(i)) * in;
  const std::size_t half = 8 * in;
  const char* pf = reinterpret_cast<const char*>(w + (r + kLaneRows) * in);
  const char* const pf_end = pf + next * in * sizeof(bf16);
  const std::uint32_t* const xt_full = xtp + in / 2 * 16;
  const std::uint32_t* xk = xtp;
  for (; xk != xt_full; xk += 16) {
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    const auto xv = (__m512bh)_mm512_loadu_si512(xk);
    KVDECODE_UNROLL
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], broadcast_pair(p[i]), xv);
      a[i + 8] = _mm512_dpbf16_ps(a[i + 8], broadcast_pair(p[i] + half), xv);
      p[i] += 2;
    }
  }
  if (in % 2 != 0) {  // the last column alone, its pair's high half zero (not the next row's)
    const auto xv = (__m512bh)_mm512_loadu_si512(xk);
    KVDECODE_UNROLL
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(p[i][0].bits), xv);
      a[i + 8] = _mm512_dpbf16_ps(a[i + 8], (__m512bh)_mm512_set1_epi32(p[i][half].bits), xv);
    }
  }
  transpose_16x16(a);  // a[t] lane i: output (row r + i, token t)
  for (std::size_t t = 0; t < n; ++t) _mm512_storeu_ps(y + t * out + r, a[t]);
}

// ---------------------------------------------------------------------------------------------
// AVX2: 8 × 8 transposes, tiles of 16 rows (two ymm) against up to 6 tokens.
// ---------------------------------------------------------------------------------------------

/// Packs columns [k0, k0 + kc) of rows [0, rows) (rows ≤ 16) of f32 or bf16 weights into
/// buf [kc][16] f32 (missing rows zero).
template <class W>
KVDECODE_TARGET_AVX2 inline void pack_lanes_avx2(float* buf, const W* w, std::size_t in,
                                                 std::size_t rows, std::size_t k0, std::size_t kc) {
  constexpr std::size_t kPer = std::is_same_v<W, float> ? 8 : 16;  // columns per transpose
  for (std::size_t half = 0; half < 2; ++half) {
    const std::size_t r0 = half * 8;
    const std::size_t here = rows > r0 ? std::min<std::size_t>(8, rows - r0) : 0;
    for (std::size_t k = 0; k < kc; k += kPer) {
      const std::size_t cols = std::min(kPer, kc - k);
      const std::size_t dwords = (cols * sizeof(W) + 3) / 4;
      const __m256i m = dwords >= 8 ? _mm256_set1_epi32(-1) : tail_mask_avx2(dwords);
      __m256 v[8];
      for (std::size_t i = 0; i < 8; ++i) {
        const W* row = w + (r0 + i) * in + k0 + k;
        if (i >= here) {
          v[i] = _mm256_setzero_ps();
        } else if (dwords * 4 == cols * sizeof(W)) {
          v[i] = _mm256_maskload_ps(reinterpret_cast<const float*>(row), m);
        } else {  // an odd bf16 count: the last dword would read past the row
          alignas(32) W pad[kPer] = {};
          std::memcpy(pad, row, cols * sizeof(W));
          v[i] = _mm256_load_ps(reinterpret_cast<const float*>(pad));
        }
      }
      transpose_8x8(v);
      float* dst = buf + k * kLaneRows + r0;
      if constexpr (std::is_same_v<W, float>) {
        for (std::size_t c = 0; c < cols; ++c) _mm256_store_ps(dst + c * kLaneRows, v[c]);
      } else {
        const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
        for (std::size_t j = 0; 2 * j < cols; ++j) {
          const __m256i d = _mm256_castps_si256(v[j]);
          _mm256_store_ps(dst + 2 * j * kLaneRows, _mm256_castsi256_ps(_mm256_slli_epi32(d, 16)));
          if (2 * j + 1 < cols)
            _mm256_store_ps(dst + (2 * j + 1) * kLaneRows,
                            _mm256_castsi256_ps(_mm256_and_si256(d, hi)));
        }
      }
    }
  }
}

/// acc [N][16] (+)= buf [kc][16] columns × x [N][x_stride], one fma per k in order.
template <int N>
KVDECODE_TARGET_AVX2 inline void lanes_block_avx2(float* acc, const float* buf, const float* x,
                                                  std::size_t x_stride, std::size_t kc, bool first,
                                                  TilePrefetch& pf) {
  __m256 a0[N], a1[N];
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) {
    a0[j] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + j * kLaneRows);
    a1[j] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + j * kLaneRows + 8);
  }
  for (std::size_t k = 0; k < kc; ++k) {
    pf.step();
    const __m256 c0 = _mm256_load_ps(buf + k * kLaneRows);
    const __m256 c1 = _mm256_load_ps(buf + k * kLaneRows + 8);
    KVDECODE_UNROLL
    for (int j = 0; j < N; ++j) {
      const __m256 b = _mm256_broadcast_ss(x + static_cast<std::size_t>(j) * x_stride + k);
      a0[j] = _mm256_fmadd_ps(c0, b, a0[j]);
      a1[j] = _mm256_fmadd_ps(c1, b, a1[j]);
    }
  }
  KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) {
    _mm256_store_ps(acc + j * kLaneRows, a0[j]);
    _mm256_store_ps(acc + j * kLaneRows + 8, a1[j]);
  }
}

template <class W>
KVDECODE_TARGET_AVX2 inline void lanes_tile_avx2(float* y, const float* x, const W* w,
                                                 std::size_t n, std::size_t in, std::size_t out,
                                                 std::size_t r, std::size_t rows,
                                                 std::size_t next) {
  constexpr std::size_t kMax = 6;  // 2 × 6 accumulators + 2 columns + 1 broadcast ≤ 16 ymm
  alignas(32) float buf[kLaneChunk * kLaneRows];     // [kc][16] the chunk, transposed
  alignas(32) float acc[kMaxFewTokens * kLaneRows];  // [n][16] the outputs so far
  TilePrefetch pf(w + (r + rows) * in, next * in * sizeof(W), (n + kMax - 1) / kMax * in);
  for (std::size_t k0 = 0; k0 < in; k0 += kLaneChunk) {
    const std::size_t kc = std::min(kLaneChunk, in - k0);
    pack_lanes_avx2(buf, w + r * in, in, rows, k0, kc);
    const std::size_t groups = (n + kMax - 1) / kMax;
    for (std::size_t g = 0, j = 0; g < groups; ++g) {
      const std::size_t size = (n - j) / (groups - g);
      with_tokens<static_cast<int>(kMax)>(size, [&](auto N) {
        lanes_block_avx2<decltype(N)::value>(acc + j * kLaneRows, buf, x + j * in + k0, in, kc,
                                             k0 == 0, pf);
      });
      j += size;
    }
  }
  store_lanes(y, out, acc, n, kLaneRows, r, rows);
}

// ---------------------------------------------------------------------------------------------
// Row loops: tiles of R × 16 rows, the slice's last rows in tiles of 16.
// ---------------------------------------------------------------------------------------------

/// Rows per tile for n tokens: 4 × 16 for two or three tokens (at least 8 accumulators to hide
/// the fma latency), else 2 × 16 (up to 8 tokens a group); tile(R, r, rows, next) with the
/// rows of the tile after it, to prefetch.
template <class Tile>
inline void lanes_rows(std::size_t n, std::size_t c0, std::size_t c1, Tile&& tile) {
  const std::size_t big = (n <= 3 ? 4 : 2) * kLaneRows;
  std::size_t r = c0;
  for (; r + big <= c1; r += big) tile(big / kLaneRows, r, big, std::min(big, c1 - r - big));
  for (; r < c1; r += kLaneRows) {
    const std::size_t rows = std::min(kLaneRows, c1 - r);
    tile(1, r, rows, std::min(kLaneRows, c1 - r - rows));
  }
}

/// Runs tile(r, next) on rows [c0, c1) in whole token tiles of kLaneRows rows (next: the rows
/// of the tile after it, to prefetch); returns where the rows left over begin.
template <class Tile>
inline std::size_t whole_token_tiles(std::size_t c0, std::size_t c1, Tile&& tile) {
  const std::size_t full = c0 + (c1 - c0) / kLaneRows * kLaneRows;
  for (std::size_t r = c0; r < full; r += kLaneRows)
    tile(r, std::min(kLaneRows, c1 - r - kLaneRows));
  return full;
}

/// xt: the thread's panel, for x transposed ([in][16]; nullptr: the weight-lane tiles only).
template <class W>
KVDECODE_TARGET_AVX512 inline void gemm_lanes_avx512(float* y, const float* x, const W* w,
                                                     std::size_t n, std::size_t in, std::size_t out,
                                                     std::size_t c0, std::size_t c1, float* xt) {
  if constexpr (std::is_same_v<W, float>) {
    if (xt != nullptr && n >= kTokenLanesMin) {
      transpose_tokens_avx512(xt, x, n, in);
      c0 = whole_token_tiles(c0, c1, [&](std::size_t r, std::size_t next) {
        tokens_tile_avx512(y, xt, w, n, in, out, r, next);
      });
      if (c0 == c1) return;  // else the last rows: the weight-lane tile of 16, the same chains
    }
  }
  lanes_rows(n, c0, c1, [&](std::size_t R, std::size_t r, std::size_t rows, std::size_t next) {
    if (R == 4) return lanes_tile_avx512<4>(y, x, w, n, in, out, r, rows, next);
    if (R == 2) return lanes_tile_avx512<2>(y, x, w, n, in, out, r, rows, next);
    lanes_tile_avx512<1>(y, x, w, n, in, out, r, rows, next);
  });
}

/// xt: the thread's panel, for x's pairs transposed ([(in + 1) / 2][16] dwords; nullptr: the
/// weight-lane tiles only).
KVDECODE_TARGET_AVX512BF16 inline void gemm_lanes_dpbf16(float* y, const float* x, const bf16* w,
                                                         std::size_t n, std::size_t in,
                                                         std::size_t out, std::size_t c0,
                                                         std::size_t c1, float* xt) {
  if (xt != nullptr && n >= kTokenPairLanesMin) {
    auto* const xtp = reinterpret_cast<std::uint32_t*>(xt);
    transpose_token_pairs(xtp, x, n, in);
    c0 = whole_token_tiles(c0, c1, [&](std::size_t r, std::size_t next) {
      tokens_tile_dpbf16(y, xtp, w, n, in, out, r, next);
    });
    if (c0 == c1) return;  // else the last rows: the weight-lane tile of 16, the same sums
  }
  lanes_rows(n, c0, c1, [&](std::size_t R, std::size_t r, std::size_t rows, std::size_t next) {
    if (R == 4) return lanes_tile_dpbf16<4>(y, x, w, n, in, out, r, rows, next);
    if (R == 2) return lanes_tile_dpbf16<2>(y, x, w, n, in, out, r, rows, next);
    lanes_tile_dpbf16<1>(y, x, w, n, in, out, r, rows, next);
  });
}

template <class W>
KVDECODE_TARGET_AVX2 inline void gemm_lanes_avx2(float* y, const float* x, const W* w,
                                                 std::size_t n, std::size_t in, std::size_t out,
                                                 std::size_t c0, std::size_t c1) {
  for (std::size_t r = c0; r < c1; r += kLaneRows) {
    const std::size_t rows = std::min(kLaneRows, c1 - r);
    lanes_tile_avx2(y, x, w, n, in, out, r, rows, std::min(kLaneRows, c1 - r - rows));
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ for n ≤ kMaxFewTokens tokens, each
/// output one fma chain over k in order (the header comment), so independent of n and of the
/// other tokens. With bf16 weights x must already be rounded (round_to_bf16). panel: the
/// thread's scratch of kPanelRows × in elements (gemm_few's; with f32 weights on AVX-512 or bf16
/// weights with AVX512_BF16 it holds x transposed for the token-lane tiles) or nullptr (then the
/// weight-lane tiles only). Without a kernel for the types and set (has_gemm_lanes) it is gemm_few.
template <class T, class W>
void gemm_lanes(KernelSet ks, T* y, const T* x, const W* w, std::size_t n, std::size_t in,
                std::size_t out, std::size_t c0, std::size_t c1, T* panel) {
#if KVDECODE_X86_KERNELS
  if constexpr (has_gemm_lanes<T, W>(KernelSet::kAvx2)) {
    switch (ks) {
      case KernelSet::kAvx512Bf16:
        if constexpr (std::is_same_v<W, bf16>)
          return gemm_lanes_dpbf16(y, x, w, n, in, out, c0, c1, panel);
        else
          return gemm_lanes_avx512(y, x, w, n, in, out, c0, c1, panel);
      case KernelSet::kAvx512:
        return gemm_lanes_avx512(y, x, w, n, in, out, c0, c1, panel);
      case KernelSet::kAvx2:
        return gemm_lanes_avx2(y, x, w, n, in, out, c0, c1);
      case KernelSet::kPortable:
        break;
    }
  }
#endif
  gemm_few(ks, y, x, w, n, in, out, c0, c1, panel);
}

}  // namespace kvdecode::detail
