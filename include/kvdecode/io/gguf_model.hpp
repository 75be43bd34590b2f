// A llama-architecture model from a GGUF file: ModelConfig from the llama.* metadata and
// Weights<T> from the tensors, each converted from its stored type (f32, f16, bf16, q8_0, q4_0)
// into T; q8_0 / q4_0 matrices loaded into Weights<Q8_0> / Weights<Q4_0> keep their blocks as
// stored. Anything the library does not run is refused by name. docs/FORMATS.md §5.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "kvdecode/bf16.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/io/gguf.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode {

namespace detail::gguf {

inline constexpr std::int64_t kMaxSide = std::int64_t{1} << 24;  // as ModelConfig::validate()

/// The GGUF name of a Weights tensor (llama.cpp's LLM_ARCH_LLAMA names), by llama2.c name.
inline std::string tensor_name(std::string_view name, std::int64_t layer) {
  const auto blk = [&](const char* what) { return concat("blk.", layer, ".", what, ".weight"); };
  if (name == "token_embedding_table") return "token_embd.weight";
  if (name == "rms_att_weight") return blk("attn_norm");
  if (name == "wq") return blk("attn_q");
  if (name == "wk") return blk("attn_k");
  if (name == "wv") return blk("attn_v");
  if (name == "wo") return blk("attn_output");
  if (name == "rms_ffn_weight") return blk("ffn_norm");
  if (name == "w1") return blk("ffn_gate");
  if (name == "w2") return blk("ffn_down");
  if (name == "w3") return blk("ffn_up");
  if (name == "rms_final_weight") return "output_norm.weight";
  if (name == "wcls") return "output.weight";
  KVDECODE_FAIL("gguf: no GGUF name for tensor '", name, "'");
}

/// The ggml dims {in, out} (or {dim} for a gain) of a Weights tensor.
inline std::array<std::uint64_t, 2> tensor_dims(const ModelConfig& cfg, std::string_view name) {
  const auto dim = static_cast<std::uint64_t>(cfg.dim);
  const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
  const auto kv_dim = static_cast<std::uint64_t>(cfg.kv_dim());
  const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
  if (name == "token_embedding_table" || name == "wcls") return {dim, vocab};
  if (name == "rms_att_weight" || name == "rms_ffn_weight" || name == "rms_final_weight")
    return {dim, 1};
  if (name == "wq" || name == "wo") return {dim, dim};
  if (name == "wk" || name == "wv") return {dim, kv_dim};
  if (name == "w1" || name == "w3") return {dim, hidden};
  if (name == "w2") return {hidden, dim};
  KVDECODE_FAIL("gguf: unknown tensor '", name, "'");
}

/// Decodes `count` elements of a tensor stored as `type` into dst, as floats. q8_0 and q4_0 are
/// dequantized block by block (ggml's block_q8_0 {f16 d; int8 qs[32]}: x[j] = qs[j] * d;
/// block_q4_0 {f16 d; uint8 qs[16]}: x[j] = ((qs[j] & 15) - 8) * d, x[j + 16] = ((qs[j] >> 4) - 8)
/// * d for j < 16). The caller has checked that `src` holds `count` elements of `type`.
template <class T>
void decode_tensor(GgmlType type, std::span<const std::byte> src, std::uint64_t count, T* dst) {
  const std::byte* p = src.data();
  switch (type) {
    case GgmlType::kF32:
      for (std::uint64_t k = 0; k < count; ++k)
        dst[k] = static_cast<T>(std::bit_cast<float>(load_u32(p + 4 * k)));
      return;
    case GgmlType::kF16:
      for (std::uint64_t k = 0; k < count; ++k)
        dst[k] = static_cast<T>(half_to_float(load_u16(p + 2 * k)));
      return;
    case GgmlType::kBf16:
      for (std::uint64_t k = 0; k < count; ++k) {
        const float x = std::bit_cast<float>(std::uint32_t{load_u16(p + 2 * k)} << 16);
        dst[k] = static_cast<T>(x);
      }
      return;
    case GgmlType::kQ8_0:
      for (std::uint64_t b = 0; b < count / 32; ++b) {
        const std::byte* block = p + 34 * b;
        const float d = half_to_float(load_u16(block));
        for (std::uint64_t j = 0; j < 32; ++j) {
          const auto q = static_cast<std::int8_t>(block[2 + j]);
          dst[32 * b + j] = static_cast<T>(static_cast<float>(q) * d);
        }
      }
      return;
    case GgmlType::kQ4_0:
      for (std::uint64_t b = 0; b < count / 32; ++b) {
        const std::byte* block = p + 18 * b;
        const float d = half_to_float(load_u16(block));
        for (std::uint64_t j = 0; j < 16; ++j) {
          const auto q = static_cast<unsigned>(block[2 + j]);
          dst[32 * b + j] = static_cast<T>(static_cast<float>(static_cast<int>(q & 15u) - 8) * d);
          dst[32 * b + j + 16] =
              static_cast<T>(static_cast<float>(static_cast<int>(q >> 4) - 8) * d);
        }
      }
      return;
  }
  KVDECODE_FAIL("gguf: ggml type ", static_cast<std::uint32_t>(type), " cannot be decoded");
}

/// The ggml type whose blocks are B's, byte for byte.
template <class B>
constexpr GgmlType block_type() {
  return std::is_same_v<B, Q8_0> ? GgmlType::kQ8_0 : GgmlType::kQ4_0;
}

/// The one place a stored tensor becomes a Weights buffer of values (f32, f64, bf16): each
/// stored type is converted to T, q8_0/q4_0 dequantized.
template <class T>
void load_tensor(const GgufTensorInfo& t, AlignedBuffer<T>& dst) {
  if constexpr (std::is_same_v<T, bf16>) {
    // Through f32 a row at a time, so bf16 weights round as convert_weights<bf16>() rounds f32.
    std::vector<float> row(static_cast<std::size_t>(t.dims[0]));  // [dims[0]]
    const std::uint64_t rows = t.elements / t.dims[0];
    const std::uint64_t row_bytes = t.bytes / rows;
    for (std::uint64_t r = 0; r < rows; ++r) {
      decode_tensor<float>(t.type, t.data.subspan(static_cast<std::size_t>(r * row_bytes)),
                           t.dims[0], row.data());
      for (std::size_t k = 0; k < row.size(); ++k)
        dst[static_cast<std::size_t>(r * t.dims[0]) + k] = bf16(row[k]);
    }
  } else {
    decode_tensor<T>(t.type, t.data, t.elements, dst.data());
  }
}

/// A matrix in block format B: a tensor stored as B's ggml type is copied block for block, as
/// stored (no dequantize/requantize round trip); any other type (f32, f16, bf16, the other
/// block format) is decoded to f32 a row at a time and quantized as ggml's reference quantizer
/// does. The caller has checked the dims and that a row is whole blocks.
template <class B>
requires kIsBlockFormat<B>
void load_tensor(const GgufTensorInfo& t, AlignedBuffer<B>& dst) {
  if (t.type == block_type<B>()) {
    load_blocks(dst, t.data, std::string(t.name).c_str());
    return;
  }
  const std::uint64_t in = t.dims[0];
  const std::uint64_t rows = t.elements / in;
  const std::uint64_t row_bytes = t.bytes / rows;
  std::vector<float> row(static_cast<std::size_t>(in));  // [in]
  for (std::uint64_t r = 0; r < rows; ++r) {
    decode_tensor<float>(t.type, t.data.subspan(static_cast<std::size_t>(r * row_bytes)), in,
                         row.data());
    quantize_row(row.data(), dst.data() + r * (in / kWeightBlock), static_cast<std::size_t>(in));
  }
}

inline std::string describe_dims(const GgufTensorInfo& t) {
  std::string s = "{";
  for (std::uint32_t d = 0; d < t.n_dims; ++d) s += concat(d == 0 ? "" : ", ", t.dims[d]);
  return s + "}";
}

/// How many tensors each layer of a llama model has (Weights::for_each_tensor's per-layer ones).
inline std::int64_t tensors_per_layer() {
  Weights<float> one;  // no buffers: only the tensor list
  one.layers.resize(1);
  std::int64_t n = 0;
  one.for_each_tensor(
      [&](const char*, std::int64_t layer, AlignedBuffer<float>&) { n += layer >= 0 ? 1 : 0; });
  return n;
}

/// Calls fn(llama2.c name, layer, GGUF name) for every tensor a model of `cfg` has.
template <class Fn>
void for_each_gguf_tensor(const ModelConfig& cfg, Fn&& fn) {
  Weights<float> names;  // no buffers: only the tensor list
  names.config = cfg;
  names.layers.resize(static_cast<std::size_t>(cfg.n_layers));
  names.for_each_tensor([&](const char* name, std::int64_t layer, AlignedBuffer<float>&) {
    fn(name, layer, tensor_name(name, layer));
  });
}

}  // namespace detail::gguf

/// The hyper-parameters of a GGUF file's llama model. Throws Error naming the file and the key
/// when general.architecture is not "llama"; a required key (llama.context_length,
/// embedding_length, block_count, feed_forward_length, attention.head_count) is missing, of the
/// wrong type or out of range; llama.rope.dimension_count or attention.key_length/value_length
/// differ from head_size; rope scaling other than "none", or experts (MoE), are asked for; or
/// token_embd.weight is missing (its dims give vocab_size), or block_count asks for more layers
/// than the file lists tensors for. Defaults as llama.cpp:
/// attention.head_count_kv = head_count, layer_norm_rms_epsilon 1e-5, rope.freq_base 10000.
/// RoPE pairs adjacent elements: llama.cpp's LLM_ARCH_LLAMA uses ggml's normal rope mode, which
/// rotates (x[2j], x[2j+1]) with theta_j = pos * base^(-2j/head_size), as llama2.c's run.c does.
inline ModelConfig gguf_model_config(const GgufFile& g) {
  const std::string ctx = g.context();
  const std::string_view arch = g.get_string("general.architecture");
  KVDECODE_CHECK(arch == "llama", ctx, ": general.architecture is '", arch,
                 "'; only 'llama' is supported");
  constexpr std::int64_t kMax = detail::gguf::kMaxSide;
  ModelConfig cfg;
  cfg.seq_len = g.get_int("llama.context_length", 1, kMax);
  cfg.dim = g.get_int("llama.embedding_length", 1, kMax);
  cfg.n_layers = g.get_int("llama.block_count", 1, kMax);
  cfg.hidden_dim = g.get_int("llama.feed_forward_length", 1, kMax);
  cfg.n_heads = g.get_int("llama.attention.head_count", 1, kMax);
  cfg.n_kv_heads = g.find("llama.attention.head_count_kv")
                       ? g.get_int("llama.attention.head_count_kv", 1, kMax)
                       : cfg.n_heads;
  cfg.norm_eps = g.find("llama.attention.layer_norm_rms_epsilon")
                     ? g.get_float("llama.attention.layer_norm_rms_epsilon")
                     : 1e-5;
  cfg.rope_theta = g.find("llama.rope.freq_base") ? g.get_float("llama.rope.freq_base") : 10000.0;
  cfg.rope_style = RopeStyle::kAdjacentPairs;
  KVDECODE_CHECK(cfg.dim % cfg.n_heads == 0, ctx, ": llama.embedding_length (", cfg.dim,
                 ") must be divisible by llama.attention.head_count (", cfg.n_heads, ")");
  const std::int64_t head_size = cfg.dim / cfg.n_heads;
  for (const char* key : {"llama.rope.dimension_count", "llama.attention.key_length",
                          "llama.attention.value_length"}) {
    if (!g.find(key)) continue;
    const std::int64_t v = g.get_int(key, 0, kMax);
    KVDECODE_CHECK(v == head_size, ctx, ": ", key, " is ", v,
                   ", but head_size = ", "embedding_length / head_count = ", head_size,
                   "; partial rotary embeddings and other head sizes are not supported");
  }
  if (g.find("llama.rope.scaling.type")) {
    const std::string_view type = g.get_string("llama.rope.scaling.type");
    KVDECODE_CHECK(type == "none", ctx, ": llama.rope.scaling.type is '", type,
                   "'; only 'none' (no RoPE scaling) is supported");
  }
  for (const char* key : {"llama.expert_count", "llama.expert_used_count"}) {
    if (!g.find(key)) continue;
    const std::int64_t n = g.get_int(key, 0, std::numeric_limits<std::int32_t>::max());
    KVDECODE_CHECK(n == 0, ctx, ": ", key, " is ", n,
                   "; mixture-of-experts models are not supported");
  }
  const GgufTensorInfo* emb = g.find_tensor("token_embd.weight");
  KVDECODE_CHECK(
      emb != nullptr, ctx, ": tensor 'token_embd.weight' is missing",
      g.tensors().empty() ? " (the file holds no tensors: a vocabulary-only file?)" : "");
  KVDECODE_CHECK(emb->n_dims == 2 && emb->dims[1] <= static_cast<std::uint64_t>(kMax), ctx,
                 ": tensor 'token_embd.weight' (info at byte ", emb->info_offset, ") has ",
                 emb->n_dims, " dims, expected 2: {embedding_length, vocab_size <= ", kMax, "}");
  cfg.vocab_size = static_cast<std::int64_t>(emb->dims[1]);
  if (g.find("llama.vocab_size")) {
    const std::int64_t v = g.get_int("llama.vocab_size", 0, kMax);
    KVDECODE_CHECK(v == cfg.vocab_size, ctx, ": llama.vocab_size is ", v,
                   " but token_embd.weight has ", cfg.vocab_size, " rows");
  }
  // Each layer has tensors of its own: a count beyond the file's is refused before anything is
  // sized by it.
  const auto listed = static_cast<std::int64_t>(g.tensors().size());
  const std::int64_t per_layer = detail::gguf::tensors_per_layer();
  KVDECODE_CHECK(cfg.n_layers <= listed / per_layer, ctx, ": llama.block_count is ", cfg.n_layers,
                 " but the file lists ", listed, " tensors (", per_layer, " per layer)");
  cfg.shared_classifier = g.find_tensor("output.weight") == nullptr;
  try {
    cfg.validate();
  } catch (const Error& e) {
    std::string_view m = e.what();
    if (m.starts_with("kvdecode: ")) m.remove_prefix(10);
    KVDECODE_FAIL(ctx, ": llama.* metadata: ", m);
  }
  return cfg;
}

/// Loads the weights of a GGUF llama model (config as gguf_model_config()), converting each
/// tensor to T: f32, f64 or bf16 values, or a block format (Q8_0, Q4_0) whose matrices keep the
/// file's blocks exactly when they are stored in that type and are quantized from the decoded
/// values otherwise (the RMSNorm gains are f32 in a block format). The blocks are copied into the
/// weights' own aligned buffers, so the model does not depend on the file staying mapped. Throws
/// Error naming the tensor when one is missing, has other dims than the config implies, has rows
/// that are not whole blocks of 32 when T is a block format, or when the file holds a tensor
/// this architecture does not use (e.g. rope_freqs.weight, Llama 3.1's RoPE scaling). On failure
/// nothing is returned.
template <class T>
Weights<T> load_gguf_weights(const GgufFile& g) {
  namespace gg = detail::gguf;
  const std::string ctx = g.context();
  const ModelConfig cfg = gguf_model_config(g);
  const std::string shape =
      detail::concat("dim=", cfg.dim, " hidden_dim=", cfg.hidden_dim, " kv_dim=", cfg.kv_dim(),
                     " vocab_size=", cfg.vocab_size);
  // Every tensor is checked before the weights are allocated.
  std::unordered_set<std::string> expected;
  gg::for_each_gguf_tensor(cfg, [&](const char* name, std::int64_t, const std::string& gname) {
    const GgufTensorInfo* t = g.find_tensor(gname);
    KVDECODE_CHECK(t != nullptr, ctx, ": tensor '", gname, "' is missing");
    const auto dims = gg::tensor_dims(cfg, name);
    const std::uint32_t n_dims = dims[1] == 1 ? 1 : 2;
    const bool ok = t->n_dims == n_dims && t->dims[0] == dims[0] && t->dims[1] == dims[1];
    KVDECODE_CHECK(ok, ctx, ": tensor '", gname, "' (info at byte ", t->info_offset, ") has dims ",
                   gg::describe_dims(*t), ", expected {", dims[0],
                   n_dims == 2 ? detail::concat(", ", dims[1]) : std::string(), "} for ", shape);
    if constexpr (kIsBlockFormat<T>) {
      KVDECODE_CHECK(n_dims == 1 || dims[0] % kWeightBlock == 0, ctx, ": tensor '", gname, "' (",
                     gg::ggml_type_name(static_cast<std::uint32_t>(t->type)), ", dims ",
                     gg::describe_dims(*t), ") has rows of ", dims[0],
                     " weights, which cannot be held in ", block_format_name<T>(), " blocks of ",
                     kWeightBlock, "; load the file with f32 or bf16 weights");
    }
    expected.insert(gname);
  });
  for (const GgufTensorInfo& t : g.tensors()) {
    KVDECODE_CHECK(expected.count(std::string(t.name)) == 1, ctx, ": tensor '", t.name,
                   "' (info at byte ", t.info_offset,
                   ") is not part of the llama architecture this library runs",
                   t.name == "rope_freqs.weight" ? " (per-dimension RoPE frequency factors)" : "");
  }
  Weights<T> w(cfg);
  w.for_each_tensor([&](const char* name, std::int64_t layer, auto& buffer) {
    gg::load_tensor(*g.find_tensor(gg::tensor_name(name, layer)), buffer);
  });
  return w;
}

/// The ggml type that holds most of the weights of the layers' matrices (blk.N.*, 2-D tensors):
/// the format a model "as stored" runs in. kF32 for a file without such tensors.
inline GgmlType gguf_matrix_type(const GgufFile& g) {
  std::array<std::uint64_t, 5> weights{};  // per type, in the order of kTypes
  constexpr std::array<GgmlType, 5> kTypes = {GgmlType::kF32, GgmlType::kF16, GgmlType::kBf16,
                                              GgmlType::kQ8_0, GgmlType::kQ4_0};
  for (const GgufTensorInfo& t : g.tensors()) {
    if (t.n_dims != 2 || !t.name.starts_with("blk.")) continue;
    for (std::size_t k = 0; k < kTypes.size(); ++k)
      if (t.type == kTypes[k]) weights[k] += t.elements;
  }
  const auto most = std::max_element(weights.begin(), weights.end()) - weights.begin();
  return weights[static_cast<std::size_t>(most)] == 0 ? GgmlType::kF32
                                                      : kTypes[static_cast<std::size_t>(most)];
}

}  // namespace kvdecode
