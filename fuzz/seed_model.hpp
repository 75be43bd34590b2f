// The tiny model the cache-file fuzz target and the seed generator share (dim 16, 1 layer,
// vocab 11, seq_len 8), so the seed cache files match the target's fingerprint.
#pragma once

#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"

namespace kvdecode::fuzz {

inline ModelConfig seed_config() {
  ModelConfig c;
  c.dim = 16;
  c.hidden_dim = 24;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.vocab_size = 11;
  c.seq_len = 8;
  return c;
}

inline Weights<float> seed_weights() { return random_weights<float>(seed_config(), 8); }

}  // namespace kvdecode::fuzz
