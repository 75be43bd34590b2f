// Rotary position embedding: the angles of one position and their application to the heads of
// a q or k vector, in both pairing conventions.
#pragma once

#include <cmath>
#include <cstddef>

#include "kvdecode/model/model_config.hpp"

namespace kvdecode {

/// Fills cos_out/sin_out [head_size/2] with the rotation of `position`:
/// angle_j = position * theta^(-2j/head_size), as llama2.c run.c. The angle is formed in double
/// so that long positions keep their precision, then rounded to T.
template <class T>
void rope_angles(std::size_t position, std::size_t head_size, double theta, T* cos_out,
                 T* sin_out) {
  const double hs = static_cast<double>(head_size);
  for (std::size_t j = 0; j < head_size / 2; ++j) {
    const double freq = std::pow(theta, -2.0 * static_cast<double>(j) / hs);
    const double angle = static_cast<double>(position) * freq;
    cos_out[j] = static_cast<T>(std::cos(angle));
    sin_out[j] = static_cast<T>(std::sin(angle));
  }
}

/// Rotates every head of vec [n_heads][head_size] in place by the angles of one position.
/// Adjacent pairs rotate (2j, 2j+1); half-split pairs rotate (j, j + head_size/2). Either way a
/// pair (a, b) becomes (a cos - b sin, a sin + b cos).
template <class T>
void apply_rope(T* vec, std::size_t n_heads, std::size_t head_size, RopeStyle style, const T* cos_j,
                const T* sin_j) {
  const std::size_t half = head_size / 2;
  for (std::size_t h = 0; h < n_heads; ++h) {
    T* head = vec + h * head_size;
    for (std::size_t j = 0; j < half; ++j) {
      const std::size_t ia = style == RopeStyle::kAdjacentPairs ? 2 * j : j;
      const std::size_t ib = style == RopeStyle::kAdjacentPairs ? 2 * j + 1 : j + half;
      const T a = head[ia];
      const T b = head[ib];
      head[ia] = a * cos_j[j] - b * sin_j[j];
      head[ib] = a * sin_j[j] + b * cos_j[j];
    }
  }
}

}  // namespace kvdecode
