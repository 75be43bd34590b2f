// A test-side forward pass in double precision, one token at a time, written from the model's
// definition (llama2.c run.c forward()) and sharing no code with the library's paths: weights
// widened to double, an optional bf16 rounding of every weight product's input, and K/V that
// the caller supplies per layer (its own cache, or what a store held when the query ran).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode::testing_util {

/// x rounded to the nearest bf16, ties to even, through float (as f32 activations are): the
/// upper 16 bits of the f32 after adding half an ulp of bf16, written here from the definition.
inline double round_to_bf16(double x) {
  const auto u = std::bit_cast<std::uint32_t>(static_cast<float>(x));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return std::numeric_limits<double>::quiet_NaN();
  const std::uint32_t lsb = (u >> 16) & 1u;
  const std::uint32_t r = ((u + 0x7FFFu + lsb) >> 16) << 16;
  return static_cast<double>(std::bit_cast<float>(r));
}

/// The model's weights as doubles, [out][in] row-major as in Weights.
struct DoubleWeights {
  struct Layer {
    std::vector<double> rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
  };
  ModelConfig cfg;
  std::vector<double> embedding;   // [vocab_size][dim]
  std::vector<Layer> layers;       // [n_layers]
  std::vector<double> rms_final;   // [dim]
  std::vector<double> classifier;  // [vocab_size][dim]
};

/// Every weight widened to double; with round_bf16, each first rounded to bf16 by
/// round_to_bf16 (the test's own rounding, not the library's).
template <class W>
DoubleWeights widen_weights(const Weights<W>& w, bool round_bf16 = false) {
  const auto widen = [&](const AlignedBuffer<W>& b) {
    std::vector<double> out(b.size());
    for (std::size_t i = 0; i < b.size(); ++i) {
      const double x = static_cast<double>(b[i]);
      out[i] = round_bf16 ? round_to_bf16(x) : x;
    }
    return out;
  };
  DoubleWeights d;
  d.cfg = w.config;
  d.embedding = widen(w.token_embedding);
  for (const LayerWeights<W>& l : w.layers) {
    d.layers.push_back({widen(l.rms_att), widen(l.wq), widen(l.wk), widen(l.wv), widen(l.wo),
                        widen(l.rms_ffn), widen(l.w1), widen(l.w2), widen(l.w3)});
  }
  d.rms_final = widen(w.rms_final);
  d.classifier = w.config.shared_classifier ? d.embedding : widen(w.wcls);
  return d;
}

/// The keys and values one query of one layer attends to: n rows per kv head,
/// keys/values [n_kv_heads][n][head_size], keys after RoPE. Row r is cache index r.
struct LayerKv {
  std::size_t n = 0;
  std::vector<double> keys, values;
};

/// Logits [vocab_size] of `token` at RoPE position pos. For each layer, kv(layer, k, v) gets the
/// token's own k (after RoPE) and v, [kv_dim] each, and returns the LayerKv the query attends
/// to (its own row included, last). With bf16_inputs, every weight product's input vector is
/// rounded to bf16 first (products then summed exactly in double).
template <class KvFn>
std::vector<double> double_step(const DoubleWeights& w, std::int32_t token, std::size_t pos,
                                KvFn&& kv, bool bf16_inputs = false) {
  const ModelConfig& c = w.cfg;
  const auto dim = static_cast<std::size_t>(c.dim);
  const auto hidden = static_cast<std::size_t>(c.hidden_dim);
  const auto n_heads = static_cast<std::size_t>(c.n_heads);
  const auto n_kv_heads = static_cast<std::size_t>(c.n_kv_heads);
  const auto hs = static_cast<std::size_t>(c.head_size());
  const std::size_t kv_dim = n_kv_heads * hs, kv_mul = n_heads / n_kv_heads;
  const auto vocab = static_cast<std::size_t>(c.vocab_size);

  std::vector<double> in;  // the rounded input of a product
  const auto matvec = [&](const std::vector<double>& m, const std::vector<double>& x,
                          std::size_t out) {
    in = x;
    if (bf16_inputs)
      for (double& v : in) v = round_to_bf16(v);
    std::vector<double> y(out, 0.0);
    for (std::size_t o = 0; o < out; ++o)
      for (std::size_t i = 0; i < in.size(); ++i) y[o] += m[o * in.size() + i] * in[i];
    return y;
  };
  const auto rmsnorm = [&](const std::vector<double>& x, const std::vector<double>& g) {
    double ss = 0;
    for (const double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(dim) + c.norm_eps);
    std::vector<double> y(dim);
    for (std::size_t j = 0; j < dim; ++j) y[j] = g[j] * (r * x[j]);
    return y;
  };
  const auto rope = [&](double* head) {
    for (std::size_t j = 0; j < hs / 2; ++j) {
      const double angle =
          static_cast<double>(pos) *
          std::pow(c.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(hs));
      const bool adjacent = c.rope_style == RopeStyle::kAdjacentPairs;
      double& a = head[adjacent ? 2 * j : j];
      double& b = head[adjacent ? 2 * j + 1 : j + hs / 2];
      const double a0 = a, b0 = b;
      a = a0 * std::cos(angle) - b0 * std::sin(angle);
      b = a0 * std::sin(angle) + b0 * std::cos(angle);
    }
  };

  std::vector<double> x(w.embedding.begin() + static_cast<std::ptrdiff_t>(token * dim),
                        w.embedding.begin() + static_cast<std::ptrdiff_t>((token + 1) * dim));
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    const DoubleWeights::Layer& lw = w.layers[l];
    const std::vector<double> xb = rmsnorm(x, lw.rms_att);
    std::vector<double> q = matvec(lw.wq, xb, dim);
    std::vector<double> k = matvec(lw.wk, xb, kv_dim);
    const std::vector<double> v = matvec(lw.wv, xb, kv_dim);
    for (std::size_t h = 0; h < n_heads; ++h) rope(q.data() + h * hs);
    for (std::size_t h = 0; h < n_kv_heads; ++h) rope(k.data() + h * hs);
    const LayerKv seen = kv(l, std::span<const double>(k), std::span<const double>(v));
    std::vector<double> att(dim, 0.0);
    for (std::size_t h = 0; h < n_heads; ++h) {
      const std::size_t g = h / kv_mul;
      const double* keys = seen.keys.data() + g * seen.n * hs;
      const double* values = seen.values.data() + g * seen.n * hs;
      std::vector<double> p(seen.n);
      double mx = -INFINITY;
      for (std::size_t t = 0; t < seen.n; ++t) {
        double dot = 0;
        for (std::size_t i = 0; i < hs; ++i) dot += q[h * hs + i] * keys[t * hs + i];
        p[t] = dot / std::sqrt(static_cast<double>(hs));
        mx = std::max(mx, p[t]);
      }
      double sum = 0;
      for (double& s : p) sum += s = std::exp(s - mx);
      for (std::size_t t = 0; t < seen.n; ++t)
        for (std::size_t i = 0; i < hs; ++i) att[h * hs + i] += p[t] / sum * values[t * hs + i];
    }
    const std::vector<double> o = matvec(lw.wo, att, dim);
    for (std::size_t j = 0; j < dim; ++j) x[j] += o[j];
    const std::vector<double> xf = rmsnorm(x, lw.rms_ffn);
    std::vector<double> h1 = matvec(lw.w1, xf, hidden);
    const std::vector<double> h3 = matvec(lw.w3, xf, hidden);
    for (std::size_t j = 0; j < hidden; ++j) h1[j] = h1[j] / (1.0 + std::exp(-h1[j])) * h3[j];
    const std::vector<double> f = matvec(lw.w2, h1, dim);
    for (std::size_t j = 0; j < dim; ++j) x[j] += f[j];
  }
  return matvec(w.classifier, rmsnorm(x, w.rms_final), vocab);
}

/// The plain causal cache of double_step: every token's own K/V, appended as it runs.
class DoubleCache {
 public:
  explicit DoubleCache(const ModelConfig& cfg)
      : n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        hs_(static_cast<std::size_t>(cfg.head_size())),
        k_(static_cast<std::size_t>(cfg.n_layers)),
        v_(static_cast<std::size_t>(cfg.n_layers)) {}

  /// The kv callback of double_step: appends (k, v) to the layer and returns every row so far.
  LayerKv operator()(std::size_t layer, std::span<const double> k, std::span<const double> v) {
    k_[layer].insert(k_[layer].end(), k.begin(), k.end());  // [n][kv_dim]
    v_[layer].insert(v_[layer].end(), v.begin(), v.end());
    const std::size_t kv_dim = n_kv_heads_ * hs_, n = k_[layer].size() / kv_dim;
    LayerKv out{n, std::vector<double>(n * kv_dim), std::vector<double>(n * kv_dim)};
    for (std::size_t g = 0; g < n_kv_heads_; ++g)
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t i = 0; i < hs_; ++i) {
          out.keys[(g * n + t) * hs_ + i] = k_[layer][t * kv_dim + g * hs_ + i];
          out.values[(g * n + t) * hs_ + i] = v_[layer][t * kv_dim + g * hs_ + i];
        }
    return out;
  }

 private:
  std::size_t n_kv_heads_, hs_;
  std::vector<std::vector<double>> k_, v_;  // [n_layers][positions × kv_dim]
};

/// Logits [tokens.size()][vocab_size] of every position, token p at RoPE position p.
inline std::vector<double> double_forward(const DoubleWeights& w,
                                          std::span<const std::int32_t> tokens,
                                          bool bf16_inputs = false) {
  DoubleCache cache(w.cfg);
  std::vector<double> logits;
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    const std::vector<double> l = double_step(w, tokens[p], p, cache, bf16_inputs);
    logits.insert(logits.end(), l.begin(), l.end());
  }
  return logits;
}

/// The f16 values next to x toward −∞ (at_most) or +∞ (at_least) for |x| ≤ 65504, written
/// here from the binary16 layout: 11 significant bits, spacing 2^-24 below 2^-14.
inline double f16_spacing(double x) {
  const double a = std::abs(x);
  if (a < 0x1p-14) return 0x1p-24;
  int e = 0;
  std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 11);
}
inline double f16_at_most(double x) { return std::floor(x / f16_spacing(x)) * f16_spacing(x); }
inline double f16_at_least(double x) { return std::ceil(x / f16_spacing(x)) * f16_spacing(x); }

/// x [n][head_size] after Int8Store's quantization as int8_store.hpp specifies it, written again
/// here: per row, in f32, min = the f16 at most min x, step = the f16 at least
/// (max x − min) / 255, q = round((x − min) / step) in [0, 255], x̂ = min + q · step.
inline std::vector<double> int8_round_trip(std::span<const double> x, std::size_t head_size) {
  std::vector<double> out(x.size());
  for (std::size_t h0 = 0; h0 < x.size(); h0 += head_size) {
    float lo = static_cast<float>(x[h0]), hi = lo;
    for (std::size_t i = 1; i < head_size; ++i) {
      lo = std::min(lo, static_cast<float>(x[h0 + i]));
      hi = std::max(hi, static_cast<float>(x[h0 + i]));
    }
    const auto mn = static_cast<float>(f16_at_most(lo));
    const auto step = static_cast<float>(f16_at_least((hi - mn) / 255.0f));
    const float inv = step > 0.0f ? 1.0f / step : 0.0f;
    for (std::size_t i = 0; i < head_size; ++i) {
      const float q =
          std::clamp(std::nearbyint((static_cast<float>(x[h0 + i]) - mn) * inv), 0.0f, 255.0f);
      out[h0 + i] = static_cast<double>(mn) + static_cast<double>(q) * static_cast<double>(step);
    }
  }
  return out;
}

/// double_forward with every K/V row rounded through int8 (int8_round_trip) when it is cached:
/// the oracle of an Int8Store<double>, whose rows are quantized once when written.
inline std::vector<double> int8_double_forward(const DoubleWeights& w,
                                               std::span<const std::int32_t> tokens) {
  const auto hs = static_cast<std::size_t>(w.cfg.head_size());
  DoubleCache cache(w.cfg);
  const auto int8_kv = [&](std::size_t l, std::span<const double> k, std::span<const double> v) {
    const std::vector<double> qk = int8_round_trip(k, hs), qv = int8_round_trip(v, hs);
    return cache(l, qk, qv);
  };
  std::vector<double> logits;
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    const std::vector<double> l = double_step(w, tokens[p], p, int8_kv);
    logits.insert(logits.end(), l.begin(), l.end());
  }
  return logits;
}

}  // namespace kvdecode::testing_util
