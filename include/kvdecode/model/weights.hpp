// Weights<T>: the parameters of a Llama-architecture decoder, owned in 64-byte aligned buffers,
// one buffer per tensor and layer (the layers' matrices as views into one arena), with llama2.c's
// names and [out][in] row-major matrices; with a block format (Q8_0, Q4_0) every matrix row is
// in/32 blocks and the RMSNorm gains stay f32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/bf16.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode {

/// The element type of the RMSNorm gains: T itself, f32 for a block format (a few KiB per layer,
/// and ggml keeps its norm weights f32 too).
template <class T>
using GainOf = std::conditional_t<kIsBlockFormat<T>, float, T>;

/// One decoder layer's tensors. Matrices are row-major [out][in] (nn.Linear layout), so a
/// projection is y = W x. T is the storage type: float, double, bf16 (see bf16.hpp and
/// Model<float, bf16>; convert_weights<bf16>() in io/checkpoint.hpp rounds f32 weights to it),
/// or a block format, Q8_0 or Q4_0 (weight_blocks.hpp; quantize_weights<Q8_0>() below), where a
/// matrix [out][in] holds out × in/32 blocks.
template <class T>
struct LayerWeights {
  AlignedBuffer<GainOf<T>> rms_att;  // [dim]                pre-attention RMSNorm gain
  AlignedBuffer<T> wq;               // [dim][dim]           out = n_heads * head_size
  AlignedBuffer<T> wk;               // [kv_dim][dim]
  AlignedBuffer<T> wv;               // [kv_dim][dim]
  AlignedBuffer<T> wo;               // [dim][dim]           in = n_heads * head_size
  AlignedBuffer<GainOf<T>> rms_ffn;  // [dim]                pre-FFN RMSNorm gain
  AlignedBuffer<T> w1;               // [hidden_dim][dim]    gate
  AlignedBuffer<T> w2;               // [dim][hidden_dim]    down
  AlignedBuffer<T> w3;               // [hidden_dim][dim]    up
};

/// All parameters of the model. Construction allocates zeroed tensors of the config's shapes;
/// fill them from a checkpoint (io/checkpoint.hpp) or with random_weights(), or for a block
/// format with quantize_weights() or, blocks as stored elsewhere (GGUF), load_blocks().
template <class T>
struct Weights {
  /// Weights per element of a matrix buffer: 32 for a block format, else 1.
  static constexpr std::size_t kPerElement = kIsBlockFormat<T> ? kWeightBlock : 1;

  ModelConfig config;
  // Every layer's matrices, one after another (each at a multiple of kAlignment): one buffer
  // large enough for huge pages, where each matrix alone (a few hundred KiB in q8_0) would be
  // streamed through 4 KiB pages. The layers' wq .. w3 are views into it; declared before them,
  // so it is freed after them.
  AlignedBuffer<std::byte> matrix_arena;
  AlignedBuffer<T> token_embedding;     // [vocab_size][dim] (÷ kPerElement: blocks)
  std::vector<LayerWeights<T>> layers;  // [n_layers]
  AlignedBuffer<GainOf<T>> rms_final;   // [dim]
  AlignedBuffer<T> wcls;                // [vocab_size][dim], empty when the classifier is shared

  Weights() = default;
  /// Throws Error, allocating nothing, for an invalid config or, with a block format, a
  /// matrix row width (dim, hidden_dim) that is not a multiple of 32: rows are never padded.
  explicit Weights(const ModelConfig& cfg) : config(cfg), matrix_arena(checked_arena_bytes(cfg)) {
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    const auto matrix = [](std::size_t out, std::size_t in) {
      return AlignedBuffer<T>(out * in / kPerElement);
    };
    std::size_t arena_used = 0;
    const auto arena_matrix = [&](std::size_t out, std::size_t in) {
      const std::size_t at = arena_used;
      arena_used += arena_bytes(out, in);
      return AlignedBuffer<T>::view(reinterpret_cast<T*>(matrix_arena.data() + at),
                                    out * in / kPerElement);
    };
    token_embedding = matrix(vocab, dim);
    layers.reserve(static_cast<std::size_t>(cfg.n_layers));
    for (std::int64_t l = 0; l < cfg.n_layers; ++l) {
      LayerWeights<T> w;
      w.rms_att = AlignedBuffer<GainOf<T>>(dim);
      w.wq = arena_matrix(dim, dim);
      w.wk = arena_matrix(kv_dim, dim);
      w.wv = arena_matrix(kv_dim, dim);
      w.wo = arena_matrix(dim, dim);
      w.rms_ffn = AlignedBuffer<GainOf<T>>(dim);
      w.w1 = arena_matrix(hidden, dim);
      w.w2 = arena_matrix(dim, hidden);
      w.w3 = arena_matrix(hidden, dim);
      layers.push_back(std::move(w));
    }
    rms_final = AlignedBuffer<GainOf<T>>(dim);
    if (!cfg.shared_classifier) wcls = matrix(vocab, dim);
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
  /// the tensors outside the layers), so loaders, savers and hashes walk one list. With a block
  /// format the gains are AlignedBuffer<float> and the matrices AlignedBuffer<T>: fn must take
  /// both (a generic lambda).
  template <class Fn>
  void for_each_tensor(Fn&& fn) {
    for_each_tensor_impl(*this, fn);
  }
  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    for_each_tensor_impl(*this, fn);
  }

 private:
  /// Bytes one matrix [out][in] takes in the arena: its elements, rounded up to kAlignment.
  static std::size_t arena_bytes(std::size_t out, std::size_t in) {
    return (out * in / kPerElement * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
  }

  /// The arena's bytes for every layer's matrices, once the config (and, with a block format,
  /// the row widths) are checked: the constructor allocates nothing for a bad config.
  static std::size_t checked_arena_bytes(const ModelConfig& cfg) {
    cfg.validate();
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    if constexpr (kIsBlockFormat<T>) {
      KVDECODE_CHECK(dim % kWeightBlock == 0, "Weights<", block_format_name<T>(),
                     ">: the rows of token_embedding_table, wq, wk, wv, wo, w1, w3 and wcls are "
                     "dim = ",
                     dim, " weights wide, expected a multiple of the ", kWeightBlock,
                     "-weight block");
      KVDECODE_CHECK(hidden % kWeightBlock == 0, "Weights<", block_format_name<T>(),
                     ">: the rows of w2 are hidden_dim = ", hidden,
                     " weights wide, expected a multiple of the ", kWeightBlock, "-weight block");
    }
    return static_cast<std::size_t>(cfg.n_layers) *
           (2 * arena_bytes(dim, dim) + 2 * arena_bytes(kv_dim, dim) +
            3 * arena_bytes(hidden, dim));
  }

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

// ---------------------------------------------------------------------------------------------
// Block formats: quantizing on load, blocks as stored, and back to f32.
// ---------------------------------------------------------------------------------------------

/// The weights of `from` (f32 or bf16) in block format B (Q8_0, Q4_0), every matrix row
/// quantized as ggml's reference quantizer does (weight_blocks.hpp): the projections, the
/// classifier and the embedding table, as llama.cpp's Q8_0 / Q4_0 files hold them (the
/// embedding rows are dequantized per token); the gains widened to f32. Throws Error as
/// Weights<B>(config) does for widths that are not multiples of 32.
template <class B, class From>
Weights<B> quantize_weights(const Weights<From>& from) {
  static_assert(kIsBlockFormat<B> && !kIsBlockFormat<From>);
  Weights<B> to(from.config);
  const auto dim = static_cast<std::size_t>(from.config.dim);
  const auto hidden = static_cast<std::size_t>(from.config.hidden_dim);
  std::vector<float> row(std::max(dim, hidden));  // [in] one row widened to f32
  const auto matrix = [&](AlignedBuffer<B>& dst, const AlignedBuffer<From>& src, std::size_t in) {
    for (std::size_t r = 0; r < src.size() / in; ++r) {
      for (std::size_t c = 0; c < in; ++c) row[c] = static_cast<float>(src[r * in + c]);
      quantize_row(row.data(), dst.data() + r * (in / kWeightBlock), in);
    }
  };
  const auto gain = [](AlignedBuffer<float>& dst, const AlignedBuffer<From>& src) {
    for (std::size_t i = 0; i < src.size(); ++i) dst[i] = static_cast<float>(src[i]);
  };
  matrix(to.token_embedding, from.token_embedding, dim);
  for (std::size_t l = 0; l < from.layers.size(); ++l) {
    const LayerWeights<From>& f = from.layers[l];
    LayerWeights<B>& t = to.layers[l];
    gain(t.rms_att, f.rms_att);
    matrix(t.wq, f.wq, dim);
    matrix(t.wk, f.wk, dim);
    matrix(t.wv, f.wv, dim);
    matrix(t.wo, f.wo, dim);
    gain(t.rms_ffn, f.rms_ffn);
    matrix(t.w1, f.w1, dim);
    matrix(t.w2, f.w2, hidden);
    matrix(t.w3, f.w3, dim);
  }
  gain(to.rms_final, from.rms_final);
  if (!from.config.shared_classifier) matrix(to.wcls, from.wcls, dim);
  return to;
}

/// Fills one matrix of block-format weights with blocks exactly as another program stored them
/// (ggml's layout: row after row, each in/32 blocks of sizeof(B) bytes; a GGUF tensor's data),
/// without re-quantizing. `name` and `layer` label the tensor in the Error thrown, changing
/// nothing, when the byte count is not the matrix's.
template <class B>
void load_blocks(AlignedBuffer<B>& matrix, std::span<const std::byte> bytes, const char* name,
                 std::int64_t layer = -1) {
  static_assert(kIsBlockFormat<B>);
  KVDECODE_CHECK(bytes.size() == matrix.bytes(), "load_blocks: tensor ", name,
                 layer >= 0 ? " of layer " : "", layer >= 0 ? std::to_string(layer) : "", " has ",
                 bytes.size(), " bytes of ", block_format_name<B>(), " blocks, expected ",
                 matrix.size(), " blocks of ", sizeof(B), " = ", matrix.bytes(), " bytes");
  if (!bytes.empty()) std::memcpy(matrix.data(), bytes.data(), bytes.size());
}

/// Every weight of block-format `from` as f32 (each block's formula): the f32 model these
/// weights stand for, which the tests run as the reference for the integer kernels.
template <class B>
Weights<float> dequantize_weights(const Weights<B>& from) {
  static_assert(kIsBlockFormat<B>);
  Weights<float> to(from.config);
  const auto matrix = [](AlignedBuffer<float>& dst, const AlignedBuffer<B>& src) {
    dequantize_row(src.data(), dst.data(), dst.size());
  };
  const auto gain = [](AlignedBuffer<float>& dst, const AlignedBuffer<float>& src) {
    dst.copy_from(src);
  };
  matrix(to.token_embedding, from.token_embedding);
  for (std::size_t l = 0; l < from.layers.size(); ++l) {
    const LayerWeights<B>& f = from.layers[l];
    LayerWeights<float>& t = to.layers[l];
    gain(t.rms_att, f.rms_att);
    matrix(t.wq, f.wq);
    matrix(t.wk, f.wk);
    matrix(t.wv, f.wv);
    matrix(t.wo, f.wo);
    gain(t.rms_ffn, f.rms_ffn);
    matrix(t.w1, f.w1);
    matrix(t.w2, f.w2);
    matrix(t.w3, f.w3);
  }
  gain(to.rms_final, from.rms_final);
  if (!from.config.shared_classifier) matrix(to.wcls, from.wcls);
  return to;
}

}  // namespace kvdecode
