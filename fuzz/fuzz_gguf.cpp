// libFuzzer target: arbitrary bytes as a GGUF file. GgufFile::open, gguf_model_config,
// load_gguf_weights (f32 and q8_0 blocks) and gguf_vocabulary (gguf_bpe_vocabulary for a "gpt2"
// one) must either throw kvdecode::Error or return results whose every tensor view lies inside
// the file and whose weights have the config's sizes; they must never crash, read out of bounds
// or allocate past GgufLimits (weights are bounded by the file: every tensor they are decoded
// from lies inside it).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.hpp"
#include "kvdecode/io/gguf.hpp"
#include "kvdecode/io/gguf_model.hpp"
#include "kvdecode/io/gguf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  const auto& path = kf::scratch_file("gguf");
  kf::write_scratch(path, data, size);
  // Far above any input libFuzzer makes, and they keep a lying header from allocating much.
  kvdecode::GgufLimits limits;
  limits.max_tensors = 1024;
  limits.max_kv = 1024;
  limits.max_string_bytes = 1 << 16;
  limits.max_array_length = 1 << 16;
  try {
    const kvdecode::GgufFile g = kvdecode::GgufFile::open(path, limits);
    kf::require(g.file_bytes() == size, "file_bytes is the input's size");
    for (const kvdecode::GgufTensorInfo& t : g.tensors()) {
      kf::require(t.data.size() == t.bytes, "a tensor view holds its bytes");
      kf::require(t.bytes == 0 || (g.data_offset() + t.offset + t.bytes <= size),
                  "a tensor lies inside the file");
    }
    try {
      const kvdecode::Weights<float> w = kvdecode::load_gguf_weights<float>(g);
      kf::require(w.config == kvdecode::gguf_model_config(g), "weights carry the file's config");
      kf::require(w.layers.size() == static_cast<std::size_t>(w.config.n_layers), "n_layers");
      kf::require(
          w.token_embedding.size() == static_cast<std::size_t>(w.config.vocab_size * w.config.dim),
          "embedding size");
    } catch (const kvdecode::Error&) {
    }
    try {  // blocks as stored (a q8_0 tensor) or quantized from any other type
      const kvdecode::Weights<kvdecode::Q8_0> w = kvdecode::load_gguf_weights<kvdecode::Q8_0>(g);
      kf::require(w.token_embedding.size() * 32 ==
                      static_cast<std::size_t>(w.config.vocab_size * w.config.dim),
                  "embedding blocks");
    } catch (const kvdecode::Error&) {
    }
    if (g.find("tokenizer.ggml.model") && g.get_string("tokenizer.ggml.model") == "gpt2") {
      const kvdecode::GgufBpeVocabulary b = kvdecode::gguf_bpe_vocabulary(g);
      kf::require(b.tokenizer.vocab_size() ==
                      static_cast<std::int64_t>(g.get("tokenizer.ggml.tokens").count),
                  "one BPE token per token");
      const std::string_view text = "ab a\xFF  'll 12";
      kf::require(b.tokenizer.decode_all(b.tokenizer.encode(text)) == text,
                  "byte-level BPE gives the bytes back");
      return 0;
    }
    const kvdecode::GgufVocabulary v = kvdecode::gguf_vocabulary(g);
    kf::require(
        v.tokenizer.vocab_size() == static_cast<std::int64_t>(g.get("tokenizer.ggml.tokens").count),
        "one piece per token");
    (void)v.tokenizer.encode("ab a", true, false);
  } catch (const kvdecode::Error&) {
    // A refused file: the expected outcome for almost every input.
  }
  return 0;
}
