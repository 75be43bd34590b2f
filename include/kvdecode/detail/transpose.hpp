// Register transposes of 32-bit lanes: a 16 × 16 block in 16 zmm (AVX-512) and an 8 × 8 block in
// 8 ymm (AVX2), in place. Every kernel that lays rows out as columns (packed GEMM panels, lane
// tiles, AMX panels, attention's key tiles) transposes through these.
#pragma once

#include "kvdecode/detail/cpu.hpp"

namespace kvdecode::detail {

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// v [16] rows of 16 floats → v [16] columns (lane c of row r ↔ lane r of row c).
KVDECODE_TARGET_AVX512 inline void transpose_16x16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  __m512 u[16];  // u[4j + m], 128-bit lane L: rows 4j .. 4j+3 of column 4L + m
  for (int j = 0; j < 4; ++j) {
    u[4 * j + 0] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
    u[4 * j + 1] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
    u[4 * j + 2] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
    u[4 * j + 3] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);       // lanes 0, 2 of each
    const __m512 b = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);       // lanes 1, 3 of each
    const __m512 c = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);  // lanes 0, 2 of each
    const __m512 d = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);  // lanes 1, 3 of each
    v[m] = _mm512_shuffle_f32x4(a, c, 0x88);
    v[8 + m] = _mm512_shuffle_f32x4(a, c, 0xDD);
    v[4 + m] = _mm512_shuffle_f32x4(b, d, 0x88);
    v[12 + m] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

/// The same for 32-bit lanes held as integers (widened bf16 bits, raw bf16 pairs).
KVDECODE_TARGET_AVX512 inline void transpose_16x16(__m512i r[16]) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_castsi512_ps(r[i]);
  transpose_16x16(v);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(v[i]);
}

/// v [8] rows of 8 floats → v [8] columns.
KVDECODE_TARGET_AVX2 inline void transpose_8x8(__m256 v[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  __m256 u[8];  // u[4j + m], 128-bit lane L: rows 4j .. 4j+3 of column 4L + m
  for (int j = 0; j < 2; ++j) {
    u[4 * j + 0] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
    u[4 * j + 1] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
    u[4 * j + 2] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
    u[4 * j + 3] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    v[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    v[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

}  // namespace kvdecode::detail
