// The row-interleaved layout the block-format projections run on: a Q8_0 / Q4_0 matrix
// [out][in / 32] is rearranged in place, once at load, into groups of kGroupRows rows whose
// blocks sit side by side, so one 32-byte load feeds every row of the group with the same four
// inputs, the group's eight scales convert as one vector and the outputs come out in lanes
// (llama.cpp's CPU "repack" buffers interleave rows for the same reason). Bytes are only moved,
// never added: the matrix keeps its size, and rows past the last whole group stay as stored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvdecode/weight_blocks.hpp"

namespace kvdecode::detail {

/// Rows per interleaved group: one int32 lane each in a 256-bit register.
inline constexpr std::size_t kGroupRows = 8;

/// Input codes each lane's vpdpbusd / madd sums: the interleave's unit.
inline constexpr std::size_t kGroupUnit = 4;

/// Group g's blocks fill the bytes its kGroupRows rows held, block b at b × kGroupRows ×
/// sizeof(B) from the group's start, each (kGroupRows × sizeof(B) bytes):
///   d   [8] binary16: row r's scale,
///   Q8_0 codes [8 units][8 rows][4]: code 4u + i of row r, stored as code + 128 (unsigned, what
///        vpdpbusd's unsigned side takes; the kernels subtract 128 × the input's block sum);
///   Q4_0 bytes [4 units][8 rows][4]: byte 4u + i of row r's qs as stored (low nibble: code
///        4u + i, high nibble: code 16 + 4u + i).
template <class B>
struct GroupLayout {
  static constexpr std::size_t kScaleBytes = kGroupRows * sizeof(std::uint16_t);
  static constexpr std::size_t kCodeBytes = kGroupRows * sizeof(B::qs);
  static constexpr std::size_t kBytes = kScaleBytes + kCodeBytes;  // = kGroupRows × sizeof(B)
  static constexpr std::size_t kUnits = kCodeBytes / (kGroupRows * kGroupUnit);  // 8 or 4
  static_assert(kBytes == kGroupRows * sizeof(B));
};

/// Whole groups of a matrix with `out` rows; rows from groups × kGroupRows on stay row-major.
inline std::size_t whole_groups(std::size_t out) { return out / kGroupRows; }

/// The bytes of group g's block b in matrix m [out][nb] (repacked).
template <class B>
inline const std::uint8_t* group_block(const B* m, std::size_t nb, std::size_t g, std::size_t b) {
  return reinterpret_cast<const std::uint8_t*>(m) + (g * nb + b) * GroupLayout<B>::kBytes;
}

/// m [out][nb] blocks, row-major as ggml stores them → the row-group layout, in place.
/// scratch is resized to one group's blocks.
template <class B>
void repack_row_groups(B* m, std::size_t out, std::size_t nb, std::vector<B>& scratch) {
  static_assert(kIsBlockFormat<B>);
  using L = GroupLayout<B>;
  scratch.resize(kGroupRows * nb);  // [8][nb] the group's rows as stored
  auto* const bytes = reinterpret_cast<std::uint8_t*>(m);
  for (std::size_t g = 0; g < whole_groups(out); ++g) {
    std::memcpy(scratch.data(), m + g * kGroupRows * nb, kGroupRows * nb * sizeof(B));
    for (std::size_t b = 0; b < nb; ++b) {
      std::uint8_t* const dst = bytes + (g * nb + b) * L::kBytes;
      for (std::size_t r = 0; r < kGroupRows; ++r) {
        const B& blk = scratch[r * nb + b];
        std::memcpy(dst + r * sizeof(std::uint16_t), &blk.d, sizeof(std::uint16_t));
        for (std::size_t u = 0; u < L::kUnits; ++u) {
          for (std::size_t i = 0; i < kGroupUnit; ++i) {
            const std::size_t at = L::kScaleBytes + (u * kGroupRows + r) * kGroupUnit + i;
            std::uint8_t v;
            std::memcpy(&v, &blk.qs[u * kGroupUnit + i], 1);
            if constexpr (std::is_same_v<B, Q8_0>) v = static_cast<std::uint8_t>(v ^ 0x80u);
            dst[at] = v;
          }
        }
      }
    }
  }
}

/// Block b of row r of repacked matrix m [out][nb], as ggml stores it.
template <class B>
B repacked_block(const B* m, std::size_t out, std::size_t nb, std::size_t r, std::size_t b) {
  using L = GroupLayout<B>;
  const std::size_t g = r / kGroupRows;
  if (g >= whole_groups(out)) return m[r * nb + b];  // a row after the groups, as stored
  const std::size_t lane = r % kGroupRows;
  const std::uint8_t* const src = group_block(m, nb, g, b);
  B blk;
  std::memcpy(&blk.d, src + lane * sizeof(std::uint16_t), sizeof(std::uint16_t));
  for (std::size_t u = 0; u < L::kUnits; ++u) {
    for (std::size_t i = 0; i < kGroupUnit; ++i) {
      std::uint8_t v = src[L::kScaleBytes + (u * kGroupRows + lane) * kGroupUnit + i];
      if constexpr (std::is_same_v<B, Q8_0>) v = static_cast<std::uint8_t>(v ^ 0x80u);
      std::memcpy(&blk.qs[u * kGroupUnit + i], &v, 1);
    }
  }
  return blk;
}

/// Row r of repacked matrix m [out][nb] widened to f32: out_row [nb × 32] (the embedding rows
/// of a classifier shared with the embedding table).
template <class B>
void dequantize_repacked_row(const B* m, std::size_t out, std::size_t nb, std::size_t r,
                             float* out_row) {
  for (std::size_t b = 0; b < nb; ++b) {
    const B blk = repacked_block(m, out, nb, r, b);
    dequantize_row(&blk, out_row + b * kWeightBlock, kWeightBlock);
  }
}

}  // namespace kvdecode::detail
