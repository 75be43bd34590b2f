// The demo model: one fixed shape with deterministic random weights that the example programs
// and the benchmarks run when no checkpoint is given. Its text is noise; its timings are real.
#pragma once

#include <cstdint>

#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"

namespace kvdecode {

/// The demo shape: 4 layers of dim 256, 8 query heads sharing 4 kv heads (GQA, head_size 32),
/// a 512-piece vocabulary (llama2.c's layout: 3 specials, 256 bytes, then pieces) and 1024
/// positions. About 3.3M parameters, 13 MB as f32.
inline ModelConfig demo_config() {
  ModelConfig c;
  c.dim = 256;
  c.hidden_dim = 768;
  c.n_layers = 4;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 1024;
  return c;
}

/// The seed of the demo weights: every program that says "demo model" runs the same numbers.
inline constexpr std::uint64_t kDemoWeightSeed = 2026;

/// The demo model's weights: random_weights(demo_config(), kDemoWeightSeed).
template <class T>
Weights<T> demo_weights() {
  return random_weights<T>(demo_config(), kDemoWeightSeed);
}

}  // namespace kvdecode
