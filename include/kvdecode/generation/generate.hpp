// generate(): the generation loop. Prompt → prefill → sample → decode until n tokens, a stop
// token or a full cache, handing each token to a callback and timing every phase. It continues
// from whatever the cache already holds (a restored prompt prefix, an earlier turn).
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/generation/sampler.hpp"
#include "kvdecode/model/activations.hpp"
#include "kvdecode/model/model.hpp"
#include "kvdecode/store/kv_store.hpp"

namespace kvdecode {

struct GenerationOptions {
  std::size_t max_new_tokens = 256;
  /// Generation ends after emitting this token (llama2.c's run.c stops at BOS = 1); -1 = none,
  /// which keeps going past every token so that exactly max_new_tokens are generated.
  std::int32_t stop_token = -1;
  /// false re-runs the full forward (prefill of every token so far into an emptied store) for
  /// each new token: the same tokens at the cost a KV cache removes.
  bool use_cache = true;
};

struct GenerationStats {
  std::size_t cached_tokens = 0;  ///< positions the cache held before the call (not prefilled)
  std::size_t prompt_tokens = 0;  ///< tokens of `prompt`: the ones this call prefilled
  /// Prompt tokens a capped store took one at a time through decode (a streaming window past
  /// its S + W positions); included in prompt_tokens and prefill_ms.
  std::size_t prompt_tokens_decoded = 0;
  std::size_t generated_tokens = 0;
  double prefill_ms = 0;  ///< prompt → its last logits
  double ttft_ms = 0;     ///< start → the first generated token is known (on_prefilled included)
  double decode_ms = 0;   ///< every later forward step (from after on_prefilled to the end)
  bool hit_stop_token = false;
  bool hit_capacity = false;
  double prefill_tokens_per_s() const {
    return prefill_ms > 0 ? 1e3 * static_cast<double>(prompt_tokens) / prefill_ms : 0;
  }
  /// Generated tokens that took a decode step: all but the first, which prefill's logits give.
  std::size_t decode_steps() const { return generated_tokens > 0 ? generated_tokens - 1 : 0; }
  double decode_tokens_per_s() const {
    return decode_ms > 0 ? 1e3 * static_cast<double>(decode_steps()) / decode_ms : 0;
  }
};

namespace detail {

/// The on_prefilled of a call that passes none.
struct NoHook {
  void operator()() const {}
};

/// Most positions one append to `cache` may hold now: what the store says through an optional
/// max_append() member (a WindowStore caps appends; see there), else its free capacity.
template <KvStore S>
std::size_t append_limit(const S& cache) {
  if constexpr (requires {
                  { cache.max_append() } -> std::same_as<std::size_t>;
                }) {
    return cache.max_append();
  } else {
    return cache.capacity() - cache.size();
  }
}

}  // namespace detail

/// Generates up to options.max_new_tokens tokens into `cache`, continuing after what it already
/// holds: `prompt` is the tokens that follow cache.tokens() (the whole prompt for an empty
/// cache, the rest of it after a restored prefix, or a new turn); it must not be empty, as its
/// last token's logits give the first generated token. The prompt is prefilled in one append
/// where the store allows it; a store that caps an append (a streaming WindowStore past S + W
/// positions) takes what fits, then the rest one token at a time through decode.
///
/// on_prefilled() is called once, after the prompt is in the cache and before the first token
/// is sampled (to save the cache, to reset counters); on_token(id) for every generated token as
/// soon as it is sampled, and may return false to stop. With options.use_cache false, every
/// step recomputes cache.tokens() as they were on entry, then the prompt and the tokens
/// generated so far, into the emptied store. Returns the timings. The store then holds its
/// earlier tokens, the prompt and every generated token but the last (never fed back).
/// Throws Error, before changing anything, for an empty prompt or one the cache has no room for.
template <class T, class W, KvStore S, class OnToken, class OnPrefilled = detail::NoHook>
GenerationStats generate(const Model<T, W>& model, S& cache, Activations<T>& act,
                         std::span<const std::int32_t> prompt, Sampler& sampler,
                         const GenerationOptions& options, OnToken&& on_token,
                         OnPrefilled&& on_prefilled = {}) {
  using Clock = std::chrono::steady_clock;
  const auto ms = [](Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  KVDECODE_CHECK(!prompt.empty(),
                 "generate: the prompt has no tokens (start it with BOS, or "
                 "give at least the last token after the cached ones)");
  KVDECODE_CHECK(prompt.size() <= cache.capacity() - cache.size(), "generate: the prompt has ",
                 prompt.size(), " tokens but the cache, holding ", cache.size(), " of at most ",
                 cache.capacity(), " positions, has room for ", cache.capacity() - cache.size());
  GenerationStats stats;
  stats.cached_tokens = cache.size();
  stats.prompt_tokens = prompt.size();
  // The whole sequence, for the no-cache mode's recompute; reserved so the loop never grows it.
  std::vector<std::int32_t> sequence;
  if (!options.use_cache) {
    const std::size_t room = cache.capacity() - cache.size();  // checked above: >= prompt
    sequence.reserve(cache.size() +
                     std::min(room, prompt.size() + std::min(options.max_new_tokens, room)));
    const std::span<const std::int32_t> held = cache.tokens();
    sequence.assign(held.begin(), held.end());
    sequence.insert(sequence.end(), prompt.begin(), prompt.end());
  }
  // Runs tokens after what the cache holds: one prefill of what the store takes in one append,
  // then decode for the rest. Returns the last token's logits.
  std::size_t decoded = 0;  // prompt tokens a capped store took one at a time
  const auto feed = [&](std::span<const std::int32_t> tokens) {
    std::span<const T> logits;
    for (std::size_t done = 0; done < tokens.size();) {
      const std::size_t at_once = std::min(tokens.size() - done, detail::append_limit(cache));
      if (at_once == 1 && tokens.size() > 1) ++decoded;
      logits = at_once == 1 ? model.decode(tokens[done], cache, act)
                            : model.prefill(tokens.subspan(done, at_once), cache, act);
      done += at_once;
    }
    return logits;
  };

  // The latest sampler.options().repeat_last_n tokens (held, prompt, generated) for the
  // repetition penalty: a ring, as the penalty ignores order; reserved so the loop never grows it.
  // (No more than the cache can hold: a larger window sees the same tokens.)
  const std::size_t last_n = sampler.options().repeat_penalty != 1.0
                                 ? std::min(sampler.options().repeat_last_n, cache.capacity())
                                 : 0;
  std::vector<std::int32_t> recent;
  recent.reserve(last_n);
  std::size_t recent_next = 0;
  const auto remember = [&](std::int32_t token) {
    if (last_n == 0) return;
    if (recent.size() < last_n) {
      recent.push_back(token);
    } else {
      recent[recent_next] = token;
      recent_next = (recent_next + 1) % last_n;
    }
  };
  for (const std::int32_t t : cache.tokens().last(std::min(last_n, cache.size()))) remember(t);
  for (const std::int32_t t : prompt.last(std::min(last_n, prompt.size()))) remember(t);

  const auto start = Clock::now();
  std::span<const T> logits = feed(prompt);
  stats.prompt_tokens_decoded = decoded;
  stats.prefill_ms = ms(Clock::now() - start);
  on_prefilled();
  const auto decode_start = Clock::now();
  bool first = true;
  while (stats.generated_tokens < options.max_new_tokens) {
    const std::int32_t token = sampler.sample(logits, std::span<const std::int32_t>(recent));
    remember(token);
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
      logits = feed(std::span<const std::int32_t>(sequence));
    }
  }
  stats.decode_ms = ms(Clock::now() - decode_start);
  return stats;
}

}  // namespace kvdecode
