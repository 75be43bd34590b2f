// Speculative decoding's parts: a drafter proposes the next few tokens, the target model runs them
// in one pass (a decode step reads every weight once, so verifying k tokens costs about one
// step), keeps the longest prefix it agrees with plus one token of its own, and rolls the rest
// out of its cache. Here: the drafters, the rollback rules and the Speculation option; generate()
// (generate.hpp) runs the passes. Leviathan et al. 2023, Chen et al. 2023; docs/SPECULATIVE.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/generation/sampler.hpp"
#include "kvdecode/model/activations.hpp"
#include "kvdecode/model/model.hpp"
#include "kvdecode/store/kv_store.hpp"

namespace kvdecode {

namespace detail {

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

// ---------------------------------------------------------------------------------------------
// Drafters

/// Proposes tokens to follow `context` (every token so far, the one about to be fed last):
/// draft() writes up to out.size() of them to out and returns how many (0 = no proposal, the
/// step runs as a plain decode step). A drafter that samples its proposals also has
/// distribution(i): the probabilities [vocab_size] it drew proposal i from in the last draft()
/// (an empty span when it chose greedily); one without it proposes deterministically.
template <class D>
concept Drafter = requires(D& d, std::span<const std::int32_t> context,
                           std::span<std::int32_t> out) {
  { d.draft(context, out) } -> std::same_as<std::size_t>;
};

struct PromptLookupOptions {
  std::size_t max_ngram = 3;  ///< longest suffix of the context looked up
  std::size_t min_ngram = 1;  ///< shortest; below it nothing is proposed
};

/// Prompt lookup (llama.cpp's lookup decoding, vLLM's n-gram speculator): finds the longest
/// suffix of the context, from max_ngram down to min_ngram tokens, that occurred earlier in the
/// context, and proposes the tokens that followed its latest earlier occurrence. No model; it
/// pays off when the output quotes the prompt or repeats itself.
class PromptLookupDrafter {
 public:
  explicit PromptLookupDrafter(const PromptLookupOptions& options = {}) : options_(options) {
    KVDECODE_CHECK(options.min_ngram >= 1 && options.min_ngram <= options.max_ngram,
                   "PromptLookupDrafter: n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, "
                   "got min_ngram ",
                   options.min_ngram, " and max_ngram ", options.max_ngram);
  }

  std::size_t draft(std::span<const std::int32_t> context, std::span<std::int32_t> out) const {
    const std::size_t m = context.size();
    if (out.empty()) return 0;
    for (std::size_t n = std::min(options_.max_ngram, m > 0 ? m - 1 : 0); n >= options_.min_ngram;
         --n) {
      const std::span<const std::int32_t> suffix = context.subspan(m - n);
      // Latest occurrence first: recent text predicts the next tokens best.
      for (std::size_t i = m - n; i-- > 0;) {
        if (!std::equal(suffix.begin(), suffix.end(), context.begin() + i)) continue;
        const std::size_t from = i + n;  // < m, as i < m - n
        const std::size_t count = std::min(out.size(), m - from);
        std::copy_n(context.begin() + from, count, out.begin());
        return count;
      }
    }
    return 0;
  }

 private:
  PromptLookupOptions options_;
};

namespace detail {

/// The distribution Sampler draws from for these logits (already penalised where the sampler
/// penalises): softmax(logits / temperature); with min_p, every token below min_p × the largest
/// probability dropped and the rest renormalised; then cut by top-k and top-p as Sampler cuts it
/// (top_k_top_p, in double), renormalised. probs [vocab_size] receives it; order [vocab_size] is
/// scratch. Needs temperature > 0.
template <class T>
void sampling_distribution(std::span<const T> logits, const SamplerOptions& options,
                           std::span<double> probs, std::span<std::int32_t> order) {
  const std::size_t n = logits.size();
  const double inv_t = 1.0 / options.temperature;
  double max_l = -INFINITY;
  for (std::size_t i = 0; i < n; ++i)
    max_l = std::max(max_l, static_cast<double>(logits[i]) * inv_t);
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    probs[i] = std::exp(static_cast<double>(logits[i]) * inv_t - max_l);
    sum += probs[i];
  }
  for (std::size_t i = 0; i < n; ++i) probs[i] /= sum;
  if (options.min_p > 0.0) {
    const double floor = options.min_p * *std::max_element(probs.begin(), probs.end());
    double kept = 0;
    for (double& p : probs) {
      if (p < floor) p = 0.0;
      kept += p;
    }
    for (double& p : probs) p /= kept;
  }
  const bool use_k = options.top_k > 0 && static_cast<std::size_t>(options.top_k) < n;
  const bool use_p = options.top_p > 0.0 && options.top_p < 1.0;
  if (!use_k && !use_p) return;
  const auto kept = top_k_top_p(std::span<const double>(probs),
                                use_k ? static_cast<std::size_t>(options.top_k) : n,
                                use_p ? options.top_p : 1.0, order);
  // Keep order[0..count) (marked by a negative sign), zero the rest, renormalise.
  for (std::size_t i = 0; i < kept.count; ++i) probs[static_cast<std::size_t>(order[i])] *= -1.0;
  for (std::size_t i = 0; i < n; ++i) probs[i] = probs[i] < 0 ? -probs[i] / kept.mass : 0.0;
}

/// Index drawn from probs [n] (summing to 1 up to rounding) with a uniform coin in [0, 1).
inline std::int32_t draw(std::span<const double> probs, double coin) {
  double cdf = 0;
  std::size_t last = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    last = i;
    cdf += probs[i];
    if (coin < cdf) return static_cast<std::int32_t>(i);
  }
  return static_cast<std::int32_t>(last);
}

/// A uniform coin in [0, 1) with 53 bits, from two xorshift64* draws.
inline double coin(XorShiftRng& rng) {
  const std::uint64_t hi = rng.next_u32() >> 5;  // 27 bits
  const std::uint64_t lo = rng.next_u32() >> 6;  // 26 bits
  return static_cast<double>((hi << 26) | lo) * (1.0 / 9007199254740992.0);
}

}  // namespace detail

/// A smaller model with its own store proposes by decoding ahead of the target. Before each
/// draft its store is brought to the context: truncated to the longest prefix it shares with
/// it (a reset and a fresh prefill when the store cannot undo that far exactly), then fed the
/// rest. With sampling.temperature 0 it proposes its argmax; otherwise it samples its own
/// distribution and reports it through distribution(i). The store must hold at least as many
/// positions as the target's.
template <class T, class W, KvStore S>
class DraftModelDrafter {
 public:
  DraftModelDrafter(const Model<T, W>& model, S& store, Activations<T>& act, std::size_t max_draft,
                    const SamplerOptions& sampling = {.temperature = 0})
      : model_(&model),
        store_(&store),
        act_(&act),
        sampling_(sampling),
        rng_(sampling.seed ^ 0x9E3779B97F4A7C15ull),
        vocab_(static_cast<std::size_t>(model.config().vocab_size)),
        probs_(max_draft * vocab_),
        order_(vocab_) {}

  std::size_t draft(std::span<const std::int32_t> context, std::span<std::int32_t> out) {
    KVDECODE_CHECK(!context.empty(), "DraftModelDrafter::draft: empty context");
    KVDECODE_CHECK(out.size() * vocab_ <= probs_.size(), "DraftModelDrafter::draft: ", out.size(),
                   " proposals asked, built for at most ", probs_.size() / vocab_);
    // Bring the store to context[0, m - 1): the last token is fed below to get its logits.
    const std::size_t m = context.size();
    const std::span<const std::int32_t> held = store_->tokens();
    std::size_t common = 0;
    while (common < held.size() && common + 1 < m && held[common] == context[common]) ++common;
    if (held.size() - common <= store_->max_exact_rollback()) {
      store_->truncate(common);
    } else {
      store_->reset();
      common = 0;
    }
    const std::size_t room = store_->capacity() - store_->size();
    if (room < m - common) return 0;  // the context no longer fits: no proposal
    std::span<const std::int32_t> rest = context.subspan(common);
    const std::size_t at_once = std::min(rest.size(), detail::append_limit(*store_));
    std::span<const T> logits = model_->prefill(rest.first(at_once), *store_, *act_);
    for (const std::int32_t token : rest.subspan(at_once))
      logits = model_->decode(token, *store_, *act_);
    // Proposal i + 1 needs proposal i fed: at most room - (m - common) + 1 proposals.
    const std::size_t k = std::min(out.size(), store_->capacity() - store_->size() + 1);
    for (std::size_t i = 0; i < k; ++i) {
      if (i > 0) logits = model_->decode(out[i - 1], *store_, *act_);
      if (sampling_.temperature == 0) {
        out[i] = Sampler::argmax(logits);
      } else {
        const std::span<double> q(probs_.data() + i * vocab_, vocab_);
        detail::sampling_distribution(logits, sampling_, q, std::span<std::int32_t>(order_));
        out[i] = detail::draw(q, detail::coin(rng_));
      }
    }
    return k;
  }

  /// The distribution proposal i of the last draft() was drawn from; empty when greedy.
  std::span<const double> distribution(std::size_t i) const {
    if (sampling_.temperature == 0) return {};
    return {probs_.data() + i * vocab_, vocab_};
  }

 private:
  const Model<T, W>* model_;
  S* store_;
  Activations<T>* act_;
  SamplerOptions sampling_;
  XorShiftRng rng_;
  std::size_t vocab_;
  std::vector<double> probs_;        // [max_draft][vocab_size] distribution of each proposal
  std::vector<std::int32_t> order_;  // [vocab_size] scratch of sampling_distribution
};

// ---------------------------------------------------------------------------------------------
// Verification and rollback

/// The most tokens one verification pass may append to `cache`: what the store takes in one
/// append, lowered by a store whose chunked append would compute differently from decoding the
/// tokens one at a time (an optional max_exact_append() member: a 4-bit store's chunk must not
/// complete a key group before its first row).
template <KvStore S>
std::size_t speculative_append_limit(const S& cache) {
  std::size_t n = detail::append_limit(cache);
  if constexpr (requires {
                  { cache.max_exact_append() } -> std::same_as<std::size_t>;
                }) {
    n = std::min(n, cache.max_exact_append());
  }
  return n;
}

/// Rolls `cache` back to its first `keep` positions, exactly: as if the others had never been
/// appended. Throws Error, changing nothing, when the store cannot undo that many
/// (max_exact_rollback()); verification appends at most speculative_append_limit() tokens and
/// keeps at least the first, which every store in this library can then undo.
template <KvStore S>
void speculative_rollback(S& cache, std::size_t keep) {
  KVDECODE_CHECK(keep <= cache.size(), "speculative_rollback: keep ", keep, " of ", cache.size(),
                 " positions");
  const std::size_t drop = cache.size() - keep;
  KVDECODE_CHECK(drop <= cache.max_exact_rollback(), "speculative_rollback: ", drop,
                 " positions to drop but the store undoes at most ", cache.max_exact_rollback(),
                 " exactly");
  if (drop > 0) cache.truncate(keep);
}

// ---------------------------------------------------------------------------------------------
// The option generate() takes

/// A non-owning handle on any Drafter, so that GenerationOptions can name one without being a
/// template: two function pointers, called once per target pass (not per token). The drafter
/// must outlive the handle's use.
class DrafterRef {
 public:
  DrafterRef() = default;
  template <Drafter D>
  explicit DrafterRef(D& drafter)
      : object_(const_cast<void*>(static_cast<const void*>(&drafter))),
        draft_([](void* o, std::span<const std::int32_t> context, std::span<std::int32_t> out) {
          return static_cast<D*>(o)->draft(context, out);
        }),
        distribution_([](const void* o, std::size_t i) -> std::span<const double> {
          if constexpr (requires(const D& d) { d.distribution(std::size_t{0}); }) {
            return static_cast<const D*>(o)->distribution(i);
          } else {
            return {};
          }
        }) {}

  explicit operator bool() const { return object_ != nullptr; }
  std::size_t draft(std::span<const std::int32_t> context, std::span<std::int32_t> out) const {
    return draft_(object_, context, out);
  }
  /// The drafter's distribution(i), empty for a deterministic drafter.
  std::span<const double> distribution(std::size_t i) const { return distribution_(object_, i); }

 private:
  void* object_ = nullptr;
  std::size_t (*draft_)(void*, std::span<const std::int32_t>, std::span<std::int32_t>) = nullptr;
  std::span<const double> (*distribution_)(const void*, std::size_t) = nullptr;
};

/// Speculative decoding as generate() runs it (GenerationOptions::speculation): none, prompt
/// lookup, or any drafter the caller owns (a DraftModelDrafter: a smaller model on its own
/// store).
struct Speculation {
  enum class Kind { kNone, kPromptLookup, kDrafter };
  Kind kind = Kind::kNone;
  /// k: tokens drafted per target pass. A pass runs k + 1 tokens, capped by the Activations'
  /// max_chunk, the few-token GEMM's width and speculative_append_limit(); 0 = plain decoding.
  std::size_t max_draft = 4;
  PromptLookupOptions lookup{};  ///< the n-gram sizes of kPromptLookup
  DrafterRef drafter{};          ///< the drafter of kDrafter

  static Speculation prompt_lookup(std::size_t k = 4, const PromptLookupOptions& options = {}) {
    return {.kind = Kind::kPromptLookup, .max_draft = k, .lookup = options};
  }
  template <Drafter D>
  static Speculation with_drafter(D& drafter, std::size_t k = 4) {
    return {.kind = Kind::kDrafter, .max_draft = k, .drafter = DrafterRef(drafter)};
  }
};

/// The most proposals one pass verifies: a pass of k + 1 tokens stays within the few-token GEMM,
/// whose products equal decoding's bit for bit. A larger k is capped to it.
inline constexpr std::size_t kMaxSpeculativeDraft = detail::kMaxFewTokens - 1;

/// speculative_generate()'s pass size.
struct SpeculativeOptions {
  /// k: as Speculation::max_draft.
  std::size_t max_draft = 4;
};

}  // namespace kvdecode
