// Projections with block-quantized weights (Q8_0, Q4_0: weight_blocks.hpp) in the ggml manner,
// over the row-group layout of row_groups.hpp: the input x is quantized once per call to int8
// codes with an f32 scale per block of 32; each (row, block) product is an exact integer dot
// product, and a row's blocks are summed in f32 in block order, one fma each with the scale
// (weight scale × input scale). Eight rows run side by side in the lanes of one register, so a
// 32-byte load feeds all eight and no row needs a horizontal sum. One kernel serves a GEMV, a
// few-token GEMM and prefill (tiles of tokens over a group held in L1): every set and every batch
// size forms the same integers and the same f32 operations per output, so outputs agree bit for
// bit across sets, thread splits and token counts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemv.hpp"  // KVDECODE_UNROLL
#include "kvdecode/detail/row_groups.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// The input, quantized once per call.
// ---------------------------------------------------------------------------------------------

/// x [n][in] → codes [n][in], scales [n][in / 32]: per block d = max|x| / 127 (f32, not
/// ggml's binary16, which would add a rounding of its own), codes = nearest(x / d) in
/// [−127, 127], so |x − code · d| ≤ d / 2. A block holding a non-finite value gets codes 0 and
/// d = NaN, so its products are NaN as an f32 GEMV's would be. in must be a multiple of 32.
/// sums [n][in / 32]: each block's 32 codes added, which the kernels multiply by the bias of
/// the weights' unsigned form (−128 for Q8_0 stored as code + 128, −8 for Q4_0's nibbles).
inline void quantize_activations_portable(const float* x, std::size_t n, std::size_t in,
                                          std::int8_t* codes, float* scales, std::int32_t* sums) {
  for (std::size_t b = 0; b < n * (in / kWeightBlock); ++b) {
    const float* xb = x + b * kWeightBlock;
    float amax = 0;
    bool finite = true;
    for (std::size_t j = 0; j < kWeightBlock; ++j) {
      finite = finite && std::isfinite(xb[j]);
      amax = std::max(amax, std::fabs(xb[j]));
    }
    const float d = finite ? amax / 127.0f : std::nanf("");
    const float id = finite && amax > 0 ? 127.0f / amax : 0.0f;
    scales[b] = d;
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < kWeightBlock; ++j) {
      const float q = finite ? std::nearbyint(xb[j] * id) : 0.0f;
      const auto c = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
      codes[b * kWeightBlock + j] = c;
      sum += c;
    }
    sums[b] = sum;
  }
}

/// The bias of the weights' unsigned form in row_groups.hpp's layout: stored u = code − bias.
template <class B>
inline constexpr std::int32_t kCodeBias = std::is_same_v<B, Q8_0> ? -128 : -8;

// ---------------------------------------------------------------------------------------------
// Naive reference: double-precision sums of the dequantized weights (tests).
// ---------------------------------------------------------------------------------------------

/// y [rows] = dequantize(w [rows][cols / 32]) · x [cols] in double, x unquantized; w row-major
/// as ggml stores it.
template <class B>
void qgemv_naive(float* y, const B* w, const float* x, std::size_t rows, std::size_t cols) {
  const std::size_t nb = cols / kWeightBlock;
  float row[kWeightBlock];
  for (std::size_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      dequantize_row(w + r * nb + b, row, kWeightBlock);
      for (std::size_t j = 0; j < kWeightBlock; ++j)
        sum += static_cast<double>(row[j]) * static_cast<double>(x[b * kWeightBlock + j]);
    }
    y[r] = static_cast<float>(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable: one output at a time, in plain C++ (and the rows after the last whole group).
// ---------------------------------------------------------------------------------------------

/// The block's 32 weights as signed codes (q8_0 as stored, q4_0 nibble − 8).
inline void block_codes(const Q8_0& b, std::int8_t* out) {
  for (std::size_t j = 0; j < kWeightBlock; ++j) out[j] = b.qs[j];
}
inline void block_codes(const Q4_0& b, std::int8_t* out) {
  for (std::size_t j = 0; j < kWeightBlock / 2; ++j) {
    out[j] = static_cast<std::int8_t>((b.qs[j] & 15) - 8);
    out[j + 16] = static_cast<std::int8_t>((b.qs[j] >> 4) - 8);
  }
}

/// Row r of repacked w [out][nb] · one token (codes xc [nb × 32], scales xs [nb]): the exact
/// integer sum of each block, then acc = fma(sum, d_w · d_x, acc) in block order, the f32
/// operations every vector kernel performs lane by lane.
template <class B>
float qdot_row(const B* w, std::size_t out, std::size_t nb, std::size_t r, const std::int8_t* xc,
               const float* xs) {
  float acc = 0;
  std::int8_t wc[kWeightBlock];
  for (std::size_t b = 0; b < nb; ++b) {
    const B blk = repacked_block(w, out, nb, r, b);
    block_codes(blk, wc);
    std::int32_t s = 0;
    for (std::size_t j = 0; j < kWeightBlock; ++j)
      s += static_cast<std::int32_t>(wc[j]) * xc[b * kWeightBlock + j];
    const float scale = f16_to_float(blk.d) * xs[b];
    acc = std::fma(static_cast<float>(s), scale, acc);
  }
  return acc;
}

template <class B>
void qgemm_rows_portable(float* y, const B* w, const std::int8_t* xc, const float* xs,
                         std::size_t n, std::size_t in, std::size_t out, std::size_t r0,
                         std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = qdot_row(w, out, nb, r, xc + t * in, xs + t * nb);
}

/// Bytes of input codes one pass over a thread's groups takes: the tokens stay in L2 while each
/// group (at most a few tens of KiB) is read once from memory and then from L1 for every token.
inline constexpr std::size_t kTokenChunkBytes = 64 * 1024;

/// Tokens per pass: a multiple of `tile`, at least one tile.
inline std::size_t token_chunk(std::size_t in, std::size_t tile) {
  return std::max(tile, kTokenChunkBytes / in / tile * tile);
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// How far ahead of the block being multiplied the kernels prefetch a group's bytes: the
/// hardware prefetchers alone leave a one-thread decode step waiting on its weight loads.
inline constexpr std::size_t kGroupPrefetchBytes = 4096;

/// Asks for the cache lines kGroupPrefetchBytes past block blk (bytes bytes long).
KVDECODE_TARGET_AVX2 KVDECODE_PREFETCH_INLINE void prefetch_ahead(const std::uint8_t* blk,
                                                                  std::size_t bytes) {
  for (std::size_t l = 0; l < bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kGroupPrefetchBytes + l, _MM_HINT_T0);
}

/// y [g × 8 + l] = lane l of v for the lanes whose row is in [r0, r1).
KVDECODE_TARGET_AVX2 inline void store_group(float* y, __m256 v, std::size_t g, std::size_t r0,
                                             std::size_t r1) {
  const std::size_t first = g * kGroupRows;
  if (first >= r0 && first + kGroupRows <= r1) {
    _mm256_storeu_ps(y + first, v);
    return;
  }
  alignas(32) float lanes[kGroupRows];
  _mm256_store_ps(lanes, v);
  for (std::size_t l = 0; l < kGroupRows; ++l)
    if (first + l >= r0 && first + l < r1) y[first + l] = lanes[l];
}

/// The four input codes of unit u of a block, in every lane.
KVDECODE_TARGET_AVX2 inline __m256i unit_input(const std::int8_t* xb, std::size_t u) {
  std::int32_t v;
  std::memcpy(&v, xb + u * kGroupUnit, sizeof v);
  return _mm256_set1_epi32(v);
}

/// quantize_activations_portable's operations eight floats at a time (the same products,
/// roundings and clamps, so the same codes and scales): one block is four registers.
KVDECODE_TARGET_AVX2 inline void quantize_activations_avx2(const float* x, std::size_t n,
                                                           std::size_t in, std::int8_t* codes,
                                                           float* scales, std::int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (std::size_t b = 0; b < n * (in / kWeightBlock); ++b) {
    const float* xb = x + b * kWeightBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (std::size_t i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
      amax = _mm256_max_ps(amax, a);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float am = _mm_cvtss_f32(m);
    const bool ok = _mm256_movemask_ps(finite) == 0xFF;
    scales[b] = ok ? am / 127.0f : std::nanf("");
    std::int8_t* const cb = codes + b * kWeightBlock;
    if (!ok) {
      std::memset(cb, 0, kWeightBlock);
      sums[b] = 0;
      continue;
    }
    const __m256 id = _mm256_set1_ps(am > 0 ? 127.0f / am : 0.0f);
    __m256i q[4];
    for (std::size_t i = 0; i < 4; ++i) {
      const __m256 r =
          _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sums[b] = _mm_cvtsi128_si32(s4);
    // packs work within 128-bit halves: 32-bit groups come out as 0,2,4,6 | 1,3,5,7 per half.
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cb), p8);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2: maddubs + madd. Q8_0's codes are made signed again and multiplied as |w| · (x · sign w)
// (|w| ≤ 128, |x| ≤ 127: maddubs's pair sums stay below 2^15); Q4_0's nibbles (≤ 15) go in
// unsigned, all eight units summed in 16 bits (8 × 2 × 15 × 127 < 2^15) before one madd.
// ---------------------------------------------------------------------------------------------

/// acc [8 rows] of group gp over every block, for one token.
template <class B>
KVDECODE_TARGET_AVX2 inline __m256 group_token_avx2(const std::uint8_t* gp, const std::int8_t* xc,
                                                    const float* xs, const std::int32_t* xsum,
                                                    std::size_t nb) {
  using L = GroupLayout<B>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* const blk = gp + b * L::kBytes;
    const std::uint8_t* const q = blk + L::kScaleBytes;
    const std::int8_t* const xb = xc + b * kWeightBlock;
    prefetch_ahead(blk, L::kBytes);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256i s;
    if constexpr (std::is_same_v<B, Q8_0>) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < L::kUnits; u += 2) {
        const __m256i w0 = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * 32)), flip);
        const __m256i w1 = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (u + 1) * 32)), flip);
        const __m256i p0 =
            _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(unit_input(xb, u), w0));
        const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1),
                                                _mm256_sign_epi8(unit_input(xb, u + 1), w1));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, ones));
      }
      s = _mm256_add_epi32(s0, s1);
      static_cast<void>(xsum);
    } else {
      const __m256i low = _mm256_set1_epi8(15);
      __m256i p = _mm256_setzero_si256();
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < L::kUnits; ++u) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * 32));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(_mm256_and_si256(v, low), unit_input(xb, u)));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                     unit_input(xb, u + L::kUnits)));
      }
      s = _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_set1_epi32(kCodeBias<B> * xsum[b]));
    }
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
  }
  return acc;
}

template <class B>
KVDECODE_TARGET_AVX2 inline void qgemm_rows_avx2(float* y, const B* w, const std::int8_t* xc,
                                                 const float* xs, const std::int32_t* xsum,
                                                 std::size_t n, std::size_t in, std::size_t out,
                                                 std::size_t r0, std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  const std::size_t groups = whole_groups(out);
  const std::size_t g1 = std::min(groups, (r1 + kGroupRows - 1) / kGroupRows);
  const std::size_t chunk = token_chunk(in, 1);
  for (std::size_t t0 = 0; t0 < n; t0 += chunk) {
    const std::size_t t1 = std::min(n, t0 + chunk);
    for (std::size_t g = r0 / kGroupRows; g < g1; ++g) {
      const std::uint8_t* const gp = group_block(w, nb, g, 0);
      for (std::size_t t = t0; t < t1; ++t)
        store_group(y + t * out,
                    group_token_avx2<B>(gp, xc + t * in, xs + t * nb, xsum + t * nb, nb), g, r0,
                    r1);
    }
  }
  for (std::size_t r = std::max(r0, groups * kGroupRows); r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = qdot_row(w, out, nb, r, xc + t * in, xs + t * nb);
}

// ---------------------------------------------------------------------------------------------
// AVX512_VNNI (the avx512bf16 set): vpdpbusd on 256-bit registers takes the stored unsigned
// codes straight (Q8_0 code + 128, Q4_0 nibbles) against the signed input, each lane starting
// at bias × the input's block sum, so it holds the signed block product exactly. A tile of T
// tokens shares each load of the group's codes.
// ---------------------------------------------------------------------------------------------

/// acc [T][8 rows] of group gp over every block, for tokens t.. t + T − 1 (codes xc [T][in]).
template <class B, std::size_t T>
KVDECODE_TARGET_AVX512BF16 inline void group_tile_vnni(__m256 (&acc)[T], const std::uint8_t* gp,
                                                       const std::int8_t* xc, const float* xs,
                                                       const std::int32_t* xsum, std::size_t in,
                                                       std::size_t nb) {
  using L = GroupLayout<B>;
  KVDECODE_UNROLL
  for (std::size_t j = 0; j < T; ++j) acc[j] = _mm256_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* const blk = gp + b * L::kBytes;
    const std::uint8_t* const q = blk + L::kScaleBytes;
    prefetch_ahead(blk, L::kBytes);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256i wv[8];  // unit u pairs with input unit u
    if constexpr (std::is_same_v<B, Q8_0>) {
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 8; ++u)
        wv[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * 32));
    } else {
      const __m256i low = _mm256_set1_epi8(15);
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 4; ++u) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + u * 32));
        wv[u] = _mm256_and_si256(v, low);
        wv[u + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    }
    KVDECODE_UNROLL
    for (std::size_t j = 0; j < T; ++j) {
      const std::int8_t* const xb = xc + j * in + b * kWeightBlock;
      __m256i s0 = _mm256_set1_epi32(kCodeBias<B> * xsum[j * nb + b]);
      __m256i s1 = _mm256_setzero_si256();
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 8; u += 2) {
        s0 = _mm256_dpbusd_epi32(s0, wv[u], unit_input(xb, u));
        s1 = _mm256_dpbusd_epi32(s1, wv[u + 1], unit_input(xb, u + 1));
      }
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs[j * nb + b]));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), scale, acc[j]);
    }
  }
}

/// Tokens a VNNI tile takes at once.
inline constexpr std::size_t kTileTokens = 4;

template <class B, std::size_t T>
KVDECODE_TARGET_AVX512BF16 inline void group_tokens_vnni(float* y, const std::uint8_t* gp,
                                                         const std::int8_t* xc, const float* xs,
                                                         const std::int32_t* xsum, std::size_t in,
                                                         std::size_t out, std::size_t t,
                                                         std::size_t g, std::size_t r0,
                                                         std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  __m256 acc[T];
  group_tile_vnni<B, T>(acc, gp, xc + t * in, xs + t * nb, xsum + t * nb, in, nb);
  KVDECODE_UNROLL
  for (std::size_t j = 0; j < T; ++j) store_group(y + (t + j) * out, acc[j], g, r0, r1);
}

// The same products two groups (16 rows) at a time in 512-bit registers: group g's eight lanes
// in the low half, group g + 1's in the high half, the input units broadcast to all sixteen.
// vpdpbusd on zmm does as many products per cycle as two on ymm, but leaves the second vector
// port to the conversions, scalings and fmas around it, which bound the 256-bit tiles in
// prefill.

/// 32 bytes of group g (lo) and the same 32 bytes of group g + 1 (hi) as one register.
KVDECODE_TARGET_AVX512BF16 inline __m512i pair_load(const std::uint8_t* lo,
                                                    const std::uint8_t* hi) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

/// acc [T][16 rows] of groups g0 (lanes 0..7) and g1 (lanes 8..15) over every block, for tokens
/// t.. t + T − 1 (codes xc [T][in]).
template <class B, std::size_t T>
KVDECODE_TARGET_AVX512BF16 inline void pair_tile_vnni(__m512 (&acc)[T], const std::uint8_t* g0,
                                                      const std::uint8_t* g1, const std::int8_t* xc,
                                                      const float* xs, const std::int32_t* xsum,
                                                      std::size_t in, std::size_t nb) {
  using L = GroupLayout<B>;
  KVDECODE_UNROLL
  for (std::size_t j = 0; j < T; ++j) acc[j] = _mm512_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b) {
    const std::uint8_t* const b0 = g0 + b * L::kBytes;
    const std::uint8_t* const b1 = g1 + b * L::kBytes;
    prefetch_ahead(b0, L::kBytes);
    prefetch_ahead(b1, L::kBytes);
    const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1)), 1));
    const std::uint8_t* const q0 = b0 + L::kScaleBytes;
    const std::uint8_t* const q1 = b1 + L::kScaleBytes;
    __m512i wv[8];  // unit u pairs with input unit u
    if constexpr (std::is_same_v<B, Q8_0>) {
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 8; ++u) wv[u] = pair_load(q0 + u * 32, q1 + u * 32);
    } else {
      const __m512i low = _mm512_set1_epi8(15);
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 4; ++u) {
        const __m512i v = pair_load(q0 + u * 32, q1 + u * 32);
        wv[u] = _mm512_and_si512(v, low);
        wv[u + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    KVDECODE_UNROLL
    for (std::size_t j = 0; j < T; ++j) {
      const std::int8_t* const xb = xc + j * in + b * kWeightBlock;
      __m512i s0 = _mm512_set1_epi32(kCodeBias<B> * xsum[j * nb + b]);
      __m512i s1 = _mm512_setzero_si512();
      KVDECODE_UNROLL
      for (std::size_t u = 0; u < 8; u += 2) {
        std::int32_t x0, x1;
        std::memcpy(&x0, xb + u * kGroupUnit, sizeof x0);
        std::memcpy(&x1, xb + (u + 1) * kGroupUnit, sizeof x1);
        s0 = _mm512_dpbusd_epi32(s0, wv[u], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, wv[u + 1], _mm512_set1_epi32(x1));
      }
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xs[j * nb + b]));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[j]);
    }
  }
}

template <class B, std::size_t T>
KVDECODE_TARGET_AVX512BF16 inline void pair_tokens_vnni(
    float* y, const std::uint8_t* g0, const std::uint8_t* g1, const std::int8_t* xc,
    const float* xs, const std::int32_t* xsum, std::size_t in, std::size_t out, std::size_t t,
    std::size_t g, std::size_t r0, std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  __m512 acc[T];
  pair_tile_vnni<B, T>(acc, g0, g1, xc + t * in, xs + t * nb, xsum + t * nb, in, nb);
  KVDECODE_UNROLL
  for (std::size_t j = 0; j < T; ++j) {
    store_group(y + (t + j) * out, _mm512_castps512_ps256(acc[j]), g, r0, r1);
    store_group(y + (t + j) * out,
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)), g + 1, r0,
                r1);
  }
}

/// Tokens a 512-bit tile takes at once: eight accumulators beside the eight weight registers.
inline constexpr std::size_t kPairTileTokens = 8;

template <class B>
KVDECODE_TARGET_AVX512BF16 inline void qgemm_rows_vnni(float* y, const B* w, const std::int8_t* xc,
                                                       const float* xs, const std::int32_t* xsum,
                                                       std::size_t n, std::size_t in,
                                                       std::size_t out, std::size_t r0,
                                                       std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  const std::size_t groups = whole_groups(out);
  const std::size_t g1 = std::min(groups, (r1 + kGroupRows - 1) / kGroupRows);
  const std::size_t chunk = token_chunk(in, kPairTileTokens);
  for (std::size_t t0 = 0; t0 < n; t0 += chunk) {
    const std::size_t t1 = std::min(n, t0 + chunk);
    std::size_t g = r0 / kGroupRows;
    for (; g + 2 <= g1; g += 2) {
      const std::uint8_t* const p0 = group_block(w, nb, g, 0);
      const std::uint8_t* const p1 = group_block(w, nb, g + 1, 0);
      std::size_t t = t0;
      for (; t + kPairTileTokens <= t1; t += kPairTileTokens)
        pair_tokens_vnni<B, kPairTileTokens>(y, p0, p1, xc, xs, xsum, in, out, t, g, r0, r1);
      for (; t + 4 <= t1; t += 4)
        pair_tokens_vnni<B, 4>(y, p0, p1, xc, xs, xsum, in, out, t, g, r0, r1);
      for (; t + 2 <= t1; t += 2)
        pair_tokens_vnni<B, 2>(y, p0, p1, xc, xs, xsum, in, out, t, g, r0, r1);
      for (; t < t1; ++t) pair_tokens_vnni<B, 1>(y, p0, p1, xc, xs, xsum, in, out, t, g, r0, r1);
    }
    for (; g < g1; ++g) {
      const std::uint8_t* const gp = group_block(w, nb, g, 0);
      std::size_t t = t0;
      for (; t + kTileTokens <= t1; t += kTileTokens)
        group_tokens_vnni<B, kTileTokens>(y, gp, xc, xs, xsum, in, out, t, g, r0, r1);
      for (; t + 2 <= t1; t += 2)
        group_tokens_vnni<B, 2>(y, gp, xc, xs, xsum, in, out, t, g, r0, r1);
      for (; t < t1; ++t) group_tokens_vnni<B, 1>(y, gp, xc, xs, xsum, in, out, t, g, r0, r1);
    }
  }
  for (std::size_t r = std::max(r0, groups * kGroupRows); r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = qdot_row(w, out, nb, r, xc + t * in, xs + t * nb);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

// ---------------------------------------------------------------------------------------------
// Dispatch: one switch per call, outside every loop. `ks` must be a set the CPU supports.
// ---------------------------------------------------------------------------------------------

/// x [n][in] quantized by the set's quantize_activations (every set gives the same codes,
/// scales and sums).
inline void quantize_activations(KernelSet ks, const float* x, std::size_t n, std::size_t in,
                                 std::int8_t* codes, float* scales, std::int32_t* sums) {
#if KVDECODE_X86_KERNELS
  if (ks != KernelSet::kPortable) return quantize_activations_avx2(x, n, in, codes, scales, sums);
#endif
  static_cast<void>(ks);
  quantize_activations_portable(x, n, in, codes, scales, sums);
}

/// y [n][out] rows [r0, r1) = w [out][in / 32] · x for each of n tokens; w in row_groups.hpp's
/// layout (repack_row_groups), x given quantized by quantize_activations (codes [n][in], scales
/// [n][in / 32], block sums [n][in / 32]). Any row range works; ranges on group boundaries
/// (multiples of 8) read each group once. A (row, token) output depends on neither the range,
/// n, nor the set: threads, batches and prefill get the single-token result bit for bit. The
/// avx512 set runs the AVX2 kernel (a group's unit fills a 256-bit register; the loop is bound by
/// memory, not by vector width).
template <class B>
void qgemm_rows(KernelSet ks, float* y, const B* w, const std::int8_t* xc, const float* xs,
                const std::int32_t* xsum, std::size_t n, std::size_t in, std::size_t out,
                std::size_t r0, std::size_t r1) {
#if KVDECODE_X86_KERNELS
  switch (ks) {
    case KernelSet::kAvx512Bf16:
      return qgemm_rows_vnni(y, w, xc, xs, xsum, n, in, out, r0, r1);
    case KernelSet::kAvx512:
    case KernelSet::kAvx2:
      return qgemm_rows_avx2(y, w, xc, xs, xsum, n, in, out, r0, r1);
    case KernelSet::kPortable:
      break;
  }
#endif
  static_cast<void>(ks);
  static_cast<void>(xsum);
  qgemm_rows_portable(y, w, xc, xs, n, in, out, r0, r1);
}

}  // namespace kvdecode::detail
