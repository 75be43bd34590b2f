// An orthogonal rotation of K/V rows before they are quantized (QuaRot, Ashkboos et al. 2024):
// y = H D x / √b per block of b channels, D a fixed random ±1 diagonal and H the b×b
// Walsh-Hadamard matrix. It spreads an outlier channel over b channels, so a row's range (what
// sets a 2- or 4-bit step) shrinks towards its norm; being orthogonal, q·k and the attention
// output are unchanged once the rows are rotated back.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvdecode::detail {

/// The Hadamard block of a head: the largest power of two dividing head_size. A power-of-two
/// head is one block (16, 64, 128); 48 is three blocks of 16. Block-diagonal with orthogonal
/// blocks, the rotation stays orthogonal for every head size and costs O(hs log b).
constexpr std::size_t rotation_block(std::size_t head_size) {
  return head_size == 0 ? 0 : head_size & (~head_size + 1);
}

/// The fixed sign vector D [head_size] (±1), the same for every store of a head size, so a
/// saved cache decodes in any process.
inline void rotation_signs(std::size_t head_size, float* signs) {
  std::uint64_t s = 0x9E3779B97F4A7C15ull ^ head_size;
  for (std::size_t i = 0; i < head_size; ++i) {
    s += 0x9E3779B97F4A7C15ull;  // SplitMix64
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    signs[i] = ((z ^ (z >> 31)) & 1) != 0 ? -1.0f : 1.0f;
  }
}

/// x [b] ← H x / √b, in place (H symmetric, H·H = b·I, so this is its own inverse).
template <class T>
void hadamard_block(T* x, std::size_t b) {
  for (std::size_t len = 1; len < b; len *= 2)
    for (std::size_t i = 0; i < b; i += 2 * len)
      for (std::size_t j = i; j < i + len; ++j) {
        const T a = x[j], c = x[j + len];
        x[j] = a + c;
        x[j + len] = a - c;
      }
  const T norm = static_cast<T>(1.0 / std::sqrt(static_cast<double>(b)));
  for (std::size_t j = 0; j < b; ++j) x[j] *= norm;
}

/// Rows x [n][head_size] ← their rotation H D x / √b (forward) or D H x / √b (inverse).
template <class T>
void rotate_rows(T* x, std::size_t n, std::size_t head_size, const float* signs, bool inverse) {
  const std::size_t b = rotation_block(head_size);
  for (std::size_t r = 0; r < n; ++r) {
    T* row = x + r * head_size;
    if (!inverse)
      for (std::size_t c = 0; c < head_size; ++c) row[c] *= static_cast<T>(signs[c]);
    for (std::size_t c = 0; c < head_size; c += b) hadamard_block(row + c, b);
    if (inverse)
      for (std::size_t c = 0; c < head_size; ++c) row[c] *= static_cast<T>(signs[c]);
  }
}

}  // namespace kvdecode::detail
