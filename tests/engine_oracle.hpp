// The engine tests' oracle: a request run alone through generate() on a ContiguousStore of the
// model's length (another store, no batching, no chunking, no preemption), which every engine
// run of that request must equal token for token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode::testing_util {

/// The tokens the request generates alone: prompt, sampling, max_tokens and an optional stop
/// token (-1: none) as the engine's request gives them.
template <class T, class W>
std::vector<std::int32_t> alone(const Model<T, W>& model, const std::vector<std::int32_t>& prompt,
                                const SamplerOptions& sampling, std::size_t max_tokens,
                                std::int32_t stop_token = -1) {
  const ModelConfig& cfg = model.config();
  ContiguousStore<T> cache(cfg);
  Activations<T> act(cfg, {.max_chunk = 16});
  Sampler sampler(cfg.vocab_size, sampling);
  std::vector<std::int32_t> out;
  generate(model, cache, act, std::span<const std::int32_t>(prompt), sampler,
           GenerationOptions{.max_new_tokens = max_tokens, .stop_token = stop_token},
           [&](std::int32_t t) { out.push_back(t); });
  return out;
}

}  // namespace kvdecode::testing_util
