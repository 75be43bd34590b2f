// Weights<T>: the parameters of a Llama-architecture decoder, owned in 64-byte aligned buffers,
// one buffer per tensor and layer, with llama2.c's names and [out][in] row-major matrices.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/bf16.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"

namespace kvdecode {

/// One decoder layer's tensors. Matrices are row-major [out][in] (nn.Linear layout), so a
/// projection is y = W x. T is the storage type: float, double, or bf16 (see bf16.hpp and
/// Model<float, bf16>; convert_weights<bf16>() in io/checkpoint.hpp rounds f32 weights to it).
template <class T>
struct LayerWeights {
  AlignedBuffer<T> rms_att;  // [dim]                pre-attention RMSNorm gain
  AlignedBuffer<T> wq;       // [dim][dim]           out = n_heads * head_size
  AlignedBuffer<T> wk;       // [kv_dim][dim]
  AlignedBuffer<T> wv;       // [kv_dim][dim]
  AlignedBuffer<T> wo;       // [dim][dim]           in = n_heads * head_size
  AlignedBuffer<T> rms_ffn;  // [dim]                pre-FFN RMSNorm gain
  AlignedBuffer<T> w1;       // [hidden_dim][dim]    gate
  AlignedBuffer<T> w2;       // [dim][hidden_dim]    down
  AlignedBuffer<T> w3;       // [hidden_dim][dim]    up
};

/// All parameters of the model. Construction allocates zeroed tensors of the config's shapes;
/// fill them from a checkpoint (io/checkpoint.hpp) or with random_weights().
template <class T>
struct Weights {
  ModelConfig config;
  AlignedBuffer<T> token_embedding;     // [vocab_size][dim]
  std::vector<LayerWeights<T>> layers;  // [n_layers]
  AlignedBuffer<T> rms_final;           // [dim]
  AlignedBuffer<T> wcls;                // [vocab_size][dim], empty when the classifier is shared

  Weights() = default;
  explicit Weights(const ModelConfig& cfg) : config(cfg) {
    cfg.validate();
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    token_embedding = AlignedBuffer<T>(vocab * dim);
    layers.reserve(static_cast<std::size_t>(cfg.n_layers));
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
      LayerWeights<T> w;
      w.rms_att = AlignedBuffer<T>(dim);
      w.wq = AlignedBuffer<T>(dim * dim);
      w.wk = AlignedBuffer<T>(kv_dim * dim);
      w.wv = AlignedBuffer<T>(kv_dim * dim);
      w.wo = AlignedBuffer<T>(dim * dim);
      w.rms_ffn = AlignedBuffer<T>(dim);
      w.w1 = AlignedBuffer<T>(hidden * dim);
      w.w2 = AlignedBuffer<T>(dim * hidden);
      w.w3 = AlignedBuffer<T>(hidden * dim);
      layers.push_back(std::move(w));
    }
    rms_final = AlignedBuffer<T>(dim);
    if (!cfg.shared_classifier) wcls = AlignedBuffer<T>(vocab * dim);
  }

  /// The classifier matrix [vocab_size][dim]: wcls, or the embedding table when shared.
  const T* classifier() const {
    return config.shared_classifier ? token_embedding.data() : wcls.data();
  }

  /// Bytes of every parameter, as a decode step reads them (the classifier once).
  std::size_t bytes() const {
    std::size_t total = token_embedding.bytes() + rms_final.bytes() + wcls.bytes();
    for (const auto& w : layers) {
      total += w.rms_att.bytes() + w.wq.bytes() + w.wk.bytes() + w.wv.bytes() + w.wo.bytes() +
               w.rms_ffn.bytes() + w.w1.bytes() + w.w2.bytes() + w.w3.bytes();
    }
    return total;
  }

  /// Calls fn(name, layer, buffer) for every tensor in llama2.c checkpoint order (layer -1 for
  /// the tensors outside the layers), so loaders, savers and hashes walk one list.
  template <class Fn>
  void for_each_tensor(Fn&& fn) {
    for_each_tensor_impl(*this, fn);
  }
  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    for_each_tensor_impl(*this, fn);
  }

 private:
  template <class Self, class Fn>
  static void for_each_tensor_impl(Self& self, Fn& fn) {
    const auto per_layer = [&](const char* name, auto member) {
      for (std::size_t l = 0; l < self.layers.size(); ++l)
        fn(name, static_cast<std::int64_t>(l), self.layers[l].*member);
    };
    fn("token_embedding_table", std::int64_t{-1}, self.token_embedding);
    per_layer("rms_att_weight", &LayerWeights<T>::rms_att);
    per_layer("wq", &LayerWeights<T>::wq);
    per_layer("wk", &LayerWeights<T>::wk);
    per_layer("wv", &LayerWeights<T>::wv);
    per_layer("wo", &LayerWeights<T>::wo);
    per_layer("rms_ffn_weight", &LayerWeights<T>::rms_ffn);
    per_layer("w1", &LayerWeights<T>::w1);
    per_layer("w2", &LayerWeights<T>::w2);
    per_layer("w3", &LayerWeights<T>::w3);
    fn("rms_final_weight", std::int64_t{-1}, self.rms_final);
    if (!self.config.shared_classifier) fn("wcls", std::int64_t{-1}, self.wcls);
  }
};

namespace detail {

/// splitmix64: a small, well-mixed generator whose output is fixed by its seed on every platform.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [-1, 1), 53 bits.
  double symmetric() { return static_cast<double>(next() >> 11) * 0x1.0p-52 - 1.0; }

 private:
  std::uint64_t state_;
};

}  // namespace detail

/// Deterministic random weights for tests, benchmarks and demos: uniform with the scales of
/// llama2c's make_llama2c_checkpoint.py "scaled" init (embedding std 2/sqrt(dim), wq/wk std
/// 1.5/sqrt(dim), other matrices 1/sqrt(fan_in), gains 1 ± 0.25), so attention is neither
/// uniform nor one-hot and a RoPE, GQA or norm mistake moves the logits a lot.
template <class T>
Weights<T> random_weights(const ModelConfig& cfg, std::uint64_t seed) {
  Weights<T> w(cfg);
  detail::SplitMix64 rng(seed);
  const double s3 = std::sqrt(3.0);
  const double dim = static_cast<double>(cfg.dim);
  const auto fill = [&](AlignedBuffer<T>& b, double half_width, double offset) {
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<T>(offset + half_width * rng.symmetric());
  };
  const double a_emb = 2.0 / std::sqrt(dim) * s3;
  const double a_qk = 1.5 / std::sqrt(dim) * s3;
  const double a_in = 1.0 / std::sqrt(dim) * s3;
  const double a_w2 = 1.0 / std::sqrt(static_cast<double>(cfg.hidden_dim)) * s3;
  fill(w.token_embedding, a_emb, 0.0);
  for (auto& l : w.layers) {
    fill(l.rms_att, 0.25, 1.0);
    fill(l.wq, a_qk, 0.0);
    fill(l.wk, a_qk, 0.0);
    fill(l.wv, a_in, 0.0);
    fill(l.wo, a_in, 0.0);
    fill(l.rms_ffn, 0.25, 1.0);
    fill(l.w1, a_in, 0.0);
    fill(l.w2, a_w2, 0.0);
    fill(l.w3, a_in, 0.0);
  }
  fill(w.rms_final, 0.25, 1.0);
  if (!cfg.shared_classifier) fill(w.wcls, a_emb, 0.0);
  return w;
}

}  // namespace kvdecode
