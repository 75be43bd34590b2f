// Attention's two matrix products, in the run-time kernel sets, for builds whose Eigen is
// narrower than the CPU (a consumer built without -march flags gets SSE2 Eigen):
//   pack_keys  kt [hs][ld] columns [col, col+rows) = k [rows][hs]ᵀ (a key tile, transposed once
//              and read by every query and every query head that shares the kv head);
//   scores     s [n][cols] = q [n][hs] · kt [hs][cols] · scale;
//   pv         o [n][hs] += p [n][rows] · v [rows][hs] (the block's sum, then added to o).
// Every output is a plain sum over head_size (scores) or keys (pv) in index order; only the
// x86 sets have kernels here (the portable set keeps Eigen).
#pragma once

#include <cstddef>
#include <type_traits>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"         // eigen_gemm_as_wide, KVDECODE_UNROLL (gemv.hpp)
#include "kvdecode/detail/gemm_packed.hpp"  // load_widened_avx512
#include "kvdecode/detail/transpose.hpp"

namespace kvdecode::detail {

/// kt [hs][ld] columns [col, col + rows) = keys [rows][stride] (first hs of each row), transposed.
template <class T>
inline void pack_keys(T* kt, std::size_t ld, std::size_t col, const T* keys, std::size_t stride,
                      std::size_t rows, std::size_t hs) {
  for (std::size_t c = 0; c < rows; ++c)
    for (std::size_t d = 0; d < hs; ++d) kt[d * ld + col + c] = keys[c * stride + d];
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// ---------------------------------------------------------------------------------------------
// AVX-512: queries R at a time against 32 key columns (R × 2 accumulators), and for p·v R
// queries against up to 64 head dimensions (R × 4 accumulators).
// ---------------------------------------------------------------------------------------------

template <int R>
KVDECODE_TARGET_AVX512 inline void scores_rows_avx512(float* s, std::size_t s_stride,
                                                      const float* q, std::size_t q_stride,
                                                      const float* kt, std::size_t ld,
                                                      std::size_t cols, std::size_t hs,
                                                      float scale) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::size_t c = 0; c < cols; c += 32) {
    const std::size_t left = cols - c;
    const auto m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    const auto m1 = static_cast<__mmask16>(left >= 32   ? 0xFFFFu
                                           : left <= 16 ? 0u
                                                        : (1u << (left - 16)) - 1u);
    __m512 acc0[R];
    __m512 acc1[R];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (std::size_t d = 0; d < hs; ++d) {
      const __m512 k0 = _mm512_maskz_loadu_ps(m0, kt + d * ld + c);
      const __m512 k1 = _mm512_maskz_loadu_ps(m1, kt + d * ld + c + 16);
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m512 qb = _mm512_set1_ps(q[static_cast<std::size_t>(i) * q_stride + d]);
        acc0[i] = _mm512_fmadd_ps(qb, k0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(qb, k1, acc1[i]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      float* row = s + static_cast<std::size_t>(i) * s_stride + c;
      _mm512_mask_storeu_ps(row, m0, _mm512_mul_ps(acc0[i], vs));
      _mm512_mask_storeu_ps(row + 16, m1, _mm512_mul_ps(acc1[i], vs));
    }
  }
}

KVDECODE_TARGET_AVX512 inline void scores_avx512(float* s, std::size_t s_stride, const float* q,
                                                 std::size_t q_stride, const float* kt,
                                                 std::size_t ld, std::size_t n, std::size_t cols,
                                                 std::size_t hs, float scale) {
  std::size_t r = 0;
  for (; r + 6 <= n; r += 6)
    scores_rows_avx512<6>(s + r * s_stride, s_stride, q + r * q_stride, q_stride, kt, ld, cols, hs,
                          scale);
  for (; r < n; ++r)
    scores_rows_avx512<1>(s + r * s_stride, s_stride, q + r * q_stride, q_stride, kt, ld, cols, hs,
                          scale);
}

template <int R>
KVDECODE_TARGET_AVX512 inline void pv_rows_avx512(float* o, std::size_t o_stride, const float* p,
                                                  std::size_t p_stride, const float* v,
                                                  std::size_t v_stride, std::size_t rows,
                                                  std::size_t hs) {
  for (std::size_t d0 = 0; d0 < hs; d0 += 64) {
    __mmask16 m[4];
    KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const std::size_t lo = d0 + 16 * static_cast<std::size_t>(j);
      const std::size_t left = hs > lo ? hs - lo : 0;
      m[j] = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    }
    __m512 acc[R][4];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (std::size_t c = 0; c < rows; ++c) {
      __m512 vv[4];
      KVDECODE_UNROLL
      for (int j = 0; j < 4; ++j)
        vv[j] = _mm512_maskz_loadu_ps(m[j], v + c * v_stride + d0 + 16 * j);
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m512 pb = _mm512_set1_ps(p[static_cast<std::size_t>(i) * p_stride + c]);
        KVDECODE_UNROLL
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(pb, vv[j], acc[i][j]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      float* out = o + static_cast<std::size_t>(i) * o_stride + d0 + 16 * j;
      _mm512_mask_storeu_ps(out, m[j], _mm512_add_ps(_mm512_maskz_loadu_ps(m[j], out), acc[i][j]));
    }
  }
}

KVDECODE_TARGET_AVX512 inline void pv_avx512(float* o, std::size_t o_stride, const float* p,
                                             std::size_t p_stride, const float* v,
                                             std::size_t v_stride, std::size_t n, std::size_t rows,
                                             std::size_t hs) {
  std::size_t r = 0;
  for (; r + 4 <= n; r += 4)
    pv_rows_avx512<4>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, v, v_stride, rows,
                      hs);
  for (; r < n; ++r)
    pv_rows_avx512<1>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, v, v_stride, rows,
                      hs);
}

// ---------------------------------------------------------------------------------------------
// AVX2: the same shapes at 8 lanes; tails through maskload/maskstore.
// ---------------------------------------------------------------------------------------------

/// Lanes [0, count) of an 8-lane mask (count ≥ 8 gives all of them).
KVDECODE_TARGET_AVX2 inline __m256i lane_mask_avx2(std::size_t count) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int c = count >= 8 ? 8 : static_cast<int>(count);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), idx);
}

template <int R>
KVDECODE_TARGET_AVX2 inline void scores_rows_avx2(float* s, std::size_t s_stride, const float* q,
                                                  std::size_t q_stride, const float* kt,
                                                  std::size_t ld, std::size_t cols, std::size_t hs,
                                                  float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (std::size_t c = 0; c < cols; c += 16) {
    const std::size_t left = cols - c;
    const __m256i m0 = lane_mask_avx2(left);
    const __m256i m1 = lane_mask_avx2(left > 8 ? left - 8 : 0);
    __m256 acc0[R];
    __m256 acc1[R];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    for (std::size_t d = 0; d < hs; ++d) {
      const __m256 k0 = _mm256_maskload_ps(kt + d * ld + c, m0);
      const __m256 k1 = _mm256_maskload_ps(kt + d * ld + c + 8, m1);
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m256 qb = _mm256_broadcast_ss(q + static_cast<std::size_t>(i) * q_stride + d);
        acc0[i] = _mm256_fmadd_ps(qb, k0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(qb, k1, acc1[i]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      float* row = s + static_cast<std::size_t>(i) * s_stride + c;
      _mm256_maskstore_ps(row, m0, _mm256_mul_ps(acc0[i], vs));
      _mm256_maskstore_ps(row + 8, m1, _mm256_mul_ps(acc1[i], vs));
    }
  }
}

KVDECODE_TARGET_AVX2 inline void scores_avx2(float* s, std::size_t s_stride, const float* q,
                                             std::size_t q_stride, const float* kt, std::size_t ld,
                                             std::size_t n, std::size_t cols, std::size_t hs,
                                             float scale) {
  std::size_t r = 0;
  for (; r + 4 <= n; r += 4)
    scores_rows_avx2<4>(s + r * s_stride, s_stride, q + r * q_stride, q_stride, kt, ld, cols, hs,
                        scale);
  for (; r < n; ++r)
    scores_rows_avx2<1>(s + r * s_stride, s_stride, q + r * q_stride, q_stride, kt, ld, cols, hs,
                        scale);
}

template <int R>
KVDECODE_TARGET_AVX2 inline void pv_rows_avx2(float* o, std::size_t o_stride, const float* p,
                                              std::size_t p_stride, const float* v,
                                              std::size_t v_stride, std::size_t rows,
                                              std::size_t hs) {
  for (std::size_t d0 = 0; d0 < hs; d0 += 32) {
    __m256i m[4];
    KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const std::size_t lo = d0 + 8 * static_cast<std::size_t>(j);
      m[j] = lane_mask_avx2(hs > lo ? hs - lo : 0);
    }
    __m256 acc[R][4];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (std::size_t c = 0; c < rows; ++c) {
      __m256 pb[R];
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i)
        pb[i] = _mm256_broadcast_ss(p + static_cast<std::size_t>(i) * p_stride + c);
      KVDECODE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256 vv = _mm256_maskload_ps(v + c * v_stride + d0 + 8 * j, m[j]);
        KVDECODE_UNROLL
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(pb[i], vv, acc[i][j]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      float* out = o + static_cast<std::size_t>(i) * o_stride + d0 + 8 * j;
      _mm256_maskstore_ps(out, m[j], _mm256_add_ps(_mm256_maskload_ps(out, m[j]), acc[i][j]));
    }
  }
}

KVDECODE_TARGET_AVX2 inline void pv_avx2(float* o, std::size_t o_stride, const float* p,
                                         std::size_t p_stride, const float* v, std::size_t v_stride,
                                         std::size_t n, std::size_t rows, std::size_t hs) {
  std::size_t r = 0;
  for (; r + 3 <= n; r += 3)
    pv_rows_avx2<3>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, v, v_stride, rows, hs);
  for (; r < n; ++r)
    pv_rows_avx2<1>(o + r * o_stride, o_stride, p + r * p_stride, p_stride, v, v_stride, rows, hs);
}

// ---------------------------------------------------------------------------------------------
// pack_keys in 16 × 16 (AVX-512) and 8 × 8 (AVX2) register transposes; stores are masked to the
// tile's columns [col, col + rows), which the next run's keys or the next row of kt follow.
// ---------------------------------------------------------------------------------------------

KVDECODE_TARGET_AVX512 inline void pack_keys_avx512(float* kt, std::size_t ld, std::size_t col,
                                                    const float* keys, std::size_t stride,
                                                    std::size_t rows, std::size_t hs) {
  for (std::size_t c0 = 0; c0 < rows; c0 += 16) {
    const std::size_t cn = std::min<std::size_t>(16, rows - c0);
    const auto cm = static_cast<__mmask16>(cn == 16 ? 0xFFFFu : (1u << cn) - 1u);
    for (std::size_t d0 = 0; d0 < hs; d0 += 16) {
      const std::size_t dn = std::min<std::size_t>(16, hs - d0);
      __m512i r[16];  // r[c]: key c0 + c, dimensions [d0, d0 + 16)
      for (std::size_t c = 0; c < 16; ++c)
        r[c] = c < cn ? load_widened_avx512(keys + (c0 + c) * stride + d0, dn)
                      : _mm512_setzero_si512();
      transpose_16x16(r);  // r[d]: dimension d0 + d of keys [c0, c0 + 16)
      for (std::size_t d = 0; d < dn; ++d)
        _mm512_mask_storeu_epi32(kt + (d0 + d) * ld + col + c0, cm, r[d]);
    }
  }
}

KVDECODE_TARGET_AVX2 inline void pack_keys_avx2(float* kt, std::size_t ld, std::size_t col,
                                                const float* keys, std::size_t stride,
                                                std::size_t rows, std::size_t hs) {
  for (std::size_t c0 = 0; c0 < rows; c0 += 8) {
    const std::size_t cn = std::min<std::size_t>(8, rows - c0);
    const __m256i cm = lane_mask_avx2(cn);
    for (std::size_t d0 = 0; d0 < hs; d0 += 8) {
      const std::size_t dn = std::min<std::size_t>(8, hs - d0);
      const __m256i dm = lane_mask_avx2(dn);
      __m256 r[8];  // r[c]: key c0 + c, dimensions [d0, d0 + 8)
      for (std::size_t c = 0; c < 8; ++c)
        r[c] = c < cn ? _mm256_maskload_ps(keys + (c0 + c) * stride + d0, dm) : _mm256_setzero_ps();
      transpose_8x8(r);  // r[d]: dimension d0 + d of keys [c0, c0 + 8)
      for (std::size_t d = 0; d < dn; ++d)
        _mm256_maskstore_ps(kt + (d0 + d) * ld + col + c0, cm, r[d]);
    }
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// pack_keys with set ks's transposes (the portable set: element by element).
inline void pack_keys(KernelSet ks, float* kt, std::size_t ld, std::size_t col, const float* keys,
                      std::size_t stride, std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2) return pack_keys_avx2(kt, ld, col, keys, stride, rows, hs);
  if (ks != KernelSet::kPortable) return pack_keys_avx512(kt, ld, col, keys, stride, rows, hs);
#endif
  static_cast<void>(ks);
  pack_keys(kt, ld, col, keys, stride, rows, hs);
}

/// Whether attention runs set ks's products here rather than Eigen's: f32, an x86 set, and
/// Eigen compiled narrower than the set (a native build keeps Eigen's GEMM).
template <class T>
constexpr bool attention_uses_kernels(KernelSet ks) {
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> && ks != KernelSet::kPortable &&
         !eigen_gemm_as_wide(ks);
}

/// Whether any set could take attention_uses_kernels (then the key tile's packing buffer exists).
template <class T>
constexpr bool attention_may_use_kernels() {
  for (const KernelSet ks : kKernelSets)
    if (attention_uses_kernels<T>(ks)) return true;
  return false;
}

/// s [n][cols] (row stride s_stride) = q [n][hs] (row stride q_stride) · kt [hs][cols] (row
/// stride ld) · scale, with set ks (the portable set: plain loops, for tests).
inline void attention_scores(KernelSet ks, float* s, std::size_t s_stride, const float* q,
                             std::size_t q_stride, const float* kt, std::size_t ld, std::size_t n,
                             std::size_t cols, std::size_t hs, float scale) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2)
    return scores_avx2(s, s_stride, q, q_stride, kt, ld, n, cols, hs, scale);
  if (ks != KernelSet::kPortable)
    return scores_avx512(s, s_stride, q, q_stride, kt, ld, n, cols, hs, scale);
#endif
  static_cast<void>(ks);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (std::size_t d = 0; d < hs; ++d) acc += q[r * q_stride + d] * kt[d * ld + c];
      s[r * s_stride + c] = acc * scale;
    }
}

/// o [n][hs] (row stride o_stride) += p [n][rows] (row stride p_stride) · v [rows][hs] (row
/// stride v_stride), with set ks (the portable set: plain loops, for tests).
inline void attention_pv(KernelSet ks, float* o, std::size_t o_stride, const float* p,
                         std::size_t p_stride, const float* v, std::size_t v_stride, std::size_t n,
                         std::size_t rows, std::size_t hs) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2) return pv_avx2(o, o_stride, p, p_stride, v, v_stride, n, rows, hs);
  if (ks != KernelSet::kPortable)
    return pv_avx512(o, o_stride, p, p_stride, v, v_stride, n, rows, hs);
#endif
  static_cast<void>(ks);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t d = 0; d < hs; ++d) {
      float acc = 0.0f;
      for (std::size_t c = 0; c < rows; ++c) acc += p[r * p_stride + c] * v[c * v_stride + d];
      o[r * o_stride + d] += acc;
    }
}

}  // namespace kvdecode::detail
