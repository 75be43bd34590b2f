// generate(): the generation loop. Prompt → prefill → sample → decode until n tokens, a stop
// token or a full cache, handing each token to a callback and timing every phase.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvdecode/activations.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model.hpp"
#include "kvdecode/sampler.hpp"

namespace kvdecode {

struct GenerationOptions {
  std::size_t max_new_tokens = 256;
  std::int32_t stop_token = -1;  ///< generation ends after emitting it; -1 = none
  /// false re-runs the full forward (prefill of every token so far into an emptied store) for
  /// each new token: the same tokens at the cost a KV cache removes.
  bool use_cache = true;
};

struct GenerationStats {
  std::size_t prompt_tokens = 0;
  std::size_t generated_tokens = 0;
  double prefill_ms = 0;  ///< prompt → its last logits
  double ttft_ms = 0;     ///< start → the first generated token is known
  double decode_ms = 0;   ///< every later forward step
  bool hit_stop_token = false;
  bool hit_capacity = false;
  double prefill_tokens_per_s() const {
    return prefill_ms > 0 ? 1e3 * static_cast<double>(prompt_tokens) / prefill_ms : 0;
  }
  /// Tokens produced by decode steps (all but the first, which prefill's logits give).
  double decode_tokens_per_s() const {
    return decode_ms > 0 && generated_tokens > 1
               ? 1e3 * static_cast<double>(generated_tokens - 1) / decode_ms
               : 0;
  }
};

/// Generates up to options.max_new_tokens tokens after prompt into `cache`, which must be empty.
/// on_token(id) is called for every generated token as soon as it is sampled; it may return
/// false to stop. Returns the timings. The store then holds the prompt and every generated
/// token but the last (which was never fed back).
template <class T, KvStore S, class OnToken>
GenerationStats generate(const Model<T>& model, S& cache, Activations<T>& act,
                         std::span<const std::int32_t> prompt, Sampler& sampler,
                         const GenerationOptions& options, OnToken&& on_token) {
  using Clock = std::chrono::steady_clock;
  const auto ms = [](Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  KVDECODE_CHECK(!prompt.empty(), "generate: the prompt has no tokens (start it with BOS)");
  KVDECODE_CHECK(cache.size() == 0, "generate: the cache already holds ", cache.size(),
                 " positions; reset() it or continue with prefill()/decode()");
  KVDECODE_CHECK(prompt.size() <= cache.capacity(), "generate: the prompt has ", prompt.size(),
                 " tokens but the cache holds at most ", cache.capacity());
  GenerationStats stats;
  stats.prompt_tokens = prompt.size();
  // The whole sequence, for the no-cache mode's recompute; reserved so the loop never grows it.
  std::vector<std::int32_t> sequence;
  if (!options.use_cache) {
    sequence.reserve(cache.capacity());
    sequence.assign(prompt.begin(), prompt.end());
  }
  const auto start = Clock::now();
  std::span<const T> logits = model.prefill(prompt, cache, act);
  stats.prefill_ms = ms(Clock::now() - start);
  const auto decode_start = Clock::now();
  bool first = true;
  while (stats.generated_tokens < options.max_new_tokens) {
    const std::int32_t token = sampler.sample(logits);
    if (first) {
      stats.ttft_ms = ms(Clock::now() - start);
      first = false;
    }
    ++stats.generated_tokens;
    bool go_on = true;
    if constexpr (std::is_same_v<std::invoke_result_t<OnToken&, std::int32_t>, bool>) {
      go_on = on_token(token);
    } else {
      on_token(token);
    }
    if (token == options.stop_token) {
      stats.hit_stop_token = true;
      break;
    }
    if (!go_on || stats.generated_tokens == options.max_new_tokens) break;
    if (cache.size() == cache.capacity()) {
      stats.hit_capacity = true;
      break;
    }
    if (options.use_cache) {
      logits = model.decode(token, cache, act);
    } else {
      sequence.push_back(token);
      cache.reset();
      logits = model.prefill(std::span<const std::int32_t>(sequence), cache, act);
    }
  }
  stats.decode_ms = ms(Clock::now() - decode_start);
  return stats;
}

}  // namespace kvdecode
