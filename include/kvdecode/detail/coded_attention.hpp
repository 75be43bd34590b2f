// Attention's two products for one query (its heads that share a kv head, for f32 rows)
// against one block of rows read in place, in the
// run-time kernel sets of cpu.hpp: f32 rows (a decode step over a store of floats), and the
// quantized stores' codes. The codes are multiplied in registers, the scales folded in after
// the sum, so no row is dequantized into memory: in the avx512 set widened to f32 against the
// f32 query (or probabilities); in the avx512bf16 set in integer dot products (vpdpbusd)
// against the query and the weights rounded once per call (the VNNI sections below):
//   int8     s[r] = (kstep[r] · (q · code[r]) + kmin[r] · Σq) · scale
//   low-bit  s[r] = (qm + qs · code[r]) · scale
//            with qs = q ⊙ kstep, qm = q · kmin (the group's per-channel key range)
//   both     o += Σ_r (p[r] · vstep[r]) code[r], and for the values' per-row minimum
//            o += Σ_r p[r] · vmin[r] on every channel.
//   f32      s[r] = (q · k[r]) · scale, and o += Σ_r p[r] · v[r] in one multiply-add chain per
//            channel in row order, so the sum over a tile does not depend on how its rows are
//            split into blocks (a paged table gives a contiguous store's bits).
// The portable functions are the reference the tests check the AVX-512 ones against.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/f16.hpp"
#include "kvdecode/detail/gemv.hpp"  // KVDECODE_UNROLL
#include "kvdecode/detail/prefetch.hpp"
#include "kvdecode/detail/transpose.hpp"

namespace kvdecode::detail {

/// Code of channel c of a low-bit row: bits·(c mod 8/bits) of byte c / (8/bits).
inline unsigned low_bit_code(const std::uint8_t* row, std::size_t c, unsigned bits) {
  const std::size_t per_byte = 8 / bits;
  return (row[c / per_byte] >> (bits * (c % per_byte))) & ((1u << bits) - 1u);
}

// ---------------------------------------------------------------------------------------------
// Portable: plain loops, sums in index order.
// ---------------------------------------------------------------------------------------------

/// s [rows] = (kstep [r] · (q [hs] · codes [r][hs]) + kmin [r] · qsum) · scale (ranges f16),
/// qsum = Σ q.
inline void coded_scores_int8_portable(float* s, const float* q, float qsum,
                                       const std::uint8_t* codes, const std::uint16_t* kmin,
                                       const std::uint16_t* kstep, std::size_t rows, std::size_t hs,
                                       float scale) {
  for (std::size_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (std::size_t c = 0; c < hs; ++c) acc += q[c] * static_cast<float>(codes[r * hs + c]);
    s[r] = (f16_to_float(kstep[r]) * acc + f16_to_float(kmin[r]) * qsum) * scale;
  }
}

/// qs [hs] = q ⊙ kstep and returns q · kmin: the query folded with a group's key ranges (f16).
inline float low_bit_query_portable(float* qs, const float* q, const std::uint16_t* kmin,
                                    const std::uint16_t* kstep, std::size_t hs) {
  float qm = 0.0f;
  for (std::size_t c = 0; c < hs; ++c) {
    qs[c] = q[c] * f16_to_float(kstep[c]);
    qm += q[c] * f16_to_float(kmin[c]);
  }
  return qm;
}

/// s [rows] = (qm + qs [hs] · codes [rows][hs · bits / 8]) · scale.
inline void coded_scores_low_bit_portable(float* s, const float* qs, float qm,
                                          const std::uint8_t* codes, unsigned bits,
                                          std::size_t rows, std::size_t hs, float scale) {
  const std::size_t row_bytes = hs * bits / 8;
  for (std::size_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (std::size_t c = 0; c < hs; ++c)
      acc += qs[c] * static_cast<float>(low_bit_code(codes + r * row_bytes, c, bits));
    s[r] = (qm + acc) * scale;
  }
}

/// o [hs] += Σ_r p [r] · (vmin [r] + vstep [r] · codes [r][hs · bits / 8]) (ranges f16).
inline void coded_pv_low_bit_portable(float* o, const float* p, const std::uint8_t* codes,
                                      unsigned bits, const std::uint16_t* vmin,
                                      const std::uint16_t* vstep, std::size_t rows,
                                      std::size_t hs) {
  const std::size_t row_bytes = hs * bits / 8;
  float bias = 0.0f;
  for (std::size_t r = 0; r < rows; ++r) {
    const float w = p[r] * f16_to_float(vstep[r]);
    bias += p[r] * f16_to_float(vmin[r]);
    for (std::size_t c = 0; c < hs; ++c)
      o[c] += w * static_cast<float>(low_bit_code(codes + r * row_bytes, c, bits));
  }
  for (std::size_t c = 0; c < hs; ++c) o[c] += bias;
}

/// s [rows] = q [hs] · keys [rows][stride] (first hs of each row) · scale.
inline void f32_row_scores_portable(float* s, const float* q, const float* keys, std::size_t stride,
                                    std::size_t rows, std::size_t hs, float scale) {
  for (std::size_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (std::size_t c = 0; c < hs; ++c) acc += q[c] * keys[r * stride + c];
    s[r] = acc * scale;
  }
}

/// o [hs] += Σ_r p [r] · values [r][stride] (first hs of each row), rows in order.
inline void f32_row_pv_portable(float* o, const float* p, const float* values, std::size_t stride,
                                std::size_t rows, std::size_t hs) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < hs; ++c) o[c] += p[r] * values[r * stride + c];
}

// Sizes of the VNNI kernels below, which every set's callers size their scratch and choose by.

/// Largest head size whose Σ i · code stays in int32 in int8_scores_vnni: hs · (128 · 255 ·
/// 128 + 127 · 255) < 2^31.
inline constexpr std::size_t kMaxVnniInt8HeadSize = 256;

/// Floats of int8_query_vnni's layout for head size hs.
constexpr std::size_t int8_query_floats(std::size_t hs) { return 16 + (hs + 63) / 64 * 32; }

/// Most rows the VNNI p·v takes in one call.
inline constexpr std::size_t kMaxVnniRows = 256;

/// Query heads the heads' p·v kernels (heads_pv_vnni) sum in one pass over the rows: 4
/// accumulators a head beside 4 registers of interleaved codes.
inline constexpr std::size_t kVnniPvHeadsAtOnce = 3;

/// Floats of scratch the p·v kernels take for a tile of `rows` rows (the one-head kernels' weights
/// or the heads' kernels' 16-bit weights of kVnniPvHeadsAtOnce heads).
constexpr std::size_t coded_pv_scratch_floats(std::size_t rows) {
  const std::size_t padded = (rows + 15) / 16 * 16;
  return std::max(padded, kVnniPvHeadsAtOnce * padded / 2);
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// ---------------------------------------------------------------------------------------------
// AVX-512: scores sum each row into a vector of 16 partial sums, and 16 rows' vectors are
// reduced together into one vector of 16 scores; p·v keeps 4 rows' accumulators apart so the
// multiply-adds do not wait on each other.
// ---------------------------------------------------------------------------------------------

/// How far ahead of the row being read its codes are requested: the blocks of one (layer, kv
/// head) lie one after another, so this runs into the next block while the current one is
/// computed (a prefetch past the buffer's end is harmless).
inline constexpr std::size_t kPrefetchBytes = 2048;

/// Lanes [0, count) of a 16-lane mask (count ≥ 16 gives all of them).
KVDECODE_TARGET_AVX512 inline __mmask16 coded_mask16(std::size_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

/// Lane i of the result = the sum of the 16 lanes of a[i].
KVDECODE_TARGET_AVX512 inline __m512 reduce16_avx512(__m512* a) {
  __m512 t[8];
  KVDECODE_UNROLL
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a, b, a, b) partial sums of rows 2i, 2i+1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 u[4];
  KVDECODE_UNROLL
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i .. 4i+3
    const __m512d lo = _mm512_castps_pd(t[2 * i]), hi = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Sum the four 128-bit lanes of each u[i] into 128-bit lane i of the result.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),   // lanes 0,2 | 0,2
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));  // lanes 1,3 | 1,3
  const __m512 w23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/// 16 channels' 8-bit codes (fewer under mask m) widened to f32.
KVDECODE_TARGET_AVX512 inline __m512 widen_int8_avx512(const std::uint8_t* codes, __mmask16 m) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(m == 0xFFFF ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))
                                       : _mm_maskz_loadu_epi8(m, codes)));
}

/// A row's 8-bit codes · q [hs], as 16 partial sums.
struct Int8RowDot {
  const float* q;
  const std::uint8_t* codes;
  std::size_t hs;
  KVDECODE_TARGET_AVX512 __m512 operator()(std::size_t r) const {
    const std::uint8_t* row = codes + r * hs;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    __m512 a = _mm512_setzero_ps();
    std::size_t c = 0;
    for (; c + 16 <= hs; c += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)))),
                          a);
    if (c < hs) {
      const __mmask16 m = coded_mask16(hs - c);
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c), widen_int8_avx512(row + c, m), a);
    }
    return a;
  }
};

/// 16 f16 values (fewer under mask m) to f32.
KVDECODE_TARGET_AVX512 inline __m512 load_f16_avx512(const std::uint16_t* x, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x));
}

/// s [rows] = scale · (bias + Σ of dot(r)'s lanes), or with per-row f16 ranges (row_step and
/// row_min not null) scale · (row_step[r] · (bias + Σ of dot(r)'s lanes) + row_min[r] · qsum).
template <class RowDot>
KVDECODE_TARGET_AVX512 inline void coded_scores_avx512(float* s, float bias,
                                                       const std::uint16_t* row_min,
                                                       const std::uint16_t* row_step, float qsum,
                                                       std::size_t rows, float scale, RowDot dot) {
  const __m512 vs = _mm512_set1_ps(scale), vb = _mm512_set1_ps(bias);
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    __m512 acc[16];
    if (count == 16) {
      KVDECODE_UNROLL
      for (std::size_t i = 0; i < 16; ++i) acc[i] = dot(r0 + i);
    } else {
      for (std::size_t i = 0; i < 16; ++i) acc[i] = i < count ? dot(r0 + i) : _mm512_setzero_ps();
    }
    const __mmask16 m = coded_mask16(count);
    __m512 sum = _mm512_add_ps(reduce16_avx512(acc), vb);
    if (row_step != nullptr)
      sum = _mm512_fmadd_ps(sum, load_f16_avx512(row_step + r0, m),
                            _mm512_mul_ps(_mm512_set1_ps(qsum), load_f16_avx512(row_min + r0, m)));
    _mm512_mask_storeu_ps(s + r0, m, _mm512_mul_ps(sum, vs));
  }
}

/// o [hs] channels [d0, d0 + 16·J) += bias + Σ_r w[r] · widen(row r): 4 rows' sums apart,
/// added at the end.
template <int J, class Code, std::size_t kCodesPerByte, class Widen>
KVDECODE_TARGET_AVX512 inline void coded_pv_chunk_avx512(float* o, const float* w,
                                                         const Code* codes, std::size_t rows,
                                                         std::size_t hs, std::size_t d0, float bias,
                                                         Widen widen) {
  const std::size_t row_len = hs / kCodesPerByte;
  __mmask16 m[J];
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) m[j] = coded_mask16(hs - d0 - 16 * static_cast<std::size_t>(j));
  __m512 acc[4][J];
  KVDECODE_UNROLL
  for (int u = 0; u < 4; ++u) KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) acc[u][j] = _mm512_setzero_ps();
  const Code* base = codes + d0 / kCodesPerByte;
  std::size_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    KVDECODE_UNROLL
    for (int u = 0; u < 4; ++u) {
      const __m512 wb = _mm512_set1_ps(w[r + static_cast<std::size_t>(u)]);
      const Code* row = base + (r + static_cast<std::size_t>(u)) * row_len;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      KVDECODE_UNROLL
      for (int j = 0; j < J; ++j)
        acc[u][j] = _mm512_fmadd_ps(wb,
                                    widen(row + 16 * static_cast<std::size_t>(j) / kCodesPerByte,
                                          j + 1 < J ? static_cast<__mmask16>(0xFFFF) : m[j]),
                                    acc[u][j]);
    }
  }
  for (; r < rows; ++r) {
    const __m512 wb = _mm512_set1_ps(w[r]);
    const Code* row = base + r * row_len;
    KVDECODE_UNROLL
    for (int j = 0; j < J; ++j)
      acc[0][j] = _mm512_fmadd_ps(wb,
                                  widen(row + 16 * static_cast<std::size_t>(j) / kCodesPerByte,
                                        j + 1 < J ? static_cast<__mmask16>(0xFFFF) : m[j]),
                                  acc[0][j]);
  }
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) {
    float* out = o + d0 + 16 * static_cast<std::size_t>(j);
    const __m512 sum =
        _mm512_add_ps(_mm512_add_ps(acc[0][j], acc[1][j]), _mm512_add_ps(acc[2][j], acc[3][j]));
    _mm512_mask_storeu_ps(
        out, m[j],
        _mm512_add_ps(_mm512_maskz_loadu_ps(m[j], out), _mm512_add_ps(sum, _mm512_set1_ps(bias))));
  }
}

/// o [hs] += bias + Σ_r w[r] · widen(row r).
template <class Code, std::size_t kCodesPerByte, class Widen>
KVDECODE_TARGET_AVX512 inline void coded_pv_avx512(float* o, const float* w, const Code* codes,
                                                   std::size_t rows, std::size_t hs, float bias,
                                                   Widen widen) {
  for (std::size_t d0 = 0; d0 < hs; d0 += 64) {
    const std::size_t left = hs - d0;
    if (left > 48) {
      coded_pv_chunk_avx512<4, Code, kCodesPerByte>(o, w, codes, rows, hs, d0, bias, widen);
    } else if (left > 32) {
      coded_pv_chunk_avx512<3, Code, kCodesPerByte>(o, w, codes, rows, hs, d0, bias, widen);
    } else if (left > 16) {
      coded_pv_chunk_avx512<2, Code, kCodesPerByte>(o, w, codes, rows, hs, d0, bias, widen);
    } else {
      coded_pv_chunk_avx512<1, Code, kCodesPerByte>(o, w, codes, rows, hs, d0, bias, widen);
    }
  }
}

struct WidenInt8Avx512 {
  KVDECODE_TARGET_AVX512 __m512 operator()(const std::uint8_t* p, __mmask16 m) const {
    return widen_int8_avx512(p, m);
  }
};

// 4-bit rows in halves: 16 bytes widened to 16 dword lanes hold 32 channels, the low nibbles
// the even channels and the high nibbles the odd ones. The query is laid out the same way once
// per group, and p·v sums even and odd channels apart and interleaves them once per block.

/// Dword lanes of 16 code bytes (fewer under byte mask m, the rest 0).
KVDECODE_TARGET_AVX512 inline __m512i q4_bytes_avx512(const std::uint8_t* codes, __mmask16 m) {
  return _mm512_cvtepu8_epi32(m == 0xFFFF ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))
                                          : _mm_maskz_loadu_epi8(m, codes));
}
KVDECODE_TARGET_AVX512 inline __m512 q4_even_avx512(__m512i b) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
}
KVDECODE_TARGET_AVX512 inline __m512 q4_odd_avx512(__m512i b) {
  return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
/// The byte mask of the codes of channels [c, c + 32) of a row of hs channels.
inline __mmask16 q4_byte_mask(std::size_t hs, std::size_t c) {
  const std::size_t bytes = hs - c >= 32 ? 16 : (hs - c) / 2;
  return static_cast<__mmask16>((1u << bytes) - 1u);
}

/// A row's 4-bit codes · qs in halves [round_up(hs, 32)], as 16 partial sums.
struct Q4RowDot {
  const float* qs;
  const std::uint8_t* codes;
  std::size_t hs;
  KVDECODE_TARGET_AVX512 __m512 operator()(std::size_t r) const {
    const std::uint8_t* row = codes + r * (hs / 2);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    __m512 a = _mm512_setzero_ps();
    std::size_t c = 0;
    for (; c + 32 <= hs; c += 32) {
      const __m512i b = q4_bytes_avx512(row + c / 2, 0xFFFF);
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + c), q4_even_avx512(b), a);
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + c + 16), q4_odd_avx512(b), a);
    }
    if (c < hs) {
      const __m512i b = q4_bytes_avx512(row + c / 2, q4_byte_mask(hs, c));
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + c), q4_even_avx512(b), a);
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + c + 16), q4_odd_avx512(b), a);
    }
    return a;
  }
};

/// even, odd [J] += w · one row's codes of 32·J channels (byte masks bm [J]).
template <int J>
KVDECODE_TARGET_AVX512 inline void q4_pv_row(__m512* even, __m512* odd, float w,
                                             const std::uint8_t* row, const __mmask16* bm) {
  const __m512 wb = _mm512_set1_ps(w);
  _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) {
    // Only the last chunk can be partial: the others load without a mask.
    const __m512i b = q4_bytes_avx512(row + 16 * static_cast<std::size_t>(j),
                                      j + 1 < J ? static_cast<__mmask16>(0xFFFF) : bm[j]);
    even[j] = _mm512_fmadd_ps(wb, q4_even_avx512(b), even[j]);
    odd[j] = _mm512_fmadd_ps(wb, q4_odd_avx512(b), odd[j]);
  }
}

/// o [hs] channels [d0, d0 + 32·J) += bias + Σ_r w[r] · codes of row r, 4 rows' sums apart.
template <int J>
KVDECODE_TARGET_AVX512 inline void q4_pv_chunk_avx512(float* o, const float* w,
                                                      const std::uint8_t* codes, std::size_t rows,
                                                      std::size_t hs, std::size_t d0, float bias) {
  const std::size_t row_len = hs / 2;
  __mmask16 bm[J];
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) bm[j] = q4_byte_mask(hs, d0 + 32 * static_cast<std::size_t>(j));
  __m512 even[4][J], odd[4][J];
  KVDECODE_UNROLL
  for (int u = 0; u < 4; ++u) KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) even[u][j] = odd[u][j] = _mm512_setzero_ps();
  const std::uint8_t* base = codes + d0 / 2;
  std::size_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    KVDECODE_UNROLL
    for (int u = 0; u < 4; ++u)
      q4_pv_row<J>(even[u], odd[u], w[r + static_cast<std::size_t>(u)],
                   base + (r + static_cast<std::size_t>(u)) * row_len, bm);
  }
  for (; r < rows; ++r) q4_pv_row<J>(even[0], odd[0], w[r], base + r * row_len, bm);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) {
    const __m512 e =
        _mm512_add_ps(_mm512_add_ps(even[0][j], even[1][j]), _mm512_add_ps(even[2][j], even[3][j]));
    const __m512 d =
        _mm512_add_ps(_mm512_add_ps(odd[0][j], odd[1][j]), _mm512_add_ps(odd[2][j], odd[3][j]));
    const std::size_t c = d0 + 32 * static_cast<std::size_t>(j);
    const __mmask16 m0 = coded_mask16(hs - c), m1 = coded_mask16(hs - c > 16 ? hs - c - 16 : 0);
    float* out = o + c;
    const __m512 b = _mm512_set1_ps(bias);
    _mm512_mask_storeu_ps(out, m0,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(m0, out),
                                        _mm512_add_ps(_mm512_permutex2var_ps(e, lo, d), b)));
    _mm512_mask_storeu_ps(out + 16, m1,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(m1, out + 16),
                                        _mm512_add_ps(_mm512_permutex2var_ps(e, hi, d), b)));
  }
}

/// o [hs] += bias + Σ_r w[r] · codes of row r.
KVDECODE_TARGET_AVX512 inline void q4_pv_avx512(float* o, const float* w, const std::uint8_t* codes,
                                                std::size_t rows, std::size_t hs, float bias) {
  for (std::size_t d0 = 0; d0 < hs; d0 += 64) {
    if (hs - d0 > 32) {
      q4_pv_chunk_avx512<2>(o, w, codes, rows, hs, d0, bias);
    } else {
      q4_pv_chunk_avx512<1>(o, w, codes, rows, hs, d0, bias);
    }
  }
}

/// qs [round_up(hs, 32)] = q ⊙ kstep in 4-bit halves (per 32 channels: the 16 even ones, then
/// the 16 odd ones, past hs 0), returns q · kmin (ranges f16).
KVDECODE_TARGET_AVX512 inline float q4_query_avx512(float* qs, const float* q,
                                                    const std::uint16_t* kmin,
                                                    const std::uint16_t* kstep, std::size_t hs) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 qm = _mm512_setzero_ps();
  for (std::size_t c = 0; c < hs; c += 32) {
    const __mmask16 m0 = coded_mask16(hs - c), m1 = coded_mask16(hs - c > 16 ? hs - c - 16 : 0);
    const __m512 q0 = _mm512_maskz_loadu_ps(m0, q + c), q1 = _mm512_maskz_loadu_ps(m1, q + c + 16);
    qm = _mm512_fmadd_ps(q0, load_f16_avx512(kmin + c, m0), qm);
    qm = _mm512_fmadd_ps(q1, load_f16_avx512(kmin + c + 16, m1), qm);
    const __m512 p0 = _mm512_maskz_mul_ps(m0, q0, load_f16_avx512(kstep + c, m0));
    const __m512 p1 = _mm512_maskz_mul_ps(m1, q1, load_f16_avx512(kstep + c + 16, m1));
    _mm512_storeu_ps(qs + c, _mm512_permutex2var_ps(p0, even, p1));
    _mm512_storeu_ps(qs + c + 16, _mm512_permutex2var_ps(p0, odd, p1));
  }
  return _mm512_reduce_add_ps(qm);
}

/// Notes x in the running max |x| of its lanes, and its NaN lanes apart (max_ps passes over a
/// NaN).
KVDECODE_TARGET_AVX512 inline void track_abs_max(__m512 x, __m512& amax, __mmask16& nan) {
  nan = static_cast<__mmask16>(nan | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q));
  amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
}

/// How values of largest magnitude top = max|x| (track_abs_max's lanes) round to integers in
/// [-levels, levels]: x · inv, then times d. A top below 2^-100 (where levels / top could
/// overflow) counts as 0: inv = 0, d = 0; an infinite top gives inv = 0 and d = inf, a NaN one
/// d = NaN, so the products with d are non-finite as the f32 kernels' would be.
struct RoundingScale {
  float inv, d;
};
KVDECODE_TARGET_AVX512 inline RoundingScale rounding_scale(__m512 amax, __mmask16 nan,
                                                           float levels) {
  float top = _mm512_reduce_max_ps(amax);
  if (nan != 0) top = std::numeric_limits<float>::quiet_NaN();
  const bool zero = !(top >= 0x1p-100f);  // (false for NaN)
  return {zero || std::isinf(top) ? 0.0f : levels / top,
          zero && !std::isnan(top) ? 0.0f : top / levels};
}

// Steps of summing the int32 lanes of several registers at once (reduce16_epi32_avx512 and
// the 4-bit scores' two rows a register).

/// Per 128-bit lane: dwords (a0 + a1, b0 + b1, a2 + a3, b2 + b3).
KVDECODE_TARGET_AVX512 inline __m512i add_unpacked_epi32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
/// Per 128-bit lane: qwords (a0 + a1, b0 + b1), added as dword pairs.
KVDECODE_TARGET_AVX512 inline __m512i add_unpacked_epi64(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
/// 128-bit blocks (a0 + a1, a2 + a3, b0 + b1, b2 + b3).
KVDECODE_TARGET_AVX512 inline __m512i add_blocks_epi32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}

// 4-bit scores with AVX512_VNNI (the avx512bf16 set): the folded query a = q ⊙ kstep is
// quantized once per group to int8, i = round(a · (127 / max|a|)) (to nearest, ties to even,
// whatever the rounding mode), d = max|a| / 127, and each score is qm + d · Σ i · code, the sum
// exact in int32 (vpdpbusd: 4 u8 × s8 products a lane). A max|a| below 2^-100 (where 127 /
// max|a| could overflow) counts as 0: i = 0, d = 0. A NaN in a makes d NaN, so the scores are
// NaN as the f32 kernels' would be. Layout of qs: qs[0] = d; from byte 64, per 64 channels, the
// int8 query of the 32 even channels, then of the 32 odd ones (the low and high nibbles of the
// row's 32 code bytes).

/// Folds and quantizes the query for q4_scores_vnni into qs [round_up(hs, 32)] (the layout
/// above), returns q · kmin (ranges f16).
KVDECODE_TARGET_AVX512BF16 inline float q4_query_vnni(float* qs, const float* q,
                                                      const std::uint16_t* kmin,
                                                      const std::uint16_t* kstep, std::size_t hs) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const std::size_t padded = (hs + 63) / 64 * 64;  // channels the int8 query covers
  __m512 qm = _mm512_setzero_ps(), amax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (std::size_t c = 0; c < hs; c += 16) {
    const __mmask16 m = coded_mask16(hs - c);
    const __m512 qc = _mm512_maskz_loadu_ps(m, q + c);
    qm = _mm512_fmadd_ps(qc, load_f16_avx512(kmin + c, m), qm);
    track_abs_max(_mm512_mul_ps(qc, load_f16_avx512(kstep + c, m)), amax, nan);
  }
  const RoundingScale rs = rounding_scale(amax, nan, 127.0f);
  const __m512 inv = _mm512_set1_ps(rs.inv);
  auto* const out = reinterpret_cast<std::int8_t*>(qs) + 64;  // [padded]
  for (std::size_t c = 0; c < padded; c += 32) {  // the products of [c, c + 32), 0 past hs
    const __mmask16 m0 = coded_mask16(hs > c ? hs - c : 0);
    const __mmask16 m1 = coded_mask16(hs > c + 16 ? hs - c - 16 : 0);
    const __m512 p0 =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, q + c), load_f16_avx512(kstep + c, m0));
    const __m512 p1 =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, q + c + 16), load_f16_avx512(kstep + c + 16, m1));
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(p0, inv), kNearest);
    const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(p1, inv), kNearest);
    std::int8_t* const chunk = out + c / 64 * 64 + (c % 64) / 2;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk),
                     _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(i0, even, i1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 32),
                     _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(i0, odd, i1)));
  }
  qs[0] = rs.d;
  return _mm512_reduce_add_ps(qm);
}

/// s [rows] = (qm + d · Σ_c i[c] · code[r][c]) · scale, with d and i from q4_query_vnni in qs.
/// Two rows per register (one in each 256-bit half), 16 rows' int32 sums reduced together.
KVDECODE_TARGET_AVX512BF16 inline void q4_scores_vnni(float* s, const float* qs, float qm,
                                                      const std::uint8_t* codes, std::size_t rows,
                                                      std::size_t hs, float scale) {
  const std::size_t row_bytes = hs / 2;
  const auto* const qb = reinterpret_cast<const std::uint8_t*>(qs) + 64;
  const __m512 vd = _mm512_set1_ps(qs[0]), vqm = _mm512_set1_ps(qm), vs = _mm512_set1_ps(scale);
  const __m512i low = _mm512_set1_epi8(0x0F);
  // Row order of the reduced sums below: rows 0, 2, 4, 6 | 1, 3, 5, 7 | 8, 10, 12, 14 | 9, .. 15.
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    __m512i acc[8];
    KVDECODE_UNROLL
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_setzero_si512();
    // The codes kPrefetchBytes ahead of these 16 rows, a line at a time.
    const char* const ahead =
        reinterpret_cast<const char*>(codes + r0 * row_bytes) + kPrefetchBytes;
    for (std::size_t b = 0; b < 16 * row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    for (std::size_t b0 = 0; b0 < row_bytes; b0 += 32) {
      const std::size_t n = row_bytes - b0 < 32 ? row_bytes - b0 : 32;
      const auto m = static_cast<__mmask32>(n == 32 ? ~0u : (1u << n) - 1u);
      const __m512i qe =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 2 * b0)));
      const __m512i qo = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 2 * b0 + 32)));
      for (std::size_t k = 0; k < 8; ++k) {
        const std::size_t ra = 2 * k, rb = ra + 1;
        const __m256i a = ra < count
                              ? _mm256_maskz_loadu_epi8(m, codes + (r0 + ra) * row_bytes + b0)
                              : _mm256_setzero_si256();
        const __m256i b = rb < count
                              ? _mm256_maskz_loadu_epi8(m, codes + (r0 + rb) * row_bytes + b0)
                              : _mm256_setzero_si256();
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_and_si512(x, low), qe);
        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_and_si512(_mm512_srli_epi16(x, 4), low), qo);
      }
    }
    // Sum each 256-bit half: pairs of registers, then fours, then the halves' 128-bit blocks.
    __m512i t[4], u[2];
    KVDECODE_UNROLL
    for (int k = 0; k < 4; ++k) t[k] = add_unpacked_epi32(acc[2 * k], acc[2 * k + 1]);
    KVDECODE_UNROLL
    for (int k = 0; k < 2; ++k) u[k] = add_unpacked_epi64(t[2 * k], t[2 * k + 1]);
    const __m512i z = add_blocks_epi32(u[0], u[1]);  // blocks 0, 2 + blocks 1, 3
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(order, z));
    _mm512_mask_storeu_ps(s + r0, coded_mask16(count),
                          _mm512_mul_ps(_mm512_fmadd_ps(sums, vd, vqm), vs));
  }
}

/// t [16] = the bytes [b0, b0 + 64) of rows [0, count) of codes [count][row_bytes] (fewer past
/// row_bytes, rows past count 0), transposed: lane i of t[k] is row i's dword k (bytes b0 + 4k
/// .. + 3). Returns how many of the t[k] hold any code.
KVDECODE_TARGET_AVX512 inline std::size_t load_transposed_rows(__m512i* t,
                                                               const std::uint8_t* codes,
                                                               std::size_t row_bytes,
                                                               std::size_t count, std::size_t b0) {
  const std::size_t bytes = row_bytes - b0 < 64 ? row_bytes - b0 : 64;
  const __mmask64 bm = bytes == 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1;
  KVDECODE_UNROLL
  for (std::size_t i = 0; i < 16; ++i)
    t[i] = i < count ? _mm512_maskz_loadu_epi8(bm, codes + i * row_bytes + b0)
                     : _mm512_setzero_si512();
  transpose_16x16(t);
  return (bytes + 3) / 4;
}

/// Query heads int8_heads_scores_vnni and q4_heads_scores_vnni score in one pass over a group of
/// rows: their int32 sums stay in registers beside the group's 16 transposed code registers.
inline constexpr std::size_t kVnniHeadsAtOnce = 4;

/// q4_scores_vnni for the query heads that share a kv head: s [heads][s_stride] (first rows of
/// each), head h with its query folded by q4_query_vnni at qs + h · qs_stride and its q · kmin at
/// qm [h · qm_stride]; each head's bits are q4_scores_vnni's (the same int32 sums, summed in
/// another order). As int8_heads_scores_vnni, 16 rows' code bytes are transposed in registers
/// once for up to kVnniHeadsAtOnce heads, and each register's even and odd channels (low and
/// high nibbles) are split once for all of them.
KVDECODE_TARGET_AVX512BF16 inline void q4_heads_scores_vnni(
    float* s, std::size_t s_stride, const float* qs, std::size_t qs_stride, const float* qm,
    std::size_t qm_stride, std::size_t heads, const std::uint8_t* codes, std::size_t rows,
    std::size_t hs, float scale) {
  constexpr std::size_t kAtOnce = kVnniHeadsAtOnce;
  const std::size_t row_bytes = hs / 2;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    const std::uint8_t* const group = codes + r0 * row_bytes;  // [count][row_bytes]
    const char* const ahead = reinterpret_cast<const char*>(group) + kPrefetchBytes;
    for (std::size_t b = 0; b < 16 * row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    for (std::size_t h0 = 0; h0 < heads; h0 += kAtOnce) {
      const std::size_t at_once = heads - h0 < kAtOnce ? heads - h0 : kAtOnce;
      __m512i acc[kAtOnce];  // lane i: row r0 + i's Σ i · code
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) acc[h] = _mm512_setzero_si512();
      for (std::size_t b0 = 0; b0 < row_bytes; b0 += 64) {  // channels [2·b0, 2·b0 + 128)
        __m512i t[16];                                      // bytes b0 + 4k .. + 3 of 16 rows
        const std::size_t quads = load_transposed_rows(t, group, row_bytes, count, b0);
        KVDECODE_UNROLL
        for (std::size_t k = 0; k < 16; ++k) {
          if (k >= quads) continue;  // not break: a fixed trip count unrolls
          // Channels c .. c + 7: the even ones in the low nibbles, the odd ones in the high.
          const std::size_t c = 2 * b0 + 8 * k;
          const __m512i even = _mm512_and_si512(t[k], low);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), low);
          KVDECODE_UNROLL
          for (std::size_t h = 0; h < kAtOnce; ++h) {
            if (h >= at_once) continue;
            // q4_query_vnni's bytes of even channels c, c + 2, c + 4, c + 6, the odd 32 later.
            const auto* const qb =
                reinterpret_cast<const std::uint8_t*>(qs + (h0 + h) * qs_stride) + 64 +
                c / 64 * 64 + c % 64 / 2;
            std::int32_t qe, qo;
            std::memcpy(&qe, qb, 4);
            std::memcpy(&qo, qb + 32, 4);
            acc[h] = _mm512_dpbusd_epi32(acc[h], even, _mm512_set1_epi32(qe));
            acc[h] = _mm512_dpbusd_epi32(acc[h], odd, _mm512_set1_epi32(qo));
          }
        }
      }
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) {
        if (h >= at_once) continue;
        const std::size_t head = h0 + h;
        const __m512 vd = _mm512_set1_ps(qs[head * qs_stride]);
        const __m512 vqm = _mm512_set1_ps(qm[head * qm_stride]);
        _mm512_mask_storeu_ps(
            s + head * s_stride + r0, coded_mask16(count),
            _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h]), vd, vqm), vs));
      }
    }
  }
}

// int8 scores with AVX512_VNNI (the avx512bf16 set): the query is rounded once to 15 bits,
// i = round(q · (16383 / max|q|)), d = max|q| / 16383, and split as i = 128·hi + lo with hi in
// [-128, 127] and lo in [0, 127], both int8, so Σ i · code = 128 Σ hi · code + Σ lo · code
// comes from two vpdpbusd per 64 codes, exact in int32 up to kMaxVnniInt8HeadSize. Each
// channel moves by at most d/2, 1/129 of a step of the 4-bit query above. Zero, infinite and
// NaN maxima are handled as q4_query_vnni's. Layout of qv: qv[0] = d; from byte 64, per 64
// channels, the 64 hi bytes, then the 64 lo bytes, 0 past hs.

/// Rounds and splits q [hs] for int8_scores_vnni into qv [int8_query_floats(hs)] (the layout
/// above).
KVDECODE_TARGET_AVX512BF16 inline void int8_query_vnni(float* qv, const float* q, std::size_t hs) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (std::size_t c = 0; c < hs; c += 16)
    track_abs_max(_mm512_maskz_loadu_ps(coded_mask16(hs - c), q + c), amax, nan);
  const RoundingScale rs = rounding_scale(amax, nan, 16383.0f);
  const __m512 inv = _mm512_set1_ps(rs.inv);
  const __m512i low7 = _mm512_set1_epi32(127);
  auto* const out = reinterpret_cast<std::int8_t*>(qv) + 64;  // [round_up(hs, 64) / 64][2][64]
  for (std::size_t c = 0; c < (hs + 63) / 64 * 64; c += 16) {
    const __mmask16 m = coded_mask16(hs > c ? hs - c : 0);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i i =
        _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + c), inv), kNearest);
    std::int8_t* const chunk = out + c / 64 * 128 + c % 64;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk),
                     _mm512_cvtepi32_epi8(_mm512_srai_epi32(i, 7)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 64),
                     _mm512_cvtepi32_epi8(_mm512_and_si512(i, low7)));
  }
  qv[0] = rs.d;
}

/// Lane i of the result = the sum of the 16 int32 lanes of a[i] (reduce16_avx512 in integers).
KVDECODE_TARGET_AVX512 inline __m512i reduce16_epi32_avx512(__m512i* a) {
  __m512i t[8], u[4];
  KVDECODE_UNROLL
  for (int i = 0; i < 8; ++i) t[i] = add_unpacked_epi32(a[2 * i], a[2 * i + 1]);
  KVDECODE_UNROLL
  for (int i = 0; i < 4; ++i) u[i] = add_unpacked_epi64(t[2 * i], t[2 * i + 1]);
  return add_blocks_epi32(add_blocks_epi32(u[0], u[1]), add_blocks_epi32(u[2], u[3]));
}

/// A row's 8-bit codes · the split query of int8_query_vnni (at qb, its byte 64), as 16 int32
/// partial sums of Σ i · code.
struct Int8RowDotVnni {
  const std::uint8_t* qb;
  std::size_t hs;
  KVDECODE_TARGET_AVX512BF16 __m512i operator()(const std::uint8_t* row) const {
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    __m512i hi = _mm512_setzero_si512(), lo = _mm512_setzero_si512();
    for (std::size_t c = 0; c < hs; c += 64) {
      const std::size_t n = hs - c;
      const __m512i x = n >= 64 ? _mm512_loadu_si512(row + c)
                                : _mm512_maskz_loadu_epi8((__mmask64{1} << n) - 1, row + c);
      hi = _mm512_dpbusd_epi32(hi, x, _mm512_loadu_si512(qb + 2 * c));
      lo = _mm512_dpbusd_epi32(lo, x, _mm512_loadu_si512(qb + 2 * c + 64));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo);
  }
};

/// s [rows] = (kstep[r] · d · Σ_c i[c] · code[r][c] + kmin[r] · qsum) · scale, with d and i
/// from int8_query_vnni in qv; hs ≤ kMaxVnniInt8HeadSize.
KVDECODE_TARGET_AVX512BF16 inline void int8_scores_vnni(
    float* s, const float* qv, float qsum, const std::uint8_t* codes, const std::uint16_t* kmin,
    const std::uint16_t* kstep, std::size_t rows, std::size_t hs, float scale) {
  const auto* const qb = reinterpret_cast<const std::uint8_t*>(qv) + 64;
  const __m512 vd = _mm512_set1_ps(qv[0]), vq = _mm512_set1_ps(qsum), vs = _mm512_set1_ps(scale);
  const Int8RowDotVnni dot{qb, hs};
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    __m512i acc[16];
    if (count == 16) {
      KVDECODE_UNROLL
      for (std::size_t i = 0; i < 16; ++i) acc[i] = dot(codes + (r0 + i) * hs);
    } else {
      for (std::size_t i = 0; i < 16; ++i)
        acc[i] = i < count ? dot(codes + (r0 + i) * hs) : _mm512_setzero_si512();
    }
    const __mmask16 m = coded_mask16(count);
    const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(reduce16_epi32_avx512(acc)), vd);
    _mm512_mask_storeu_ps(
        s + r0, m,
        _mm512_mul_ps(_mm512_fmadd_ps(sum, load_f16_avx512(kstep + r0, m),
                                      _mm512_mul_ps(vq, load_f16_avx512(kmin + r0, m))),
                      vs));
  }
}

/// int8_scores_vnni for the query heads that share a kv head: s [heads][s_stride] (first rows
/// of each), head h with its query at qv + h · qv_stride and its Σ q at qsum [h · qsum_stride];
/// each head's bits are int8_scores_vnni's (the same int32 sums, summed in another order). 16
/// rows' codes are transposed in registers once for up to kVnniHeadsAtOnce heads (a register
/// per 4 channels, a lane per row), so a head takes one vpdpbusd per 4 channels and 16 rows
/// with no reduction: with several heads a row the transpose costs less than their reductions.
KVDECODE_TARGET_AVX512BF16 inline void int8_heads_scores_vnni(
    float* s, std::size_t s_stride, const float* qv, std::size_t qv_stride, const float* qsum,
    std::size_t qsum_stride, std::size_t heads, const std::uint8_t* codes,
    const std::uint16_t* kmin, const std::uint16_t* kstep, std::size_t rows, std::size_t hs,
    float scale) {
  constexpr std::size_t kAtOnce = kVnniHeadsAtOnce;
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    const __mmask16 m = coded_mask16(count);
    const std::uint8_t* const group = codes + r0 * hs;  // [count][hs]
    for (std::size_t i = 0; i < count; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(group + i * hs) + kPrefetchBytes, _MM_HINT_T0);
    const __m512 step = load_f16_avx512(kstep + r0, m), low = load_f16_avx512(kmin + r0, m);
    for (std::size_t h0 = 0; h0 < heads; h0 += kAtOnce) {
      const std::size_t at_once = heads - h0 < kAtOnce ? heads - h0 : kAtOnce;
      __m512i hi[kAtOnce], lo[kAtOnce];  // lane i: row r0 + i's Σ of the hi (lo) query bytes
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) hi[h] = lo[h] = _mm512_setzero_si512();
      for (std::size_t c0 = 0; c0 < hs; c0 += 64) {
        __m512i t[16];  // channels c0 + 4k .. + 3 of 16 rows
        const std::size_t quads = load_transposed_rows(t, group, hs, count, c0);
        KVDECODE_UNROLL
        for (std::size_t h = 0; h < kAtOnce; ++h) {
          if (h >= at_once) continue;
          // The query's hi bytes of channels [c0, c0 + 64), then its lo bytes (int8_query_vnni).
          const auto* const qb =
              reinterpret_cast<const std::uint8_t*>(qv + (h0 + h) * qv_stride) + 64 + 2 * c0;
          KVDECODE_UNROLL
          for (std::size_t k = 0; k < 16; ++k) {
            if (k >= quads) continue;  // not break: a fixed trip count unrolls
            std::int32_t qhi, qlo;
            std::memcpy(&qhi, qb + 4 * k, 4);
            std::memcpy(&qlo, qb + 64 + 4 * k, 4);
            hi[h] = _mm512_dpbusd_epi32(hi[h], t[k], _mm512_set1_epi32(qhi));
            lo[h] = _mm512_dpbusd_epi32(lo[h], t[k], _mm512_set1_epi32(qlo));
          }
        }
      }
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) {
        if (h >= at_once) continue;
        const std::size_t head = h0 + h;
        const __m512 vd = _mm512_set1_ps(qv[head * qv_stride]);
        const __m512 vq = _mm512_set1_ps(qsum[head * qsum_stride]);
        const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(hi[h], 7), lo[h]);
        const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(total), vd);
        _mm512_mask_storeu_ps(
            s + head * s_stride + r0, m,
            _mm512_mul_ps(_mm512_fmadd_ps(sum, step, _mm512_mul_ps(vq, low)), vs));
      }
    }
  }
}

// p·v with AVX512_VNNI (the avx512bf16 set), 8- and 4-bit values: a tile's weights w[r] =
// p[r] · vstep[r] are rounded to 15 bits as the query above, w ≈ d · (128·hi + lo), and each
// channel's Σ_r code · (128·hi + lo) is summed in int32: 64 codes of 4 rows, one byte each, are
// interleaved so that a dword lane holds one channel's 4 codes (vpunpck*), which vpdpbusd
// multiplies with the 4 rows' hi (and lo) bytes. Exact up to kMaxVnniRows rows: rows · 255 ·
// (127 · 128 + 127) < 2^31. Each weight moves by at most d/2 = max w / 32766.

/// The weights w = p [rows] · vstep [rows] (f16) of a tile rounded to 15 bits of their largest:
/// calls put(r, i) with rows r .. r + 15's integers i = round(w · 16383 / max w) (0 past rows),
/// sets d = max w / 16383, and returns Σ p · vmin.
template <class Put>
KVDECODE_TARGET_AVX512BF16 inline float vnni_rounded_weights(const float* p,
                                                             const std::uint16_t* vmin,
                                                             const std::uint16_t* vstep,
                                                             std::size_t rows, float& d, Put put) {
  __m512 bias = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (std::size_t r = 0; r < rows; r += 16) {
    const __mmask16 m = coded_mask16(rows - r);
    const __m512 pr = _mm512_maskz_loadu_ps(m, p + r);
    track_abs_max(_mm512_mul_ps(pr, load_f16_avx512(vstep + r, m)), wmax, nan);
    bias = _mm512_fmadd_ps(pr, load_f16_avx512(vmin + r, m), bias);
  }
  const RoundingScale rs = rounding_scale(wmax, nan, 16383.0f);
  const __m512 inv = _mm512_set1_ps(rs.inv);
  d = rs.d;
  for (std::size_t r = 0; r < (rows + 15) / 16 * 16; r += 16) {
    const __mmask16 m = coded_mask16(rows > r ? rows - r : 0);
    const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + r), load_f16_avx512(vstep + r, m));
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    put(r, _mm512_cvt_roundps_epi32(_mm512_mul_ps(w, inv), kNearest));
  }
  return _mm512_reduce_add_ps(bias);
}

/// Rounds w = p [rows] · vstep [rows] (f16) into packs [round_up(rows, 16) / 2] (the hi bytes of
/// the rows, then the lo bytes, 0 past rows), sets d, and returns Σ p · vmin.
KVDECODE_TARGET_AVX512BF16 inline float vnni_weights(const float* p, const std::uint16_t* vmin,
                                                     const std::uint16_t* vstep, std::size_t rows,
                                                     float* packs, float& d) {
  const std::size_t padded = (rows + 15) / 16 * 16;
  auto* const hi = reinterpret_cast<std::int8_t*>(packs);  // [padded], then lo [padded]
  return vnni_rounded_weights(
      p, vmin, vstep, rows, d, [&](std::size_t r, __m512i i) KVDECODE_TARGET_AVX512BF16 {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + r),
                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(i, 7)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + padded + r),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(i, _mm512_set1_epi32(127))));
      });
}

/// The same weights as 16-bit integers, words [round_up(rows, 16)] (0 past rows).
KVDECODE_TARGET_AVX512BF16 inline float vnni_weight_words(const float* p, const std::uint16_t* vmin,
                                                          const std::uint16_t* vstep,
                                                          std::size_t rows, std::int16_t* words,
                                                          float& d) {
  return vnni_rounded_weights(
      p, vmin, vstep, rows, d, [&](std::size_t r, __m512i i) KVDECODE_TARGET_AVX512BF16 {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + r), _mm512_cvtepi32_epi16(i));
      });
}

/// out [4] = d · Σ_r w[r] · codes(r), 16 byte positions each (out[m] the positions [16m,
/// 16m + 16)), for the 64 byte codes codes(r) of each row r < rows, with the weights of
/// vnni_weights in packs.
template <class Codes>
KVDECODE_TARGET_AVX512BF16 inline void vnni_pv_bytes(__m512* out, const float* packs,
                                                     std::size_t rows, float d, Codes codes) {
  const std::size_t padded = (rows + 15) / 16 * 16;
  const auto* const hi = reinterpret_cast<const std::int8_t*>(packs);
  __m512i ah[4], al[4];  // position 16L + 4k + j in dword j of 128-bit lane L of a*[k]
  KVDECODE_UNROLL
  for (int k = 0; k < 4; ++k) ah[k] = al[k] = _mm512_setzero_si512();
  for (std::size_t r = 0; r < rows; r += 4) {
    __m512i x[4];
    KVDECODE_UNROLL
    for (std::size_t u = 0; u < 4; ++u) x[u] = r + u < rows ? codes(r + u) : _mm512_setzero_si512();
    const __m512i a = _mm512_unpacklo_epi8(x[0], x[1]), b = _mm512_unpackhi_epi8(x[0], x[1]);
    const __m512i c = _mm512_unpacklo_epi8(x[2], x[3]), e = _mm512_unpackhi_epi8(x[2], x[3]);
    const __m512i q[4] = {_mm512_unpacklo_epi16(a, c), _mm512_unpackhi_epi16(a, c),
                          _mm512_unpacklo_epi16(b, e), _mm512_unpackhi_epi16(b, e)};
    std::int32_t wh = 0, wl = 0;
    std::memcpy(&wh, hi + r, sizeof wh);
    std::memcpy(&wl, hi + padded + r, sizeof wl);
    const __m512i vh = _mm512_set1_epi32(wh), vl = _mm512_set1_epi32(wl);
    KVDECODE_UNROLL
    for (int k = 0; k < 4; ++k) {
      ah[k] = _mm512_dpbusd_epi32(ah[k], q[k], vh);
      al[k] = _mm512_dpbusd_epi32(al[k], q[k], vl);
    }
  }
  const __m512 vd = _mm512_set1_ps(d);
  __m512 v[4];
  KVDECODE_UNROLL
  for (int k = 0; k < 4; ++k)
    v[k] =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah[k], 7), al[k])), vd);
  // Positions in order: 128-bit lane k of out[m] is lane m of v[k] (a 4 × 4 transpose).
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
  const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  out[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  out[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  out[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  out[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

/// dst [count ≤ 16] += x + bias.
KVDECODE_TARGET_AVX512 inline void add_to_avx512(float* dst, std::size_t count, __m512 x,
                                                 __m512 bias) {
  const __mmask16 m = coded_mask16(count);
  _mm512_mask_storeu_ps(dst, m,
                        _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), _mm512_add_ps(x, bias)));
}

/// 64 channels' 8-bit codes [d0, d0 + 64) of a row (fewer under mask m, the rest 0).
struct Int8Codes64 {
  const std::uint8_t* codes;
  std::size_t hs, d0;
  __mmask64 m;
  KVDECODE_TARGET_AVX512BF16 __m512i operator()(std::size_t r) const {
    const std::uint8_t* row = codes + r * hs + d0;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    return _mm512_maskz_loadu_epi8(m, row);
  }
};

/// 64 channels' 4-bit codes of a row from its bytes [b0, b0 + 32) (fewer under mask m): the
/// low nibbles (even channels) in bytes 0-31, the high nibbles (odd channels) in bytes 32-63.
struct Q4Codes64 {
  const std::uint8_t* codes;
  std::size_t row_bytes, b0;
  __mmask32 m;
  KVDECODE_TARGET_AVX512BF16 __m512i operator()(std::size_t r) const {
    const std::uint8_t* row = codes + r * row_bytes + b0;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i x = _mm256_maskz_loadu_epi8(m, row);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
};

/// o [hs] += Σ_r p [r] · (vmin [r] + vstep [r] · codes [r][hs]) (ranges f16) for rows ≤
/// kMaxVnniRows; packs [round_up(rows, 16) / 2] is scratch.
KVDECODE_TARGET_AVX512BF16 inline void int8_pv_vnni(float* o, const float* p,
                                                    const std::uint8_t* codes,
                                                    const std::uint16_t* vmin,
                                                    const std::uint16_t* vstep, std::size_t rows,
                                                    std::size_t hs, float* packs) {
  float d = 0.0f;
  const __m512 bias = _mm512_set1_ps(vnni_weights(p, vmin, vstep, rows, packs, d));
  for (std::size_t d0 = 0; d0 < hs; d0 += 64) {
    const std::size_t n = hs - d0 < 64 ? hs - d0 : 64;
    const auto m = n == 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
    __m512 out[4];
    vnni_pv_bytes(out, packs, rows, d, Int8Codes64{codes, hs, d0, m});
    for (std::size_t k = 0; 16 * k < n; ++k)
      add_to_avx512(o + d0 + 16 * k, n - 16 * k, out[k], bias);
  }
}

/// The pass the heads' p·v kernels share, for the query heads that share a kv head: o
/// [heads][o_stride] += Σ_r p_h [r] · (vmin [r] + vstep [r] · code [r][..]), p_h = p + h ·
/// p_stride, over the rows' codes [rows][row_bytes] in chunks of chunk_bytes; words
/// [heads][round_up(rows, 16)] is scratch. Each head's weights are rounded as int8_pv_vnni's
/// (vnni_weight_words), and its int32 sums Σ_r code · (128·hi + lo) are the one-head kernels'
/// hi and lo sums taken as one 16-bit weight (vpdpwssd, two rows a lane) instead of two bytes
/// (vpdpbusd, four rows a lane, hi and lo apart): the same bits. Two rows' codes are widened and
/// interleaved once for every head, and the half as many accumulators let three heads' stay in
/// registers. widen(n)(row, x) sets x [2] to a chunk's (n bytes) 64 codes as 32 words each;
/// put(o_h, b0, n, out, bias) adds to head h's o_h the codes' sums out [4] (codes in widen's
/// order, 16 a register, times d) and the bias of the chunk at byte b0.
template <class Widen, class Put>
KVDECODE_TARGET_AVX512BF16 inline void heads_pv_vnni(float* o, std::size_t o_stride, const float* p,
                                                     std::size_t p_stride, std::size_t heads,
                                                     const std::uint8_t* codes,
                                                     std::size_t row_bytes, std::size_t chunk_bytes,
                                                     const std::uint16_t* vmin,
                                                     const std::uint16_t* vstep, std::size_t rows,
                                                     std::int16_t* words, Widen widen, Put put) {
  constexpr std::size_t kAtOnce = kVnniPvHeadsAtOnce;
  const std::size_t padded = (rows + 15) / 16 * 16;
  for (std::size_t h0 = 0; h0 < heads; h0 += kAtOnce) {
    const std::size_t at_once = heads - h0 < kAtOnce ? heads - h0 : kAtOnce;
    float d[kAtOnce] = {}, bias[kAtOnce] = {};
    for (std::size_t h = 0; h < at_once; ++h)
      bias[h] =
          vnni_weight_words(p + (h0 + h) * p_stride, vmin, vstep, rows, words + h * padded, d[h]);
    for (std::size_t b0 = 0; b0 < row_bytes; b0 += chunk_bytes) {
      const std::size_t n = row_bytes - b0 < chunk_bytes ? row_bytes - b0 : chunk_bytes;
      const auto widen_chunk = widen(n);
      __m512i acc[kAtOnce][4];  // lane 4L + j: code 8L + j (k = 0), 8L + 4 + j (1), 32 + .. (2, 3)
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) KVDECODE_UNROLL
      for (int k = 0; k < 4; ++k) acc[h][k] = _mm512_setzero_si512();
      for (std::size_t r = 0; r < rows; r += 2) {
        const std::uint8_t* const a = codes + r * row_bytes + b0;
        // Both rows' codes kPrefetchBytes ahead, as the one-head kernels request each row's.
        _mm_prefetch(reinterpret_cast<const char*>(a) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a + row_bytes) + kPrefetchBytes, _MM_HINT_T0);
        __m512i x0[2], x1[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        widen_chunk(a, x0);
        if (r + 1 < rows) widen_chunk(a + row_bytes, x1);
        const __m512i x[4] = {
            _mm512_unpacklo_epi16(x0[0], x1[0]), _mm512_unpackhi_epi16(x0[0], x1[0]),
            _mm512_unpacklo_epi16(x0[1], x1[1]), _mm512_unpackhi_epi16(x0[1], x1[1])};
        KVDECODE_UNROLL
        for (std::size_t h = 0; h < kAtOnce; ++h) {
          if (h >= at_once) continue;  // not break: a fixed trip count unrolls
          std::int32_t pair;           // rows r and r + 1's weights (0 past rows)
          std::memcpy(&pair, words + h * padded + r, sizeof pair);
          const __m512i w = _mm512_set1_epi32(pair);
          KVDECODE_UNROLL
          for (int k = 0; k < 4; ++k) acc[h][k] = _mm512_dpwssd_epi32(acc[h][k], x[k], w);
        }
      }
      KVDECODE_UNROLL
      for (std::size_t h = 0; h < kAtOnce; ++h) {
        if (h >= at_once) continue;
        const __m512 vd = _mm512_set1_ps(d[h]);
        __m512 v[4];
        KVDECODE_UNROLL
        for (int k = 0; k < 4; ++k) v[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h][k]), vd);
        // Codes in order: 128-bit blocks L of v[0] and v[1] alternate (8L .. 8L + 7).
        __m512 out[4];
        KVDECODE_UNROLL
        for (int k = 0; k < 2; ++k) {
          const __m512 lo = _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0));
          const __m512 up = _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2));
          out[2 * k] = _mm512_shuffle_f32x4(lo, lo, _MM_SHUFFLE(3, 1, 2, 0));
          out[2 * k + 1] = _mm512_shuffle_f32x4(up, up, _MM_SHUFFLE(3, 1, 2, 0));
        }
        put(o + (h0 + h) * o_stride, b0, n, out, _mm512_set1_ps(bias[h]));
      }
    }
  }
}

/// int8_pv_vnni for the query heads that share a kv head: o [heads][o_stride] (first hs of
/// each) += Σ_r p_h [r] · (vmin [r] + vstep [r] · codes [r][hs]), p_h = p + h · p_stride, for
/// rows ≤ kMaxVnniRows; words [heads][round_up(rows, 16)] is scratch. Each head's bits are
/// int8_pv_vnni's (heads_pv_vnni).
KVDECODE_TARGET_AVX512BF16 inline void int8_heads_pv_vnni(
    float* o, std::size_t o_stride, const float* p, std::size_t p_stride, std::size_t heads,
    const std::uint8_t* codes, const std::uint16_t* vmin, const std::uint16_t* vstep,
    std::size_t rows, std::size_t hs, std::int16_t* words) {
  heads_pv_vnni(
      o, o_stride, p, p_stride, heads, codes, hs, 64, vmin, vstep, rows, words,
      [](std::size_t n) {
        // Channels [0, 32) and [32, 64) as 16-bit integers.
        const auto m0 = static_cast<__mmask32>(n >= 32 ? ~0u : (1u << n) - 1u);
        const auto m1 = static_cast<__mmask32>(n >= 64 ? ~0u : n > 32 ? (1u << (n - 32)) - 1u : 0u);
        return [m0, m1](const std::uint8_t* row, __m512i* x) KVDECODE_TARGET_AVX512BF16 {
          x[0] = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m0, row));
          x[1] = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m1, row + 32));
        };
      },
      [](float* oh, std::size_t d0, std::size_t n, const __m512* out, __m512 bias)
          KVDECODE_TARGET_AVX512BF16 {
            for (std::size_t k = 0; 16 * k < n; ++k)
              add_to_avx512(oh + d0 + 16 * k, n - 16 * k, out[k], bias);
          });
}

/// Even channels e and odd ones o of 16 pairs into channels in order for _mm512_permutex2var_ps:
/// (e0 o0 .. e7 o7) with q4_pairs_lo, then (e8 o8 .. e15 o15) with q4_pairs_hi.
KVDECODE_TARGET_AVX512 inline __m512i q4_pairs_lo() {
  return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
KVDECODE_TARGET_AVX512 inline __m512i q4_pairs_hi() {
  return _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

/// o [hs] += the sums of 32 bytes at byte b0 of 4-bit rows (n of them there) + bias: out [4] the
/// even channels of bytes [0, 16) and [16, 32), then the odd ones.
KVDECODE_TARGET_AVX512 inline void add_q4_chunk(float* o, std::size_t hs, std::size_t b0,
                                                std::size_t n, const __m512* out, __m512 bias) {
  for (std::size_t k = 0; k < 2 && 16 * k < n; ++k) {
    const std::size_t c = 2 * (b0 + 16 * k), left = hs - c;  // channels [c, c + 32)
    add_to_avx512(o + c, left, _mm512_permutex2var_ps(out[k], q4_pairs_lo(), out[k + 2]), bias);
    if (left > 16)
      add_to_avx512(o + c + 16, left - 16,
                    _mm512_permutex2var_ps(out[k], q4_pairs_hi(), out[k + 2]), bias);
  }
}

/// o [hs] += Σ_r p [r] · (vmin [r] + vstep [r] · 4-bit codes [r][hs / 2]) (ranges f16) for rows
/// ≤ kMaxVnniRows; packs [round_up(rows, 16) / 2] is scratch.
KVDECODE_TARGET_AVX512BF16 inline void q4_pv_vnni(float* o, const float* p,
                                                  const std::uint8_t* codes,
                                                  const std::uint16_t* vmin,
                                                  const std::uint16_t* vstep, std::size_t rows,
                                                  std::size_t hs, float* packs) {
  float d = 0.0f;
  const __m512 bias = _mm512_set1_ps(vnni_weights(p, vmin, vstep, rows, packs, d));
  const std::size_t row_bytes = hs / 2;
  for (std::size_t b0 = 0; b0 < row_bytes; b0 += 32) {
    const std::size_t n = row_bytes - b0 < 32 ? row_bytes - b0 : 32;  // bytes: 2n channels
    const auto m = static_cast<__mmask32>(n == 32 ? ~0u : (1u << n) - 1u);
    __m512 out[4];  // even channels of bytes [0, 16), [16, 32), then the odd ones
    vnni_pv_bytes(out, packs, rows, d, Q4Codes64{codes, row_bytes, b0, m});
    add_q4_chunk(o, hs, b0, n, out, bias);
  }
}

/// q4_pv_vnni for the query heads that share a kv head: o [heads][o_stride] (first hs of each)
/// += Σ_r p_h [r] · (vmin [r] + vstep [r] · 4-bit codes [r][hs / 2]), p_h = p + h · p_stride,
/// for rows ≤ kMaxVnniRows; words [heads][round_up(rows, 16)] is scratch. Each head's bits are
/// q4_pv_vnni's (heads_pv_vnni).
KVDECODE_TARGET_AVX512BF16 inline void q4_heads_pv_vnni(
    float* o, std::size_t o_stride, const float* p, std::size_t p_stride, std::size_t heads,
    const std::uint8_t* codes, const std::uint16_t* vmin, const std::uint16_t* vstep,
    std::size_t rows, std::size_t hs, std::int16_t* words) {
  heads_pv_vnni(
      o, o_stride, p, p_stride, heads, codes, hs / 2, 32, vmin, vstep, rows, words,
      [](std::size_t n) {
        // The even channels (low nibbles) of the n bytes, then the odd ones, as 16-bit integers.
        const auto m = static_cast<__mmask32>(n >= 32 ? ~0u : (1u << n) - 1u);
        return [m](const std::uint8_t* row, __m512i* x) KVDECODE_TARGET_AVX512BF16 {
          const __m256i bytes = _mm256_maskz_loadu_epi8(m, row);
          const __m256i nibble = _mm256_set1_epi8(0x0F);
          x[0] = _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble));
          x[1] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
        };
      },
      [hs](float* oh, std::size_t b0, std::size_t n, const __m512* out, __m512 bias)
          KVDECODE_TARGET_AVX512BF16 { add_q4_chunk(oh, hs, b0, n, out, bias); });
}

/// w [rows] = p · vstep and returns Σ p · vmin (ranges f16).
KVDECODE_TARGET_AVX512 inline float low_bit_weights_avx512(float* w, const float* p,
                                                           const std::uint16_t* vmin,
                                                           const std::uint16_t* vstep,
                                                           std::size_t rows) {
  __m512 bias = _mm512_setzero_ps();
  for (std::size_t r = 0; r < rows; r += 16) {
    const __mmask16 m = coded_mask16(rows - r);
    const __m512 pr = _mm512_maskz_loadu_ps(m, p + r);
    _mm512_mask_storeu_ps(w + r, m, _mm512_mul_ps(pr, load_f16_avx512(vstep + r, m)));
    bias = _mm512_fmadd_ps(pr, load_f16_avx512(vmin + r, m), bias);
  }
  return _mm512_reduce_add_ps(bias);
}

// f32 rows in place. A decode step reads each key and value row once, from memory at long
// context or in a batch (a tile's rows were last touched a whole step ago).

/// How far ahead of the f32 key row being read its lines are requested.
inline constexpr std::size_t kF32PrefetchBytes = 4096;

/// A row of f32 keys [stride] (first hs used) · q [hs], as 16 partial sums. The key row
/// kF32PrefetchBytes ahead is requested, in the next block where this one ends before it (a
/// paged table's next block lies elsewhere; at most one block ahead, as the block after it is
/// not known), and the row's value line at the same time: p·v reads it right after this
/// tile's scores, and two streams in flight read faster than the keys and then the values.
struct F32RowDot {
  const float* q;
  const float* keys;    // [rows][stride]
  const float* values;  // [rows][stride]
  const float* next;    // the next block's keys [][stride], or null: past the end of keys
  std::size_t rows;
  std::size_t stride;
  std::size_t hs;
  std::size_t distance;  // kF32PrefetchBytes in rows, at least 1
  /// Requests row r's key row distance ahead and its value row.
  KVDECODE_TARGET_AVX512 KVDECODE_PREFETCH_INLINE void prefetch(std::size_t r) const {
    const std::size_t ahead = r + distance;
    const char* pf = reinterpret_cast<const char*>(ahead < rows || next == nullptr
                                                       ? keys + ahead * stride
                                                       : next + std::min(ahead - rows, r) * stride);
    const char* value = reinterpret_cast<const char*>(values + r * stride);
    for (std::size_t b = 0; b < hs * sizeof(float); b += 64) {
      _mm_prefetch(pf + b, _MM_HINT_T0);
      _mm_prefetch(value + b, _MM_HINT_T1);
    }
  }
  KVDECODE_TARGET_AVX512 __m512 operator()(std::size_t r) const {
    const float* row = keys + r * stride;
    prefetch(r);
    __m512 a = _mm512_setzero_ps();
    std::size_t c = 0;
    for (; c + 16 <= hs; c += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(row + c), a);
    if (c < hs) {
      const __mmask16 m = coded_mask16(hs - c);
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + c), _mm512_maskz_loadu_ps(m, row + c), a);
    }
    return a;
  }
};

/// q · row as 16 partial sums, q held in J registers (the last masked by tail): F32RowDot's
/// chain.
template <int J>
KVDECODE_TARGET_AVX512 inline __m512 f32_dot_avx512(const __m512* q, const float* row,
                                                    __mmask16 tail) {
  __m512 a = _mm512_setzero_ps();
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j)
    a = _mm512_fmadd_ps(
        q[j], j + 1 < J ? _mm512_loadu_ps(row + 16 * j) : _mm512_maskz_loadu_ps(tail, row + 16 * j),
        a);
  return a;
}

/// The 16 lanes of scores of key rows [r0, r0 + count) (count ≤ 16) against a query held in J
/// registers: F32RowDot's chains and coded_scores_avx512's reduction, without the scale. With
/// kPrefetch each row's lines are requested as it is read (F32RowDot::prefetch).
template <int J, bool kPrefetch>
KVDECODE_TARGET_AVX512 inline __m512 f32_group_scores_avx512(const __m512* qv,
                                                             const F32RowDot& rows_at,
                                                             std::size_t r0, std::size_t count,
                                                             __mmask16 tail) {
  const float* k0 = rows_at.keys + r0 * rows_at.stride;
  __m512 acc[16];
  if (count == 16) {
    KVDECODE_UNROLL
    for (std::size_t i = 0; i < 16; ++i) {
      if constexpr (kPrefetch) rows_at.prefetch(r0 + i);
      acc[i] = f32_dot_avx512<J>(qv, k0 + i * rows_at.stride, tail);
    }
  } else {
    for (std::size_t i = 0; i < 16; ++i) {
      if (i >= count) {
        acc[i] = _mm512_setzero_ps();
        continue;
      }
      if constexpr (kPrefetch) rows_at.prefetch(r0 + i);
      acc[i] = f32_dot_avx512<J>(qv, k0 + i * rows_at.stride, tail);
    }
  }
  // + 0 as coded_scores_avx512 adds its bias: the same bits, a -0 sum included.
  return _mm512_add_ps(reduce16_avx512(acc), _mm512_setzero_ps());
}

/// The query heads that share a kv head, read together: s [heads][s_stride] (first rows of
/// each) = q [heads][hs] · keys [rows][stride] · scale, head by head the bits of F32RowDot in
/// coded_scores_avx512. Each group of 16 key rows is read from memory (its lines requested as
/// the first head reads it) and then scored for the other heads from L1.
template <int J>
KVDECODE_TARGET_AVX512 inline void f32_heads_scores_avx512(float* s, std::size_t s_stride,
                                                           const float* q, std::size_t heads,
                                                           const F32RowDot& rows_at, float scale) {
  const std::size_t hs = rows_at.hs, rows = rows_at.rows;
  const __mmask16 tail = coded_mask16(hs - 16 * (J - 1));
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::size_t r0 = 0; r0 < rows; r0 += 16) {
    const std::size_t count = rows - r0 < 16 ? rows - r0 : 16;
    const __mmask16 m = coded_mask16(count);
    for (std::size_t h = 0; h < heads; ++h) {
      __m512 qv[J];
      KVDECODE_UNROLL
      for (int j = 0; j < J; ++j)
        qv[j] = j + 1 < J ? _mm512_loadu_ps(q + h * hs + 16 * j)
                          : _mm512_maskz_loadu_ps(tail, q + h * hs + 16 * j);
      const __m512 sum = h == 0 ? f32_group_scores_avx512<J, true>(qv, rows_at, r0, count, tail)
                                : f32_group_scores_avx512<J, false>(qv, rows_at, r0, count, tail);
      _mm512_mask_storeu_ps(s + h * s_stride + r0, m, _mm512_mul_ps(sum, vs));
    }
  }
}

/// f32_heads_scores_avx512<J> for J = 1..8 (head sizes up to 128), by J - 1.
template <std::size_t... I>
constexpr auto f32_heads_scores_table(std::index_sequence<I...>) {
  return std::array{&f32_heads_scores_avx512<static_cast<int>(I) + 1>...};
}
inline constexpr auto kF32HeadsScores = f32_heads_scores_table(std::make_index_sequence<8>{});

/// o [heads][hs] += Σ_r p [h][p_stride] [r] · v [r][stride], channels [d0, d0 + 16·J) of H
/// heads: one multiply-add chain per 16 channels and head from o's value, rows in order (a row
/// arrives from memory slower than a chain step); the H heads' chains run side by side, so a
/// row's value lines are loaded once and H·J chains hide one another's latency.
template <int J, int H>
KVDECODE_TARGET_AVX512 inline void f32_heads_pv_chunk_avx512(float* o, const float* p,
                                                             std::size_t p_stride, const float* v,
                                                             std::size_t stride, std::size_t rows,
                                                             std::size_t hs, std::size_t d0) {
  __mmask16 m[J];
  __m512 acc[H][J];
  KVDECODE_UNROLL
  for (int j = 0; j < J; ++j) m[j] = coded_mask16(hs - d0 - 16 * static_cast<std::size_t>(j));
  KVDECODE_UNROLL
  for (int h = 0; h < H; ++h) KVDECODE_UNROLL
  for (int j = 0; j < J; ++j)
    acc[h][j] = _mm512_maskz_loadu_ps(
        m[j], o + static_cast<std::size_t>(h) * hs + d0 + 16 * static_cast<std::size_t>(j));
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = v + r * stride + d0;
    __m512 vr[J];
    KVDECODE_UNROLL
    for (int j = 0; j < J; ++j)
      vr[j] = _mm512_maskz_loadu_ps(m[j], row + 16 * static_cast<std::size_t>(j));
    KVDECODE_UNROLL
    for (int h = 0; h < H; ++h) {
      const __m512 wb = _mm512_set1_ps(p[static_cast<std::size_t>(h) * p_stride + r]);
      KVDECODE_UNROLL
      for (int j = 0; j < J; ++j) acc[h][j] = _mm512_fmadd_ps(wb, vr[j], acc[h][j]);
    }
  }
  KVDECODE_UNROLL
  for (int h = 0; h < H; ++h) KVDECODE_UNROLL
  for (int j = 0; j < J; ++j)
    _mm512_mask_storeu_ps(
        o + static_cast<std::size_t>(h) * hs + d0 + 16 * static_cast<std::size_t>(j), m[j],
        acc[h][j]);
}

/// f32_heads_pv_chunk_avx512 for H = 1..4 heads at a time.
template <int J>
KVDECODE_TARGET_AVX512 inline void f32_heads_pv_chunks_avx512(float* o, const float* p,
                                                              std::size_t p_stride, const float* v,
                                                              std::size_t stride, std::size_t rows,
                                                              std::size_t hs, std::size_t heads,
                                                              std::size_t d0) {
  for (std::size_t h = 0; h < heads;) {
    float* oh = o + h * hs;
    const float* ph = p + h * p_stride;
    switch (heads - h) {
      case 1:
        f32_heads_pv_chunk_avx512<J, 1>(oh, ph, p_stride, v, stride, rows, hs, d0);
        h += 1;
        break;
      case 2:
        f32_heads_pv_chunk_avx512<J, 2>(oh, ph, p_stride, v, stride, rows, hs, d0);
        h += 2;
        break;
      case 3:
        f32_heads_pv_chunk_avx512<J, 3>(oh, ph, p_stride, v, stride, rows, hs, d0);
        h += 3;
        break;
      default:
        f32_heads_pv_chunk_avx512<J, 4>(oh, ph, p_stride, v, stride, rows, hs, d0);
        h += 4;
        break;
    }
  }
}

/// o [heads][hs] += Σ_r p [h][p_stride] [r] · v [r][stride], 64 channels at a time; each head's
/// bits the same whatever `heads`.
KVDECODE_TARGET_AVX512 inline void f32_heads_pv_avx512(float* o, const float* p,
                                                       std::size_t p_stride, const float* v,
                                                       std::size_t stride, std::size_t rows,
                                                       std::size_t hs, std::size_t heads) {
  for (std::size_t d0 = 0; d0 < hs; d0 += 64) {
    const std::size_t left = hs - d0;
    if (left > 48) {
      f32_heads_pv_chunks_avx512<4>(o, p, p_stride, v, stride, rows, hs, heads, d0);
    } else if (left > 32) {
      f32_heads_pv_chunks_avx512<3>(o, p, p_stride, v, stride, rows, hs, heads, d0);
    } else if (left > 16) {
      f32_heads_pv_chunks_avx512<2>(o, p, p_stride, v, stride, rows, hs, heads, d0);
    } else {
      f32_heads_pv_chunks_avx512<1>(o, p, p_stride, v, stride, rows, hs, heads, d0);
    }
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// Whether set ks has the kernels above (in the others the coded stores decode rows into
/// scratch, and f32 rows take Eigen's or attention_products.hpp's products, which are faster
/// than plain loops).
constexpr bool coded_attention_kernels(KernelSet ks) {
  return KVDECODE_X86_KERNELS && (ks == KernelSet::kAvx512 || ks == KernelSet::kAvx512Bf16);
}

/// Whether set ks rounds the query for 8-bit key codes (int8_query_vnni).
constexpr bool int8_query_rounded(KernelSet ks, std::size_t hs) {
  return KVDECODE_X86_KERNELS && ks == KernelSet::kAvx512Bf16 && hs <= kMaxVnniInt8HeadSize;
}

/// The query prepared once for coded_scores_int8 with the same set: in the sets that round it
/// (int8_query_rounded), written to qv [int8_query_floats(hs)]; the others read q itself.
inline void int8_query(KernelSet ks, float* qv, const float* q, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (int8_query_rounded(ks, hs)) return int8_query_vnni(qv, q, hs);
#endif
  static_cast<void>(ks), static_cast<void>(qv), static_cast<void>(q), static_cast<void>(hs);
}

/// s [rows] = (kstep [r] · (q [hs] · codes [rows][hs]) + kmin [r] · qsum) · scale (ranges
/// f16), with set ks; qsum = Σ q and qv = int8_query(ks, .., q, hs), computed once per query by
/// the caller.
inline void coded_scores_int8(KernelSet ks, float* s, const float* q, const float* qv, float qsum,
                              const std::uint8_t* codes, const std::uint16_t* kmin,
                              const std::uint16_t* kstep, std::size_t rows, std::size_t hs,
                              float scale) {
#if KVDECODE_X86_KERNELS
  if (int8_query_rounded(ks, hs))
    return int8_scores_vnni(s, qv, qsum, codes, kmin, kstep, rows, hs, scale);
  if (coded_attention_kernels(ks))
    return coded_scores_avx512(s, 0.0f, kmin, kstep, qsum, rows, scale, Int8RowDot{q, codes, hs});
#endif
  static_cast<void>(ks), static_cast<void>(qv);
  coded_scores_int8_portable(s, q, qsum, codes, kmin, kstep, rows, hs, scale);
}

/// coded_scores_int8 for the query heads that share the kv head of codes: s [heads][s_stride]
/// (first rows of each), head h's query at q + h · q_stride, qv + h · qv_stride and qsum
/// [h · qsum_stride]; each head's bits are coded_scores_int8's.
inline void coded_heads_scores_int8(KernelSet ks, float* s, std::size_t s_stride, const float* q,
                                    std::size_t q_stride, const float* qv, std::size_t qv_stride,
                                    const float* qsum, std::size_t qsum_stride, std::size_t heads,
                                    const std::uint8_t* codes, const std::uint16_t* kmin,
                                    const std::uint16_t* kstep, std::size_t rows, std::size_t hs,
                                    float scale) {
#if KVDECODE_X86_KERNELS
  if (heads > 1 && int8_query_rounded(ks, hs))
    return int8_heads_scores_vnni(s, s_stride, qv, qv_stride, qsum, qsum_stride, heads, codes, kmin,
                                  kstep, rows, hs, scale);
#endif
  for (std::size_t h = 0; h < heads; ++h)
    coded_scores_int8(ks, s + h * s_stride, q + h * q_stride, qv + h * qv_stride,
                      qsum[h * qsum_stride], codes, kmin, kstep, rows, hs, scale);
}

/// o [hs] += Σ_r p [r] · (vmin [r] + vstep [r] · codes [r][hs]) (ranges f16), with set ks; w
/// [round_up(rows, 16)] is scratch. In the avx512bf16 set (up to kMaxVnniRows rows) the weights
/// p · vstep are rounded to 15 bits for integer sums (int8_pv_vnni).
inline void coded_pv_int8(KernelSet ks, float* o, const float* p, float* w,
                          const std::uint8_t* codes, const std::uint16_t* vmin,
                          const std::uint16_t* vstep, std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx512Bf16 && rows <= kMaxVnniRows)
    return int8_pv_vnni(o, p, codes, vmin, vstep, rows, hs, w);
  if (coded_attention_kernels(ks)) {
    const float bias = low_bit_weights_avx512(w, p, vmin, vstep, rows);
    return coded_pv_avx512<std::uint8_t, 1>(o, w, codes, rows, hs, bias, WidenInt8Avx512{});
  }
#endif
  static_cast<void>(ks), static_cast<void>(w);
  coded_pv_low_bit_portable(o, p, codes, 8, vmin, vstep, rows, hs);
}

/// coded_pv_int8 for the query heads that share the kv head of codes: o [heads][o_stride] (first
/// hs of each) += Σ_r p_h [r] · (vmin [r] + vstep [r] · codes [r][hs]), p_h = p + h · p_stride;
/// w [coded_pv_scratch_floats(rows)] is scratch. Each head's bits are coded_pv_int8's.
inline void coded_heads_pv_int8(KernelSet ks, float* o, std::size_t o_stride, const float* p,
                                std::size_t p_stride, std::size_t heads, float* w,
                                const std::uint8_t* codes, const std::uint16_t* vmin,
                                const std::uint16_t* vstep, std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (heads > 1 && ks == KernelSet::kAvx512Bf16 && rows <= kMaxVnniRows)
    return int8_heads_pv_vnni(o, o_stride, p, p_stride, heads, codes, vmin, vstep, rows, hs,
                              reinterpret_cast<std::int16_t*>(w));
#endif
  for (std::size_t h = 0; h < heads; ++h)
    coded_pv_int8(ks, o + h * o_stride, p + h * p_stride, w, codes, vmin, vstep, rows, hs);
}

/// The query folded with a group's key ranges (f16) for coded_scores_low_bit with the same set
/// and bits: qs [round_up(hs, 32)] = q ⊙ kstep (4-bit in the avx512 set: in the halves its
/// kernel reads; in the avx512bf16 set: rounded to int8, q4_query_vnni), returns q · kmin.
inline float low_bit_query(KernelSet ks, float* qs, const float* q, const std::uint16_t* kmin,
                           const std::uint16_t* kstep, unsigned bits, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx512Bf16 && bits == 4) return q4_query_vnni(qs, q, kmin, kstep, hs);
  if (coded_attention_kernels(ks) && bits == 4) return q4_query_avx512(qs, q, kmin, kstep, hs);
#endif
  static_cast<void>(ks), static_cast<void>(bits);
  return low_bit_query_portable(qs, q, kmin, kstep, hs);
}

/// s [rows] = (qm + qs · codes [rows][hs · bits / 8]) · scale, with set ks and qs, qm from
/// low_bit_query.
inline void coded_scores_low_bit(KernelSet ks, float* s, const float* qs, float qm,
                                 const std::uint8_t* codes, unsigned bits, std::size_t rows,
                                 std::size_t hs, float scale) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx512Bf16 && bits == 4)
    return q4_scores_vnni(s, qs, qm, codes, rows, hs, scale);
  if (coded_attention_kernels(ks) && bits == 4)
    return coded_scores_avx512(s, qm, nullptr, nullptr, 0.0f, rows, scale, Q4RowDot{qs, codes, hs});
#endif
  static_cast<void>(ks);
  coded_scores_low_bit_portable(s, qs, qm, codes, bits, rows, hs, scale);
}

/// coded_scores_low_bit for the query heads that share the kv head of codes: s [heads][s_stride]
/// (first rows of each), head h with qs + h · qs_stride and qm [h · qm_stride] from
/// low_bit_query; each head's bits are coded_scores_low_bit's.
inline void coded_heads_scores_low_bit(KernelSet ks, float* s, std::size_t s_stride,
                                       const float* qs, std::size_t qs_stride, const float* qm,
                                       std::size_t qm_stride, std::size_t heads,
                                       const std::uint8_t* codes, unsigned bits, std::size_t rows,
                                       std::size_t hs, float scale) {
#if KVDECODE_X86_KERNELS
  if (heads > 1 && ks == KernelSet::kAvx512Bf16 && bits == 4)
    return q4_heads_scores_vnni(s, s_stride, qs, qs_stride, qm, qm_stride, heads, codes, rows, hs,
                                scale);
#endif
  for (std::size_t h = 0; h < heads; ++h)
    coded_scores_low_bit(ks, s + h * s_stride, qs + h * qs_stride, qm[h * qm_stride], codes, bits,
                         rows, hs, scale);
}

/// o [hs] += Σ_r p [r] · (vmin [r] + vstep [r] · codes [r]) (ranges f16), with set ks; w
/// [round_up(rows, 16)] is scratch. In the avx512bf16 set 4-bit weights are rounded as
/// coded_pv_int8's (q4_pv_vnni).
inline void coded_pv_low_bit(KernelSet ks, float* o, const float* p, float* w,
                             const std::uint8_t* codes, unsigned bits, const std::uint16_t* vmin,
                             const std::uint16_t* vstep, std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx512Bf16 && bits == 4 && rows <= kMaxVnniRows)
    return q4_pv_vnni(o, p, codes, vmin, vstep, rows, hs, w);
  if (coded_attention_kernels(ks) && bits == 4) {
    const float bias = low_bit_weights_avx512(w, p, vmin, vstep, rows);
    return q4_pv_avx512(o, w, codes, rows, hs, bias);
  }
#endif
  static_cast<void>(ks), static_cast<void>(w);
  coded_pv_low_bit_portable(o, p, codes, bits, vmin, vstep, rows, hs);
}

/// coded_pv_low_bit for the query heads that share the kv head of codes: o [heads][o_stride]
/// (first hs of each) += Σ_r p_h [r] · (vmin [r] + vstep [r] · codes [r]), p_h = p + h ·
/// p_stride; w [coded_pv_scratch_floats(rows)] is scratch. Each head's bits are
/// coded_pv_low_bit's.
inline void coded_heads_pv_low_bit(KernelSet ks, float* o, std::size_t o_stride, const float* p,
                                   std::size_t p_stride, std::size_t heads, float* w,
                                   const std::uint8_t* codes, unsigned bits,
                                   const std::uint16_t* vmin, const std::uint16_t* vstep,
                                   std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (heads > 1 && ks == KernelSet::kAvx512Bf16 && bits == 4 && rows <= kMaxVnniRows)
    return q4_heads_pv_vnni(o, o_stride, p, p_stride, heads, codes, vmin, vstep, rows, hs,
                            reinterpret_cast<std::int16_t*>(w));
#endif
  for (std::size_t h = 0; h < heads; ++h)
    coded_pv_low_bit(ks, o + h * o_stride, p + h * p_stride, w, codes, bits, vmin, vstep, rows, hs);
}

/// s [heads][s_stride] (first rows of each) = q [heads][hs] · keys [rows][stride] (first hs of
/// each row) · scale, with set ks, for the query heads that share the kv head of keys: values
/// [rows][stride] are the rows p·v will read next and next_keys the next block's keys (or null),
/// both requested while the keys are read. Each head's bits are the same whatever `heads`.
inline void f32_heads_scores(KernelSet ks, float* s, std::size_t s_stride, const float* q,
                             std::size_t heads, const float* keys, const float* values,
                             const float* next_keys, std::size_t stride, std::size_t rows,
                             std::size_t hs, float scale) {
#if KVDECODE_X86_KERNELS
  if (coded_attention_kernels(ks)) {
    const F32RowDot rows_at{
        q,    keys,   values, next_keys,
        rows, stride, hs,     (kF32PrefetchBytes / sizeof(float) + stride - 1) / stride};
    if (const std::size_t j = (hs + 15) / 16; j <= kF32HeadsScores.size())
      return kF32HeadsScores[j - 1](s, s_stride, q, heads, rows_at, scale);
    for (std::size_t h = 0; h < heads; ++h) {  // a query too long to keep in registers
      F32RowDot head = rows_at;
      head.q = q + h * hs;
      coded_scores_avx512(s + h * s_stride, 0.0f, nullptr, nullptr, 0.0f, rows, scale, head);
    }
    return;
  }
#endif
  static_cast<void>(ks), static_cast<void>(values), static_cast<void>(next_keys);
  for (std::size_t h = 0; h < heads; ++h)
    f32_row_scores_portable(s + h * s_stride, q + h * hs, keys, stride, rows, hs, scale);
}

/// f32_heads_scores for one head: s [rows].
inline void f32_row_scores(KernelSet ks, float* s, const float* q, const float* keys,
                           const float* values, const float* next_keys, std::size_t stride,
                           std::size_t rows, std::size_t hs, float scale) {
  f32_heads_scores(ks, s, rows, q, 1, keys, values, next_keys, stride, rows, hs, scale);
}

/// o [heads][hs] += Σ_r p [h][p_stride] [r] · values [r][stride] (first hs of each row), with
/// set ks, for the query heads that share the kv head of values: one chain per channel in row
/// order, so each head's bits are the same whatever `heads`, and whether rows [a, c) come in
/// one call or as [a, b) and [b, c).
inline void f32_heads_pv(KernelSet ks, float* o, const float* p, std::size_t p_stride,
                         const float* values, std::size_t stride, std::size_t rows, std::size_t hs,
                         std::size_t heads) {
#if KVDECODE_X86_KERNELS
  if (coded_attention_kernels(ks))
    return f32_heads_pv_avx512(o, p, p_stride, values, stride, rows, hs, heads);
#endif
  static_cast<void>(ks);
  for (std::size_t h = 0; h < heads; ++h)
    f32_row_pv_portable(o + h * hs, p + h * p_stride, values, stride, rows, hs);
}

/// f32_heads_pv for one head: o [hs].
inline void f32_row_pv(KernelSet ks, float* o, const float* p, const float* values,
                       std::size_t stride, std::size_t rows, std::size_t hs) {
  f32_heads_pv(ks, o, p, rows, values, stride, rows, hs, 1);
}

}  // namespace kvdecode::detail
