// Builds against the installed package and checks one cached decode against the reference.
#include <cmath>
#include <cstdio>
#include <kvdecode/kvdecode.hpp>

int main() {
  kvdecode::ModelConfig cfg;
  cfg.dim = 32;
  cfg.hidden_dim = 64;
  cfg.n_layers = 1;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.vocab_size = 17;
  cfg.seq_len = 8;
  const kvdecode::Model<float> model(kvdecode::random_weights<float>(cfg, 1));
  kvdecode::ContiguousStore<float> cache(cfg);
  kvdecode::Activations<float> act(cfg, {.max_chunk = 1});
  const std::int32_t tokens[] = {1, 5, 9};
  std::span<const float> logits;
  for (const std::int32_t t : tokens) logits = model.decode(t, cache, act);
  const auto ref = model.forward_reference(tokens);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    if (std::abs(logits[i] - ref[2 * 17 + i]) > 1e-4f) {
      std::printf("mismatch at %zu\n", i);
      return 1;
    }
  }
  std::printf("consumer ok: %zu logits\n", logits.size());
  return 0;
}
