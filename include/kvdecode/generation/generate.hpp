// generate(): the generation loop. Prompt → prefill → sample → decode until n tokens, a stop
// token or a full cache, handing each token to a callback and timing every phase. It continues
// from whatever the cache already holds (a restored prompt prefix, an earlier turn). With
// GenerationOptions::speculation a drafter proposes tokens that one target pass verifies.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/generation/sampler.hpp"
#include "kvdecode/generation/speculative.hpp"
#include "kvdecode/model/activations.hpp"
#include "kvdecode/model/model.hpp"
#include "kvdecode/store/kv_store.hpp"

namespace kvdecode {

struct GenerationOptions {
  std::size_t max_new_tokens = 256;
  /// Generation ends after emitting this token (llama2.c's run.c stops at BOS = 1) or any of
  /// stop_tokens (a vocabulary's SpecialTokens::end_tokens()); -1 and an empty list = none,
  /// which keeps going past every token so that exactly max_new_tokens are generated.
  std::int32_t stop_token = -1;
  std::vector<std::int32_t> stop_tokens{};
  /// false re-runs the full forward (prefill of every token so far into an emptied store) for
  /// each new token: the same tokens at the cost a KV cache removes.
  bool use_cache = true;
  /// Speculative decoding: none (the default), prompt lookup, or a drafter such as a smaller
  /// model on its own store (Speculation::prompt_lookup(k), Speculation::with_drafter(d, k)).
  /// Needs use_cache. Every sampler setting applies: a verified row is scored as the sampler
  /// scores it (the repetition penalty over the tokens before it, min-p, top-k, top-p).
  Speculation speculation{};
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
  std::size_t target_passes = 0;  ///< forward passes after the prompt (a decode or a verify)
  std::size_t drafted = 0;        ///< tokens a drafter proposed and a pass verified
  std::size_t accepted = 0;       ///< proposals the target kept
  double draft_ms = 0;            ///< inside the drafter (part of decode_ms)
  double prefill_tokens_per_s() const {
    return prefill_ms > 0 ? 1e3 * static_cast<double>(prompt_tokens) / prefill_ms : 0;
  }
  /// Generated tokens that took a decode step: all but the first, which prefill's logits give.
  std::size_t decode_steps() const { return generated_tokens > 0 ? generated_tokens - 1 : 0; }
  double decode_tokens_per_s() const {
    return decode_ms > 0 ? 1e3 * static_cast<double>(decode_steps()) / decode_ms : 0;
  }
  double acceptance_rate() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0;
  }
  /// Generated tokens per target pass after the first token (1 without speculation).
  double tokens_per_pass() const {
    return target_passes > 0
               ? static_cast<double>(decode_steps()) / static_cast<double>(target_passes)
               : 0;
  }
};

namespace detail {

/// The on_prefilled of a call that passes none.
struct NoHook {
  void operator()() const {}
};

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
///
/// With options.speculation, each step after the first token lets the drafter propose up to k
/// tokens and runs them with the last token in one pass of k + 1 (at most act.max_chunk, 16 and
/// speculative_append_limit(cache)); the longest agreeing prefix and one target token are kept,
/// the rest rolled out of the store exactly. Greedy (temperature 0) gives the tokens plain
/// decoding gives; sampling keeps each proposal d with probability min(1, p(d) / q(d)) and draws
/// a rejection from norm(max(0, p - q)), so the tokens follow the target's distribution (p as
/// Sampler defines it by temperature, top-k and top-p), from a xorshift64* stream seeded by the
/// sampler's seed rather than the sampler's own. See docs/SPECULATIVE.md.
/// Throws Error, before changing anything, for an empty prompt, one the cache has no room for,
/// or a speculation the options cannot honour.
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
  const Speculation& spec = options.speculation;
  const SamplerOptions& sampling = sampler.options();
  const bool speculate = spec.kind != Speculation::Kind::kNone;
  if (speculate) {
    KVDECODE_CHECK(options.use_cache,
                   "generate: speculation verifies proposals against the KV cache; it cannot "
                   "run with use_cache = false");
    KVDECODE_CHECK(spec.kind != Speculation::Kind::kDrafter || spec.drafter,
                   "generate: Speculation::Kind::kDrafter needs a drafter");
  }
  GenerationStats stats;
  stats.cached_tokens = cache.size();
  stats.prompt_tokens = prompt.size();
  // Positions the run can reach: what the cache holds, the prompt, max_new_tokens, the room.
  const std::size_t room = cache.capacity() - cache.size();  // checked above: >= prompt
  const std::size_t reach =
      cache.size() + prompt.size() + std::min(options.max_new_tokens, room - prompt.size());
  // The whole sequence, for the no-cache mode's recompute; reserved so the loop never grows it.
  std::vector<std::int32_t> sequence;
  if (!options.use_cache) {
    KVDECODE_CHECK(cache.tokens().size() == cache.size(),
                   "generate: use_cache = false recomputes the ", cache.size(),
                   " positions the cache holds, but it keeps the token ids of only the newest ",
                   cache.tokens().size());
    sequence.reserve(reach);
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
  const std::size_t last_n =
      sampling.repeat_penalty != 1.0 ? std::min(sampling.repeat_last_n, cache.capacity()) : 0;
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
  for (const std::int32_t t : cache.tokens().last(std::min(last_n, cache.tokens().size())))
    remember(t);
  for (const std::int32_t t : prompt.last(std::min(last_n, prompt.size()))) remember(t);

  // Speculation's state and scratch, allocated once per call (empty without speculation).
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  const bool greedy = sampling.temperature == 0;
  const bool draws = speculate && !greedy;  // speculative sampling draws its own coins
  // One pass: k + 1 tokens, within one chunk and the few-token GEMM, whose products equal the
  // single-token ones bit for bit (so greedy verification agrees with plain decoding).
  const std::size_t max_pass =
      speculate
          ? std::max<std::size_t>(
                1, std::min({std::min(spec.max_draft, kMaxSpeculativeDraft) + 1, act.max_chunk}))
          : 1;
  std::vector<T> all_logits(max_pass > 1 ? max_pass * vocab : 0);  // [max_pass][vocab] a pass
  std::vector<std::int32_t> pass(max_pass);            // [max_pass] the fed token, then proposals
  std::vector<std::int32_t> context;                   // [tokens so far] what the drafter reads
  std::vector<double> p(draws ? vocab : 0);            // [vocab] target distribution of a row
  std::vector<std::int32_t> order(draws ? vocab : 0);  // [vocab] sampling_distribution scratch
  // Up to 64 Ki positions more than the prompt: an unbounded store (a streaming window without
  // a token limit) grows it past that, as it grows its own token list.
  if (max_pass > 1)
    context.reserve(std::min(reach, cache.size() + prompt.size() + (std::size_t{1} << 16)) + 1);
  XorShiftRng rng(sampling.seed);
  const PromptLookupDrafter lookup(
      spec.kind == Speculation::Kind::kPromptLookup ? spec.lookup : PromptLookupOptions{});
  const DrafterRef drafter =
      spec.kind == Speculation::Kind::kPromptLookup ? DrafterRef(lookup) : spec.drafter;

  // f(row as the sampler scores it): penalised over the recent tokens where the penalty applies.
  const auto scored = [&](std::span<const T> row, auto&& f) {
    if (last_n == 0 || recent.empty()) return f(row);
    return f(sampler.penalized(row, std::span<const std::int32_t>(recent)));
  };
  const auto pick = [&](std::span<const T> logits) {  // the next token from a row of logits
    if (!speculate) return sampler.sample(logits, std::span<const std::int32_t>(recent));
    return scored(logits, [&]<class L>(std::span<const L> row) {
      if (greedy) return Sampler::argmax(row);
      detail::sampling_distribution(row, sampling, std::span<double>(p),
                                    std::span<std::int32_t>(order));
      return detail::draw(p, detail::coin(rng));
    });
  };
  bool stop = false;
  const auto emit = [&](std::int32_t token) {  // hands a token out; stop when generation ends
    ++stats.generated_tokens;
    remember(token);
    bool go_on = true;
    if constexpr (std::is_same_v<std::invoke_result_t<OnToken&, std::int32_t>, bool>) {
      go_on = on_token(token);
    } else {
      on_token(token);
    }
    if (token == options.stop_token ||
        std::ranges::find(options.stop_tokens, token) != options.stop_tokens.end()) {
      stats.hit_stop_token = true;
      go_on = false;
    }
    if (stats.generated_tokens == options.max_new_tokens) go_on = false;
    stop = !go_on;
  };
  // One verification pass of pass[0, n): pass[0] is the last token, pass[i + 1] proposal i.
  // Emits the kept proposals and one token of the target's; returns how many it emitted.
  const auto verify = [&](std::size_t n) {
    const std::size_t n_drafted = n - 1;
    model.prefill(std::span<const std::int32_t>(pass).first(n), cache, act,
                  std::span<T>(all_logits).first(n * vocab));
    stats.drafted += n_drafted;
    // Row i is the target's next-token logits after pass[0..i].
    std::size_t emitted = 0;
    for (std::size_t i = 0; i < n && !stop; ++i) {
      const std::span<const T> row(all_logits.data() + i * vocab, vocab);
      bool kept = false;
      std::int32_t token;
      if (i == n_drafted) {  // every proposal kept: the row after the last gives one more
        token = pick(row);
      } else if (greedy) {
        token = scored(row, [](auto r) { return Sampler::argmax(r); });
        kept = token == pass[i + 1];
      } else {
        const std::int32_t d = pass[i + 1];
        scored(row, [&](auto r) {
          detail::sampling_distribution(r, sampling, std::span<double>(p),
                                        std::span<std::int32_t>(order));
        });
        const std::span<const double> q = drafter.distribution(i);
        const auto ud = static_cast<std::size_t>(d);
        const double qd = q.empty() ? 1.0 : q[ud];
        kept = detail::coin(rng) * qd < p[ud];  // probability min(1, p(d) / q(d))
        if (kept) {
          token = d;
        } else {  // residual norm(max(0, p - q)); p itself where it is empty (p ≤ q)
          const auto residual = [&](std::size_t v) {
            return std::max(0.0, p[v] - (q.empty() ? (v == ud ? 1.0 : 0.0) : q[v]));
          };
          double mass = 0;
          for (std::size_t v = 0; v < vocab; ++v) mass += residual(v);
          if (mass > 0) {
            for (std::size_t v = 0; v < vocab; ++v) p[v] = residual(v) / mass;
          }
          token = detail::draw(p, detail::coin(rng));
        }
      }
      ++emitted;
      if (kept) ++stats.accepted;
      emit(token);
      pass[0] = token;  // the last token emitted, fed by the next step
      if (!kept) break;
    }
    return emitted;
  };

  const auto start = Clock::now();
  std::span<const T> logits = feed(prompt);
  stats.prompt_tokens_decoded = decoded;
  stats.prefill_ms = ms(Clock::now() - start);
  on_prefilled();
  const auto decode_start = Clock::now();
  if (options.max_new_tokens > 0) {
    std::int32_t token = pick(logits);
    stats.ttft_ms = ms(Clock::now() - start);
    emit(token);
    while (!stop) {
      if (cache.size() == cache.capacity()) {
        stats.hit_capacity = true;
        break;
      }
      ++stats.target_passes;
      if (!options.use_cache) {
        sequence.push_back(token);
        cache.reset();
        token = pick(feed(std::span<const std::int32_t>(sequence)));
        emit(token);
        continue;
      }
      // A pass emits at most as many tokens as it runs.
      const std::size_t n_max = max_pass > 1
                                    ? std::min({max_pass, speculative_append_limit(cache),
                                                options.max_new_tokens - stats.generated_tokens})
                                    : 1;
      std::size_t n_drafted = 0;
      if (n_max > 1) {
        const auto draft_start = Clock::now();
        const std::span<const std::int32_t> held = cache.tokens();
        context.assign(held.begin(), held.end());
        context.push_back(token);
        n_drafted = drafter.draft(std::span<const std::int32_t>(context),
                                  std::span<std::int32_t>(pass).subspan(1, n_max - 1));
        KVDECODE_CHECK(n_drafted < n_max, "generate: the drafter proposed ", n_drafted,
                       " tokens, at most ", n_max - 1, " were asked for");
        stats.draft_ms += ms(Clock::now() - draft_start);
      }
      if (n_drafted == 0) {  // a plain decode step
        token = pick(model.decode(token, cache, act));
        emit(token);
        continue;
      }
      pass[0] = token;
      const std::size_t first = cache.size();
      const std::size_t emitted = verify(n_drafted + 1);
      token = pass[0];
      // The store keeps the fed token and the kept proposals that were handed out but the last.
      speculative_rollback(cache, first + emitted);
    }
  }
  stats.decode_ms = ms(Clock::now() - decode_start);
  return stats;
}

/// The statistics of a speculative run: GenerationStats, whose speculation counters it fills.
using SpeculativeStats = GenerationStats;

/// generate() with `drafter` proposing up to spec.max_draft tokens per pass and a sampler built
/// from `sampling` (options.use_cache is taken as true): a shorthand for
/// GenerationOptions::speculation = Speculation::with_drafter(drafter, k).
template <class T, class W, KvStore S, Drafter D, class OnToken>
GenerationStats speculative_generate(const Model<T, W>& model, S& cache, Activations<T>& act,
                                     std::span<const std::int32_t> prompt,
                                     const SamplerOptions& sampling, D& drafter,
                                     const GenerationOptions& options,
                                     const SpeculativeOptions& spec, OnToken&& on_token) {
  Sampler sampler(model.config().vocab_size, sampling);
  GenerationOptions with = options;
  with.use_cache = true;
  with.speculation = Speculation::with_drafter(drafter, spec.max_draft);
  return generate(model, cache, act, prompt, sampler, with, std::forward<OnToken>(on_token));
}

}  // namespace kvdecode
