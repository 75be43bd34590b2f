// load_model(): a model file of either format the library reads, told apart by its first bytes:
// GGUF (magic "GGUF": weights, config and vocabulary in one file) or a llama2.c v0 checkpoint
// (weights only; its tokenizer.bin is a separate file).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <type_traits>

#include "kvdecode/error.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/io/gguf.hpp"
#include "kvdecode/io/gguf_model.hpp"
#include "kvdecode/io/gguf_tokenizer.hpp"
#include "kvdecode/model/weights.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode {

enum class ModelFormat { kLlama2cCheckpoint, kGguf };

/// What a model file holds: the weights, and the vocabulary when the file stores one (at most
/// one of the two is set; take_vocabulary() gives either as a Vocabulary).
template <class T>
struct LoadedModel {
  ModelFormat format = ModelFormat::kLlama2cCheckpoint;
  Weights<T> weights;
  std::optional<GgufVocabulary> vocabulary;         ///< tokenizer.ggml.model "llama"
  std::optional<GgufBpeVocabulary> bpe_vocabulary;  ///< tokenizer.ggml.model "gpt2"
};

/// The file's vocabulary, of either kind, moved out of `loaded` as a Vocabulary
/// (to_vocabulary(): its special tokens as stored); none for a llama2.c checkpoint or a GGUF file
/// without tokenizer metadata.
template <class T>
std::optional<Vocabulary> take_vocabulary(LoadedModel<T>& loaded) {
  std::optional<Vocabulary> out;
  if (loaded.vocabulary) out.emplace(to_vocabulary(std::move(*loaded.vocabulary)));
  if (loaded.bpe_vocabulary) out.emplace(to_vocabulary(std::move(*loaded.bpe_vocabulary)));
  loaded.vocabulary.reset();
  loaded.bpe_vocabulary.reset();
  return out;
}

/// The format of `file` by its magic: "GGUF" is GGUF; anything else, and a file that cannot be
/// read, is taken for a v0 checkpoint (which has no magic), whose loader then checks the file and
/// names what is wrong with it.
inline ModelFormat detect_model_format(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::array<std::byte, 4> magic{};
  in.read(reinterpret_cast<char*>(magic.data()), 4);
  if (in.gcount() == 4 && GgufFile::has_magic(magic)) return ModelFormat::kGguf;
  return ModelFormat::kLlama2cCheckpoint;
}

/// The weight formats a model runs on (Model<float, W>: W = float, bf16, Q8_0, Q4_0).
enum class WeightFormat { kF32, kBf16, kQ8_0, kQ4_0 };

/// How a model file stores its weights.
struct StoredWeights {
  /// The format a model runs the file in without changing a value: GGUF q8_0 / q4_0 / bf16 as
  /// they are; f32 for GGUF f32 or f16 (f16 widens exactly) and a llama2.c checkpoint; f32 too
  /// for a block format whose rows a model cannot hold in blocks (dim or hidden_dim not a
  /// multiple of 32, those rows then stored in another type), as blocks dequantize exactly.
  WeightFormat format = WeightFormat::kF32;
  /// The ggml type of most layer-matrix weights (gguf_matrix_type()), "f32" for a checkpoint.
  std::string matrix_type = "f32";
};

/// How `file` stores its weights (a GGUF file's header and tensor infos are read, no data).
/// Throws Error as gguf_model_config() does for a GGUF file that cannot be read.
inline StoredWeights stored_weights(const std::filesystem::path& file,
                                    const GgufLimits& gguf_limits = {}) {
  StoredWeights out;
  if (detect_model_format(file) != ModelFormat::kGguf) return out;
  const GgufFile g = GgufFile::open(file, gguf_limits);
  const GgmlType type = gguf_matrix_type(g);
  out.matrix_type = detail::gguf::ggml_type_name(static_cast<std::uint32_t>(type));
  const ModelConfig cfg = gguf_model_config(g);
  const auto block = static_cast<std::int64_t>(kWeightBlock);
  const bool whole_blocks = cfg.dim % block == 0 && cfg.hidden_dim % block == 0;
  if (type == GgmlType::kQ8_0 && whole_blocks) out.format = WeightFormat::kQ8_0;
  if (type == GgmlType::kQ4_0 && whole_blocks) out.format = WeightFormat::kQ4_0;
  if (type == GgmlType::kBf16) out.format = WeightFormat::kBf16;
  return out;
}

/// Loads a GGUF file (io/gguf_model.hpp, with its vocabulary when tokenizer.ggml.model is
/// present: "llama" through gguf_vocabulary(), "gpt2" through gguf_bpe_vocabulary(), whose
/// errors apply, and one whose token count differs from the model's vocab_size is refused naming
/// both) or a llama2.c v0 checkpoint (io/checkpoint.hpp), into weights of type T, each under its
/// format's limits. T may be a block format (Q8_0, Q4_0): a GGUF file's matrices stored in that
/// type keep their blocks as stored, any other tensor (and a checkpoint's f32 weights) is
/// quantized on load; load_gguf_weights() names a tensor that cannot be converted.
template <class T = float>
LoadedModel<T> load_model(const std::filesystem::path& file, const GgufLimits& gguf_limits = {},
                          const CheckpointLimits& checkpoint_limits = {}) {
  LoadedModel<T> out;
  out.format = detect_model_format(file);
  if (out.format == ModelFormat::kGguf) {
    const GgufFile g = GgufFile::open(file, gguf_limits);
    out.weights = load_gguf_weights<T>(g);
    if (!g.find("tokenizer.ggml.model")) return out;
    std::int64_t tokens = 0;
    if (g.get_string("tokenizer.ggml.model") == "gpt2") {
      tokens = out.bpe_vocabulary.emplace(gguf_bpe_vocabulary(g)).tokenizer.vocab_size();
    } else {
      tokens = out.vocabulary.emplace(gguf_vocabulary(g)).tokenizer.vocab_size();
    }
    // Every id the model can produce must decode, and every id the vocabulary gives must embed.
    KVDECODE_CHECK(tokens == out.weights.config.vocab_size, g.context(),
                   ": tokenizer.ggml.tokens holds ", tokens,
                   " tokens but the model's vocab_size "
                   "(rows of token_embd.weight) is ",
                   out.weights.config.vocab_size);
    return out;
  }
  if constexpr (std::is_same_v<T, float>) {
    out.weights = load_checkpoint(file, checkpoint_limits);
  } else if constexpr (kIsBlockFormat<T>) {
    out.weights = quantize_weights<T>(load_checkpoint(file, checkpoint_limits));
  } else {
    out.weights = convert_weights<T>(load_checkpoint(file, checkpoint_limits));
  }
  return out;
}

}  // namespace kvdecode
