// Sampler: turns logits into the next token. A repetition penalty over recent tokens, then greedy
// (first maximum wins) or temperature, min-p, top-k and top-p, driven by llama2.c's xorshift64*
// generator so a seed reproduces a run.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/softmax_exp.hpp"
#include "kvdecode/error.hpp"

namespace kvdecode {

struct SamplerOptions {
  double temperature = 1.0;  ///< 0 is greedy argmax
  double top_p = 0.9;        ///< nucleus mass; <= 0 or >= 1 disables it (plain multinomial)
  std::int64_t top_k = 0;    ///< keep only the k most likely tokens; 0 disables it
  std::uint64_t seed = 1;    ///< xorshift64* state; must not be 0
  /// Keep only tokens at least min_p times as likely as the most likely one (llama.cpp's min-p),
  /// in [0, 1]; 0 disables it.
  double min_p = 0.0;
  /// CTRL's repetition penalty (Keskar et al. 2019, as llama.cpp): before anything else, the
  /// logit l of every token among the recent ones becomes l / penalty if l > 0, else
  /// l × penalty. 1 disables it; must be > 0.
  double repeat_penalty = 1.0;
  /// How many of the latest tokens the penalty looks at (generate() keeps them).
  std::size_t repeat_last_n = 64;
};

/// llama2.c run.c's random_u32 / random_f32 (xorshift64*).
class XorShiftRng {
 public:
  explicit XorShiftRng(std::uint64_t seed) : state_(seed) {}
  std::uint32_t next_u32() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  }
  /// Uniform in [0, 1) with 24 bits, as run.c.
  float next_f32() { return static_cast<float>(next_u32() >> 8) / 16777216.0f; }

 private:
  std::uint64_t state_;
};

namespace detail {

/// For top_k_top_p: moves the K most likely of the m candidates items [m] to its front
/// (unsorted) and returns K, the least of 128 × 4^j and limit for which the running sum of the K
/// in sorted order certainly exceeds top_p (or limit). That running sum c_K is computed in P and
/// falls short of the exact sum s by at most γ_K s (Higham's γ_K = K u / (1 − K u), u the unit
/// roundoff of P); the sum S below, in double, exceeds s by at most γ_m s, so S (1 − γ_K) / (1 +
/// γ_m) > top_p proves c_K > top_p (K + 4 and m + 4 cover the rounding of the test itself).
template <class P, class Item, class ProbOf, class Less>
std::size_t nucleus_prefix(std::span<Item> items, ProbOf prob_of, std::size_t limit, P top_p,
                           Less less) {
  const std::size_t m = items.size();
  const double u = std::numeric_limits<P>::epsilon() / 2;
  const double u_sum = std::numeric_limits<double>::epsilon() / 2;
  const auto gamma = [](double n, double unit) { return n * unit / (1.0 - n * unit); };
  const double sum_slack = 1.0 + gamma(static_cast<double>(m + 4), u_sum);
  double sum = 0;  // of the probabilities of items[0..k)
  std::size_t begin = 0;
  std::size_t k = std::min<std::size_t>(limit, 128);
  for (;;) {
    if (k < m)
      std::nth_element(items.begin() + static_cast<std::ptrdiff_t>(begin),
                       items.begin() + static_cast<std::ptrdiff_t>(k), items.end(), less);
    for (std::size_t i = begin; i < k; ++i) sum += prob_of(items[i]);
    if (k == limit ||
        sum * (1.0 - gamma(static_cast<double>(k + 4), u)) / sum_slack > static_cast<double>(top_p))
      return k;
    begin = k;
    k = std::min(limit, 4 * k);
  }
}

/// The candidates top-k then top-p keep (run.c sample_topp()), for probabilities P = float (the
/// Sampler, as run.c) or double (speculative decoding's exact distribution): candidates below
/// (1 - top_p) / (n - 1) dropped first (the others hold more than top_p, unless all n are below
/// it), the rest sorted by probability, descending (ties by index, where run.c's qsort leaves
/// them unspecified), cut after the k-th and after the first whose running sum exceeds top_p
/// (all of them when none does). Returns count and their summed probability.
template <class P>
struct KeptCandidates {
  std::size_t count;
  P mass;
};

/// The rule above on items [n] of any form: item(i) makes candidate i's item, prob_of(item) reads
/// its probability back and less orders items by (probability descending, index ascending).
/// Leaves the kept ones in items[0..count) in that order.
template <class P, class Item, class MakeItem, class ProbOf, class Less>
KeptCandidates<P> cut_candidates(std::span<const P> probs, std::size_t k, P top_p,
                                 std::span<Item> items, MakeItem item, ProbOf prob_of, Less less) {
  const std::size_t n = probs.size();
  const P cutoff = top_p < P(1) && n > 1 ? (P(1) - top_p) / static_cast<P>(n - 1) : P(0);
  std::size_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {  // no branch: whether one is taken is the data's
    items[m] = item(i);
    m += probs[i] >= cutoff ? 1 : 0;
  }
  // With top_p < 1/n a flat distribution can leave every candidate below the cutoff (run.c then
  // indexes before its array): all of them stay candidates.
  if (m == 0)
    for (; m < n; ++m) items[m] = item(m);
  // Only the candidates up to where the running sum passes top_p need their order, usually a
  // small share of them. Select the K most likely (nth_element), K growing 4× while their sum
  // could still fall short of top_p, then sort those K alone. (probability, index) is a strict
  // order, so they are the first K of the full sort and the cut below is the full sort's.
  const std::size_t keep_k = std::min(k, m);
  const std::size_t sorted = nucleus_prefix(items.first(m), prob_of, keep_k, top_p, less);
  std::sort(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(sorted), less);
  P cumulative = 0;
  for (std::size_t i = 0; i < sorted; ++i) {
    cumulative += prob_of(items[i]);
    if (cumulative > top_p) return {i + 1, cumulative};
  }
  return {sorted, cumulative};
}

/// The rule on candidate ids: writes the kept ids to order[0..count) (order [n] is scratch).
template <class P>
KeptCandidates<P> top_k_top_p(std::span<const P> probs, std::size_t k, P top_p,
                              std::span<std::int32_t> order) {
  return cut_candidates(
      probs, k, top_p, order, [](std::size_t i) { return static_cast<std::int32_t>(i); },
      [&](std::int32_t id) { return probs[static_cast<std::size_t>(id)]; },
      [&](std::int32_t a, std::int32_t b) {
        const P pa = probs[static_cast<std::size_t>(a)];
        const P pb = probs[static_cast<std::size_t>(b)];
        return pa > pb || (pa == pb && a < b);
      });
}

/// A float candidate as one integer whose ascending order is (probability descending, id
/// ascending): the probability's bits complemented above the id. Probabilities are ≥ 0, whose
/// bits order as unsigned integers; a NaN counts as 0 (last).
inline std::uint64_t candidate_key(float p, std::size_t id) {
  const std::uint32_t bits = p > 0.0f ? std::bit_cast<std::uint32_t>(p) : 0u;
  return (std::uint64_t{~bits} << 32) | static_cast<std::uint32_t>(id);
}

/// The id a candidate_key holds.
inline std::int32_t candidate_id(std::uint64_t key) {
  return static_cast<std::int32_t>(key & 0xFFFFFFFFu);
}

/// The rule for float probabilities on packed keys (candidate_key): one integer comparison per
/// step of the selection and the sort instead of two probability loads. The kept ids are the
/// low 32 bits of keys[0..count) (keys [n] is scratch); the same cut as on ids.
inline KeptCandidates<float> top_k_top_p(std::span<const float> probs, std::size_t k, float top_p,
                                         std::span<std::uint64_t> keys) {
  return cut_candidates(
      probs, k, top_p, keys, [&](std::size_t i) { return candidate_key(probs[i], i); },
      [&](std::uint64_t key) { return probs[static_cast<std::size_t>(candidate_id(key))]; },
      std::less<std::uint64_t>());
}

}  // namespace detail

/// Samples token ids from logits. Holds its scratch ([vocab_size] probabilities and candidate
/// keys), so sampling allocates nothing; not shareable between threads.
class Sampler {
 public:
  Sampler(std::int64_t vocab_size, const SamplerOptions& options)
      : options_(options), rng_(options.seed) {
    KVDECODE_CHECK(vocab_size > 0 && vocab_size <= std::numeric_limits<std::int32_t>::max(),
                   "Sampler: vocab_size must be in [1, 2^31 - 1] (token ids are int32), got ",
                   vocab_size);
    KVDECODE_CHECK(options.temperature >= 0.0 && std::isfinite(options.temperature),
                   "Sampler: temperature must be a finite number >= 0, got ", options.temperature);
    KVDECODE_CHECK(std::isfinite(options.top_p), "Sampler: top_p must be finite, got ",
                   options.top_p);
    KVDECODE_CHECK(options.top_k >= 0, "Sampler: top_k must be >= 0, got ", options.top_k);
    KVDECODE_CHECK(options.seed != 0, "Sampler: seed 0 would freeze xorshift64*; use any other");
    KVDECODE_CHECK(options.min_p >= 0.0 && options.min_p <= 1.0,
                   "Sampler: min_p must be in [0, 1], got ", options.min_p);
    KVDECODE_CHECK(options.repeat_penalty > 0.0 && std::isfinite(options.repeat_penalty),
                   "Sampler: repeat_penalty must be a finite number > 0, got ",
                   options.repeat_penalty);
    probs_.resize(static_cast<std::size_t>(vocab_size));
    keys_.resize(static_cast<std::size_t>(vocab_size));
    if (options.repeat_penalty != 1.0) {
      penalized_.resize(static_cast<std::size_t>(vocab_size));
      seen_.assign(static_cast<std::size_t>(vocab_size), 0);
    }
  }

  const SamplerOptions& options() const { return options_; }

  /// The first index of the largest logit (NaNs never win).
  template <class T>
  static std::int32_t argmax(std::span<const T> logits) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<std::int32_t>(best);
  }

  /// The next token for logits [vocab_size], with the repetition penalty over `recent` (the
  /// latest tokens, in any order; ids outside the vocabulary are refused).
  template <class T>
  std::int32_t sample(std::span<const T> logits, std::span<const std::int32_t> recent = {}) {
    KVDECODE_CHECK(logits.size() == probs_.size(), "Sampler::sample: ", logits.size(),
                   " logits for a vocabulary of ", probs_.size());
    if (options_.repeat_penalty == 1.0 || recent.empty()) return sample_from(logits);
    return sample_from(penalized(logits, recent));
  }

  /// The logits sample() draws from when the repetition penalty applies (repeat_penalty ≠ 1):
  /// a copy of logits [vocab_size] with each distinct token of `recent` penalised, in the
  /// sampler's scratch (valid until the next call). Speculative verification scores its rows
  /// with it.
  template <class T>
  std::span<const float> penalized(std::span<const T> logits,
                                   std::span<const std::int32_t> recent) {
    KVDECODE_CHECK(options_.repeat_penalty != 1.0,
                   "Sampler::penalized: the repeat penalty is 1 (off)");
    KVDECODE_CHECK(logits.size() == probs_.size(), "Sampler::penalized: ", logits.size(),
                   " logits for a vocabulary of ", probs_.size());
    for (const std::int32_t id : recent)
      KVDECODE_CHECK(id >= 0 && static_cast<std::size_t>(id) < penalized_.size(),
                     "Sampler: recent token id ", id, " is outside [0, vocab_size ",
                     penalized_.size(), ")");
    std::copy(logits.begin(), logits.end(), penalized_.begin());
    apply_repeat_penalty(recent);
    return penalized_;
  }

 private:
  // Each distinct recent token once: l / penalty for l > 0, else l × penalty.
  void apply_repeat_penalty(std::span<const std::int32_t> recent) {
    const auto penalty = static_cast<float>(options_.repeat_penalty);
    for (const std::int32_t id : recent) {
      const auto i = static_cast<std::size_t>(id);
      if (seen_[i]) continue;
      seen_[i] = 1;
      penalized_[i] = penalized_[i] > 0.0f ? penalized_[i] / penalty : penalized_[i] * penalty;
    }
    for (const std::int32_t id : recent) seen_[static_cast<std::size_t>(id)] = 0;
  }

  template <class T>
  std::int32_t sample_from(std::span<const T> logits) {
    if (options_.temperature == 0.0) return argmax(logits);
    // softmax(logits / temperature), as run.c: subtract the max, exp, normalise. The exp is the
    // kernel set's vector one (softmax_exp.hpp, within 4 · 2⁻²⁴ of exp in double), not a libm
    // call per vocabulary entry; run.c's expf differs from it by about 1e-7 of a probability.
    const float inv_t = static_cast<float>(1.0 / options_.temperature);
    for (std::size_t i = 0; i < logits.size(); ++i)
      probs_[i] = static_cast<float>(logits[i]) * inv_t;
    // The largest, NaNs skipped as std::max(m, x) skips them, in vector registers.
    const float max_l = Eigen::Map<const Eigen::VectorXf>(probs_.data(),
                                                          static_cast<Eigen::Index>(probs_.size()))
                            .maxCoeff<Eigen::PropagateNumbers>();  // vocab_size > 0
    const float sum = detail::softmax_exp(active_kernel_set(), probs_.data(), probs_.size(), max_l);
    for (float& p : probs_) p /= sum;
    if (options_.min_p > 0.0) {
      // Drop every token below min_p × the largest probability, then renormalise.
      const float floor =
          static_cast<float>(options_.min_p) * *std::max_element(probs_.begin(), probs_.end());
      float kept = 0.0f;
      for (float& p : probs_) {
        if (p < floor) p = 0.0f;
        kept += p;
      }
      for (float& p : probs_) p /= kept;
    }
    const float coin = rng_.next_f32();
    const std::size_t n = probs_.size();
    const bool use_k = options_.top_k > 0 && static_cast<std::size_t>(options_.top_k) < n;
    const bool use_p = options_.top_p > 0.0 && options_.top_p < 1.0;
    if (!use_k && !use_p) return multinomial(coin);
    return truncated(coin, use_k ? static_cast<std::size_t>(options_.top_k) : n,
                     use_p ? static_cast<float>(options_.top_p) : 1.0f);
  }

  // run.c sample_mult(): the first i with coin < cdf_i, else the last index.
  std::int32_t multinomial(float coin) const {
    float cdf = 0.0f;
    for (std::size_t i = 0; i < probs_.size(); ++i) {
      cdf += probs_[i];
      if (coin < cdf) return static_cast<std::int32_t>(i);
    }
    return static_cast<std::int32_t>(probs_.size() - 1);
  }

  // Top-k then top-p (detail::top_k_top_p), sampled in proportion within the kept candidates.
  std::int32_t truncated(float coin, std::size_t k, float top_p) {
    const auto kept = detail::top_k_top_p(std::span<const float>(probs_), k, top_p,
                                          std::span<std::uint64_t>(keys_));
    const auto id = [&](std::size_t i) { return detail::candidate_id(keys_[i]); };
    const float r = coin * kept.mass;
    float cdf = 0.0f;
    for (std::size_t i = 0; i < kept.count; ++i) {
      cdf += probs_[static_cast<std::size_t>(id(i))];
      if (r < cdf) return id(i);
    }
    return id(kept.count - 1);
  }

  SamplerOptions options_;
  XorShiftRng rng_;
  std::vector<float> probs_;         // [vocab_size]
  std::vector<std::uint64_t> keys_;  // [vocab_size] candidates (candidate_key), sorted
  std::vector<float> penalized_;     // [vocab_size] logits after the repetition penalty
  std::vector<std::uint8_t> seen_;   // [vocab_size] 1 while a recent id is being penalised
};

}  // namespace kvdecode
