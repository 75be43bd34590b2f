// gemm_amx: prefill-sized projections of bf16 weights on AMX tiles, y [n][out] columns [c0, c1)
// = x [n][in] · w [c0..c1)[in]ᵀ. x is rounded to bf16 once per call into A rows [n][amx_lda(in)]
// (pack_x_amx); each thread re-lays panels of 32 weight rows into the pair-interleaved layout
// the B tiles take (pack_panel_amx), then runs 2 × 2 accumulator tiles of 16 tokens × 16 outputs
// over the panel. TDPBF16PS multiplies bf16 by bf16 exactly and sums in f32, so gemv.hpp's rule
// holds; every output sums `in` in index order, in pairs, in one f32 accumulator (with the
// instruction's flush of subnormal inputs and outputs).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"  // kPanelRows
#include "kvdecode/detail/transpose.hpp"

namespace kvdecode::detail {

/// Depth of one tile product: 32 bf16 = one 64-byte tile row.
inline constexpr std::size_t kAmxDepth = 32;

/// Weight rows in a panel: two B tiles of 16 outputs.
inline constexpr std::size_t kAmxPanelRows = 32;

/// Elements in one A row: `in` rounded up to whole tile rows (the padding holds zeros).
constexpr std::size_t amx_lda(std::size_t in) {
  return (in + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
}

/// Whether the AMX GEMM runs these types in set ks: f32 activations, bf16 weights, the
/// avx512bf16 set with AMX enabled, and in ≥ 16, so that the A rows [n][amx_lda(in)] of bf16 fit
/// in the f32 scratch [n][in] that holds x rounded on the other paths (and a panel of
/// 32 × amx_lda(in) bf16 in a thread's kPanelRows × in floats).
template <class T, class W>
bool amx_applies(KernelSet ks, std::size_t in) {
  return KVDECODE_AMX_KERNELS && std::is_same_v<T, float> && std::is_same_v<W, bf16> &&
         ks == KernelSet::kAvx512Bf16 && in >= 16 && amx_enabled();
}

#if KVDECODE_AMX_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// GCC's tile loads are asm statements that do not name the memory they read: the packed panel
/// must be stored before them, which this compiler barrier ensures.
inline void amx_memory_barrier() { __asm__ __volatile__("" ::: "memory"); }

/// The 64-byte operand of LDTILECFG (palette 1): tiles 0-3 accumulate 16 × 16 f32 (C), 4-5 hold
/// 16 × 32 bf16 of x (A), 6-7 hold 16 pairs × 16 outputs × 2 bf16 of weights (B). Tiles 0, 1, 4
/// take m0 token rows, tiles 2, 3, 5 take m1 (0: unused).
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

inline AmxTileConfig amx_config(std::size_t m0, std::size_t m1) {
  AmxTileConfig c;
  const auto set = [&](int tile, std::size_t rows) {
    c.rows[tile] = static_cast<std::uint8_t>(rows);
    c.colsb[tile] = rows == 0 ? 0 : 64;
  };
  for (const int t : {0, 1, 4}) set(t, m0);
  for (const int t : {2, 3, 5}) set(t, m1);
  set(6, 16);
  set(7, 16);
  return c;
}

/// panel [2][amx_lda(in) / 32][16][16][2] = w [cols][in] re-laid for B tiles: for each half of
/// the 32 outputs and each depth block of 32, row p holds (w[j][2p], w[j][2p + 1]) for the half's
/// 16 outputs j. Outputs past cols and depths past in are zero. (Each half is one block of 16
/// outputs × amx_lda(in), so consecutive panels lay out a whole matrix: pack_weights_amx.)
KVDECODE_TARGET_AMX inline void pack_panel_amx_avx512(bf16* panel, const bf16* w, std::size_t cols,
                                                      std::size_t in) {
  const std::size_t blocks = amx_lda(in) / kAmxDepth;
  for (std::size_t half = 0; half < 2; ++half)
    for (std::size_t kb = 0; kb < blocks; ++kb) {
      const std::size_t k0 = kb * kAmxDepth;
      const std::size_t left = std::min(kAmxDepth, in - k0);
      const auto m = static_cast<__mmask32>(left == 32 ? 0xFFFFFFFFu : (1u << left) - 1u);
      __m512i r[16];
      for (std::size_t i = 0; i < 16; ++i) {
        const std::size_t j = half * 16 + i;
        r[i] = j < cols ? _mm512_maskz_loadu_epi16(m, w + j * in + k0) : _mm512_setzero_si512();
      }
      transpose_16x16(r);
      bf16* dst = panel + half * 16 * amx_lda(in) + kb * 512;
      for (std::size_t p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 32, r[p]);
    }
}

/// C tiles over a panel (b0, b1: its two halves) for tokens [0, m0) (and [16, 16 + m1) when
/// kTwo), y [m0 (+16)][out] columns [0, cols) stored; the tiles are configured for m0 and m1
/// rows.
template <bool kTwo>
KVDECODE_TARGET_AMX inline void amx_block(float* y, std::size_t out, const bf16* a, std::size_t lda,
                                          const bf16* b0, const bf16* b1, std::size_t m0,
                                          std::size_t m1, std::size_t cols) {
  const auto a_stride = static_cast<long>(lda * sizeof(bf16));
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (std::size_t k = 0; k < lda; k += kAmxDepth) {
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_loadd(7, b1 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, a + 16 * lda + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const auto y_stride = static_cast<long>(out * sizeof(float));
  if (cols == kAmxPanelRows) {
    _tile_stored(0, y, y_stride);
    _tile_stored(1, y + 16, y_stride);
    if constexpr (kTwo) {
      _tile_stored(2, y + 16 * out, y_stride);
      _tile_stored(3, y + 16 * out + 16, y_stride);
    }
    return;
  }
  alignas(64) float c[4][16 * 16];  // [tile][16 tokens][16 outputs], the partial panel
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if constexpr (kTwo) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  const auto copy = [&](const float* tile, float* to, std::size_t rows, std::size_t from_col) {
    if (cols <= from_col) return;
    const std::size_t n_cols = std::min<std::size_t>(16, cols - from_col);
    for (std::size_t i = 0; i < rows; ++i)
      std::copy(tile + i * 16, tile + i * 16 + n_cols, to + i * out + from_col);
  };
  copy(c[0], y, m0, 0);
  copy(c[1], y, m0, 16);
  if constexpr (kTwo) {
    copy(c[2], y + 16 * out, m1, 0);
    copy(c[3], y + 16 * out, m1, 16);
  }
}

/// y [n][out] columns [c0, c1) = a [n][amx_lda(in)] · w [c0..c1)[in]ᵀ on this thread's tiles,
/// configured here and released at the end. Each panel of 32 weight rows is re-laid into panel
/// (kAmxPanelRows × amx_lda(in) bf16), unless `packed` holds the whole matrix re-laid already
/// (pack_weights_amx; c0 a multiple of 16).
KVDECODE_TARGET_AMX inline void gemm_amx_tiles(float* y, const bf16* a, const bf16* w,
                                               std::size_t n, std::size_t in, std::size_t out,
                                               std::size_t c0, std::size_t c1, bf16* panel,
                                               const bf16* packed) {
  const std::size_t lda = amx_lda(in);
  const std::size_t whole = n / 32 * 32;  // tokens run as two full 16-row tiles
  const std::size_t rest = n - whole;
  const AmxTileConfig body = amx_config(16, 16);
  const AmxTileConfig tail = amx_config(std::min<std::size_t>(rest, 16), rest > 16 ? rest - 16 : 0);
  const AmxTileConfig* loaded = nullptr;  // the configuration in the tiles now
  for (std::size_t b = c0; b < c1; b += kAmxPanelRows) {
    const std::size_t cols = std::min(kAmxPanelRows, c1 - b);
    const bf16* b0 = packed == nullptr ? panel : packed + b / 16 * 16 * lda;
    if (packed == nullptr) pack_panel_amx_avx512(panel, w + b * in, cols, in);
    const bf16* b1 = b0 + 16 * lda;
    amx_memory_barrier();
    if (whole > 0 && loaded != &body) {  // (a lambda would not inherit the target attribute)
      _tile_loadconfig(&body);
      loaded = &body;
    }
    for (std::size_t t = 0; t < whole; t += 32)
      amx_block<true>(y + t * out + b, out, a + t * lda, lda, b0, b1, 16, 16, cols);
    if (rest > 0) {
      if (loaded != &tail) {
        _tile_loadconfig(&tail);
        loaded = &tail;
      }
      const std::size_t t = whole;
      if (rest > 16)
        amx_block<true>(y + t * out + b, out, a + t * lda, lda, b0, b1, 16, rest - 16, cols);
      else
        amx_block<false>(y + t * out + b, out, a + t * lda, lda, b0, b1, rest, 0, cols);
    }
  }
  if (loaded != nullptr) _tile_release();
}

/// packed [amx_packed_size(out, in)] = w [out][in] re-laid as consecutive panels.
KVDECODE_TARGET_AMX inline void pack_weights_amx_avx512(bf16* packed, const bf16* w,
                                                        std::size_t out, std::size_t in) {
  for (std::size_t b = 0; b < out; b += kAmxPanelRows)
    pack_panel_amx_avx512(packed + b * amx_lda(in), w + b * in, std::min(kAmxPanelRows, out - b),
                          in);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_AMX_KERNELS

/// Rounds x [n][in] to bf16 into a [n][amx_lda(in)] (amx_applies must hold: the AVX-512 kernel).
inline void pack_x_amx(bf16* a, const float* x, std::size_t n, std::size_t in) {
#if KVDECODE_AMX_KERNELS
  round_rows_bf16_avx512bf16(a, amx_lda(in), x, n, in);
#else
  static_cast<void>(a), static_cast<void>(x), static_cast<void>(n), static_cast<void>(in);
#endif
}

/// Elements of w [out][in] re-laid whole (pack_weights_amx): 32-row panels, plus a zero block of
/// 16 so that a panel may start at the last block.
constexpr std::size_t amx_packed_size(std::size_t out, std::size_t in) {
  return ((out + 31) / 32 * 32 + 16) * amx_lda(in);
}

/// packed [amx_packed_size(out, in)] = w [out][in] re-laid for the B tiles once (amx_applies
/// must hold), for gemm_amx's `packed`.
inline void pack_weights_amx(bf16* packed, const bf16* w, std::size_t out, std::size_t in) {
#if KVDECODE_AMX_KERNELS
  std::fill(packed, packed + amx_packed_size(out, in), bf16());
  pack_weights_amx_avx512(packed, w, out, in);
#else
  static_cast<void>(packed), static_cast<void>(w), static_cast<void>(out), static_cast<void>(in);
#endif
}

/// y [n][out] columns [c0, c1) = a · w [c0..c1)[in]ᵀ with a from pack_x_amx (amx_applies must
/// hold), re-laying each panel of w on this thread's panel of kAmxPanelRows × amx_lda(in) bf16,
/// or reading w re-laid already from `packed` (pack_weights_amx) when given.
inline void gemm_amx(float* y, const bf16* a, const bf16* w, std::size_t n, std::size_t in,
                     std::size_t out, std::size_t c0, std::size_t c1, bf16* panel,
                     const bf16* packed = nullptr) {
#if KVDECODE_AMX_KERNELS
  gemm_amx_tiles(y, a, w, n, in, out, c0, c1, panel, packed);
#else
  static_cast<void>(y), static_cast<void>(a), static_cast<void>(w), static_cast<void>(n);
  static_cast<void>(in), static_cast<void>(out), static_cast<void>(c0), static_cast<void>(c1);
  static_cast<void>(panel), static_cast<void>(packed);
#endif
}

}  // namespace kvdecode::detail
