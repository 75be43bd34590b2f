// ModelConfig: the shape of a Llama-style decoder with llama2.c's dimension names, and the checks
// that make every derived size (head_size, kv_dim, kv_mul) well defined.
#pragma once

#include <cstdint>
#include <limits>

#include "kvdecode/error.hpp"

namespace kvdecode {

/// How RoPE pairs the elements of a head before rotating them.
enum class RopeStyle {
  kAdjacentPairs,  ///< (2j, 2j+1), as llama2.c run.c and every v0 checkpoint
  kHalfSplit,      ///< (j, j + head_size/2), the HF rotate_half layout
};

/// The hyper-parameters of the model. Field names follow llama2.c's Config; sizes are 64-bit
/// so products of them never overflow on the way to a buffer size.
struct ModelConfig {
  std::int64_t dim = 0;         ///< model width
  std::int64_t hidden_dim = 0;  ///< SwiGLU FFN width
  std::int64_t n_layers = 0;
  std::int64_t n_heads = 0;     ///< query heads
  std::int64_t n_kv_heads = 0;  ///< key/value heads; < n_heads is GQA, 1 is MQA
  std::int64_t vocab_size = 0;
  std::int64_t seq_len = 0;  ///< the longest context the model was built for
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;  ///< added to the mean square inside RMSNorm's sqrt
  RopeStyle rope_style = RopeStyle::kAdjacentPairs;
  bool shared_classifier = true;  ///< logits use the token embedding table as the classifier

  std::int64_t head_size() const { return dim / n_heads; }
  std::int64_t kv_dim() const { return n_kv_heads * head_size(); }
  /// How many query heads read one kv head: query head h reads kv head h / kv_mul.
  std::int64_t kv_mul() const { return n_heads / n_kv_heads; }

  /// Throws Error naming the first field that breaks a rule, with its value.
  void validate() const {
    check_positive("dim", dim);
    check_positive("hidden_dim", hidden_dim);
    check_positive("n_layers", n_layers);
    check_positive("n_heads", n_heads);
    check_positive("n_kv_heads", n_kv_heads);
    check_positive("vocab_size", vocab_size);
    check_positive("seq_len", seq_len);
    KVDECODE_CHECK(dim % n_heads == 0, "ModelConfig: dim (", dim,
                   ") must be divisible by n_heads (", n_heads, ")");
    KVDECODE_CHECK(n_heads % n_kv_heads == 0, "ModelConfig: n_heads (", n_heads,
                   ") must be a multiple of n_kv_heads (", n_kv_heads, ")");
    KVDECODE_CHECK(head_size() % 2 == 0, "ModelConfig: head_size = dim / n_heads = ", dim, " / ",
                   n_heads, " = ", head_size(), " must be even for RoPE");
    KVDECODE_CHECK(rope_theta > 1.0, "ModelConfig: rope_theta (", rope_theta,
                   ") must be greater than 1");
    KVDECODE_CHECK(norm_eps > 0.0 && norm_eps < 1.0, "ModelConfig: norm_eps (", norm_eps,
                   ") must lie in (0, 1)");
    // Token ids are int32 and every per-tensor element count must fit comfortably in 64 bits.
    KVDECODE_CHECK(vocab_size <= std::numeric_limits<std::int32_t>::max(),
                   "ModelConfig: vocab_size (", vocab_size, ") must fit in int32");
    constexpr std::int64_t kMaxSide = std::int64_t{1} << 24;
    for (auto [name, value] : {std::pair{"dim", dim}, std::pair{"hidden_dim", hidden_dim},
                               std::pair{"n_layers", n_layers}, std::pair{"seq_len", seq_len},
                               std::pair{"vocab_size", vocab_size}}) {
      KVDECODE_CHECK(value <= kMaxSide, "ModelConfig: ", name, " (", value,
                     ") exceeds the supported maximum ", kMaxSide);
    }
  }

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;

 private:
  static void check_positive(const char* name, std::int64_t value) {
    KVDECODE_CHECK(value > 0, "ModelConfig: ", name, " must be positive, got ", value);
  }
};

}  // namespace kvdecode
