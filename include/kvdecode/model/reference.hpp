// forward_reference(): the no-cache oracle. Every position of a sequence recomputed from the
// token ids with plain loops, sharing no code with the cached path (not its attention, RoPE,
// norm or matrix products), so agreement between the two means something.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"

namespace kvdecode {

/// Logits [tokens.size()][vocab_size] of every position of tokens, token p at RoPE position p.
/// When window > 0, position p attends only to positions p-window+1 .. p (a sliding-window
/// causal mask); otherwise to 0 .. p. The sum order follows llama2.c run.c forward().
template <class T>
std::vector<T> forward_reference(const Weights<T>& w, std::span<const std::int32_t> tokens,
                                 std::size_t window = 0) {
  const ModelConfig& c = w.config;
  const std::size_t n = tokens.size();
  const auto dim = static_cast<std::size_t>(c.dim);
  const auto hidden = static_cast<std::size_t>(c.hidden_dim);
  const auto n_heads = static_cast<std::size_t>(c.n_heads);
  const auto n_kv_heads = static_cast<std::size_t>(c.n_kv_heads);
  const auto hs = static_cast<std::size_t>(c.head_size());
  const auto kv_dim = n_kv_heads * hs;
  const auto kv_mul = n_heads / n_kv_heads;
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  for (std::size_t i = 0; i < n; ++i) {
    KVDECODE_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size, "forward_reference: token id ",
                   tokens[i], " at position ", i, " is outside the vocabulary [0, ", c.vocab_size,
                   ")");
  }

  // y[o] = Σ_i W[o][i] x[i], W row-major [out][in].
  const auto linear = [](const T* W, const T* x, T* y, std::size_t in, std::size_t out) {
    for (std::size_t o = 0; o < out; ++o) {
      T sum = 0;
      for (std::size_t i = 0; i < in; ++i) sum += W[o * in + i] * x[i];
      y[o] = sum;
    }
  };
  const auto norm = [&](const T* x, const T* gain, T* y) {
    T ss = 0;
    for (std::size_t j = 0; j < dim; ++j) ss += x[j] * x[j];
    const T r = T(1) / std::sqrt(ss / static_cast<T>(dim) + static_cast<T>(c.norm_eps));
    for (std::size_t j = 0; j < dim; ++j) y[j] = gain[j] * (r * x[j]);
  };
  // Rotates one head in place; the pairs and angle follow the config's RoPE convention.
  const auto rotate = [&](T* head, std::size_t pos) {
    for (std::size_t j = 0; j < hs / 2; ++j) {
      const double angle =
          static_cast<double>(pos) /
          std::pow(c.rope_theta, static_cast<double>(2 * j) / static_cast<double>(hs));
      const T co = static_cast<T>(std::cos(angle));
      const T si = static_cast<T>(std::sin(angle));
      const bool adjacent = c.rope_style == RopeStyle::kAdjacentPairs;
      T& a = head[adjacent ? 2 * j : j];
      T& b = head[adjacent ? 2 * j + 1 : j + hs / 2];
      const T a0 = a;
      const T b0 = b;
      a = a0 * co - b0 * si;
      b = a0 * si + b0 * co;
    }
  };

  std::vector<T> x(n * dim), xb(dim), q(n * dim), k(n * kv_dim), v(n * kv_dim), att(n * dim),
      proj(dim), h1(hidden), h3(hidden), scores(n), logits(n * vocab);
  for (std::size_t p = 0; p < n; ++p) {
    const T* e = w.token_embedding.data() + static_cast<std::size_t>(tokens[p]) * dim;
    for (std::size_t j = 0; j < dim; ++j) x[p * dim + j] = e[j];
  }
  for (const LayerWeights<T>& lw : w.layers) {
    // Every position's q, k, v from the layer input, then attention over the whole sequence.
    for (std::size_t p = 0; p < n; ++p) {
      norm(&x[p * dim], lw.rms_att.data(), xb.data());
      linear(lw.wq.data(), xb.data(), &q[p * dim], dim, dim);
      linear(lw.wk.data(), xb.data(), &k[p * kv_dim], dim, kv_dim);
      linear(lw.wv.data(), xb.data(), &v[p * kv_dim], dim, kv_dim);
      for (std::size_t h = 0; h < n_heads; ++h) rotate(&q[p * dim + h * hs], p);
      for (std::size_t h = 0; h < n_kv_heads; ++h) rotate(&k[p * kv_dim + h * hs], p);
    }
    for (std::size_t p = 0; p < n; ++p) {
      const std::size_t lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
      for (std::size_t h = 0; h < n_heads; ++h) {
        const std::size_t g = h / kv_mul;
        T max_score = -INFINITY;
        for (std::size_t t = lo; t <= p; ++t) {
          T dot = 0;
          for (std::size_t i = 0; i < hs; ++i)
            dot += q[p * dim + h * hs + i] * k[t * kv_dim + g * hs + i];
          scores[t] = dot / std::sqrt(static_cast<T>(hs));
          if (scores[t] > max_score) max_score = scores[t];
        }
        T sum = 0;
        for (std::size_t t = lo; t <= p; ++t) {
          scores[t] = std::exp(scores[t] - max_score);
          sum += scores[t];
        }
        for (std::size_t i = 0; i < hs; ++i) {
          T acc = 0;
          for (std::size_t t = lo; t <= p; ++t) acc += scores[t] / sum * v[t * kv_dim + g * hs + i];
          att[p * dim + h * hs + i] = acc;
        }
      }
    }
    for (std::size_t p = 0; p < n; ++p) {
      T* xp = &x[p * dim];
      linear(lw.wo.data(), &att[p * dim], proj.data(), dim, dim);
      for (std::size_t j = 0; j < dim; ++j) xp[j] += proj[j];
      norm(xp, lw.rms_ffn.data(), xb.data());
      linear(lw.w1.data(), xb.data(), h1.data(), dim, hidden);
      linear(lw.w3.data(), xb.data(), h3.data(), dim, hidden);
      for (std::size_t j = 0; j < hidden; ++j)
        h1[j] = h1[j] * (T(1) / (T(1) + std::exp(-h1[j]))) * h3[j];
      linear(lw.w2.data(), h1.data(), proj.data(), hidden, dim);
      for (std::size_t j = 0; j < dim; ++j) xp[j] += proj[j];
    }
  }
  for (std::size_t p = 0; p < n; ++p) {
    norm(&x[p * dim], w.rms_final.data(), xb.data());
    linear(w.classifier(), xb.data(), &logits[p * vocab], dim, vocab);
  }
  return logits;
}

}  // namespace kvdecode
