// Speculative decoding: greedy output equals plain greedy generate() on every store kind with
// both drafters (a paged fork's sibling untouched); speculative sampling keeps the target's
// distribution (chi-square over seeded runs, against probabilities from forward_reference);
// random draft / verify / accept / reject sequences on every store kind, each verify row and
// every rollback checked against a fresh recompute of the kept tokens; prompt lookup's proposals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

// ---------------------------------------------------------------------------------------------
// Prompt lookup

TEST(PromptLookupDrafterTest, ProposesWhatFollowedTheLatestLongestMatch) {
  const PromptLookupDrafter lookup({.max_ngram = 3, .min_ngram = 1});
  std::int32_t out[4] = {};
  // Suffix (7, 8) occurs at 1 and 6; the latest earlier one (6) is followed by 9, 7, 8.
  const Tokens context = {5, 7, 8, 1, 2, 0, 7, 8, 9, 7, 8};
  ASSERT_EQ(lookup.draft(context, out), 3u);  // only 3 tokens follow before the end
  EXPECT_EQ(Tokens(out, out + 3), (Tokens{9, 7, 8}));
  // A 3-gram match wins over a later 1-gram one.
  const Tokens longer = {4, 5, 6, 1, 2, 3, 6, 9, 9, 4, 5, 6};
  ASSERT_EQ(lookup.draft(longer, out), 4u);
  EXPECT_EQ(Tokens(out, out + 4), (Tokens{1, 2, 3, 6}));
  // No earlier occurrence of the last token: nothing.
  const Tokens none = {1, 2, 3, 4};
  EXPECT_EQ(lookup.draft(none, out), 0u);
  EXPECT_THROW(PromptLookupDrafter({.max_ngram = 1, .min_ngram = 2}), Error);
}

// ---------------------------------------------------------------------------------------------
// Greedy: token for token what generate() gives

/// A store under test, built twice (plain and speculative runs) the same way. The paged one is
/// a fork of a sequence that holds the first prefix_len prompt tokens, a block boundary falling
/// inside them so the fork's first append copies a shared block; the sibling must not change.
template <class T>
struct Setup {
  static constexpr std::size_t kMaxDraft = 4;
  enum Kind { kContiguous, kInt8, kQ4, kWindow, kStreaming, kPaged };

  template <class F>
  static void with_store(Kind kind, const ModelConfig& cfg, F&& f) {
    switch (kind) {
      case kContiguous: {
        ContiguousStore<T> s(cfg);
        return f(s);
      }
      case kInt8: {
        Int8Store<T> s(cfg);
        return f(s);
      }
      case kQ4: {
        Q4Store<T> s(cfg, 0, 8, 8);  // groups quantized 8 positions behind the newest
        return f(s);
      }
      case kWindow: {
        WindowStore<T> s(cfg, {.window = 12, .max_chunk = kMaxDraft + 1});
        return f(s);
      }
      case kStreaming: {
        WindowStore<T> s(cfg, {.window = 24,
                               .sinks = 2,
                               .policy = WindowPolicy::kStreaming,
                               .max_chunk = kMaxDraft + 1,
                               .capacity = 120});
        return f(s);
      }
      case kPaged:
        break;
    }
    BlockPool<T> pool(cfg, 64, 4);
    PagedStore<T> parent(pool);
    f(parent);  // the caller prefills the shared prefix, then continues in the fork
  }
};

const char* const kKindNames[] = {"contiguous", "int8", "q4", "window", "streaming", "paged"};

/// Every (layer, kv head) row a store hands attention for [0, size), in order.
template <class S>
std::vector<typename S::Scalar> rows_of(const S& s) {
  using T = typename S::Scalar;
  std::vector<T> out;
  std::vector<T> scratch(s.block_scratch_size());
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t h = 0; h < s.n_kv_heads(); ++h)
      s.for_each_block(l, h, s.size(), std::span<T>(scratch), [&](const KvBlock<T>& b) {
        for (std::size_t r = 0; r < b.n; ++r) {
          out.insert(out.end(), b.keys + r * b.stride, b.keys + r * b.stride + s.head_size());
          out.insert(out.end(), b.values + r * b.stride, b.values + r * b.stride + s.head_size());
        }
      });
  return out;
}

struct RunResult {
  Tokens tokens;        // generated
  Tokens cache_tokens;  // what the store holds at the end
  SpeculativeStats stats;
};

/// Runs plain generate() (draft == nullptr and !lookup) or speculative_generate() on a fresh
/// store of `kind`: prompt, then up to n_new tokens.
template <class T, class MakeDrafter>
RunResult run(const Model<T>& model, typename Setup<T>::Kind kind, const Tokens& prompt,
              std::size_t n_new, bool speculate, MakeDrafter&& make_drafter,
              const SamplerOptions& greedy = {.temperature = 0}) {
  const ModelConfig& cfg = model.config();
  RunResult result;
  const GenerationOptions gen{.max_new_tokens = n_new};
  const auto go = [&](auto& store, std::span<const std::int32_t> rest) {
    Activations<T> act(
        cfg, {.max_chunk = Setup<T>::kMaxDraft + 1, .store_scratch = store.block_scratch_size()});
    const auto on_token = [&](std::int32_t t) { result.tokens.push_back(t); };
    if (speculate) {
      auto drafter = make_drafter();
      result.stats = speculative_generate(model, store, act, rest, greedy, *drafter, gen,
                                          {.max_draft = Setup<T>::kMaxDraft}, on_token);
    } else {
      Sampler sampler(cfg.vocab_size, greedy);
      static_cast<GenerationStats&>(result.stats) =
          generate(model, store, act, rest, sampler, gen, on_token);
    }
    const auto held = store.tokens();
    result.cache_tokens.assign(held.begin(), held.end());
  };
  Setup<T>::with_store(kind, cfg, [&](auto& store) {
    using S = std::remove_cvref_t<decltype(store)>;
    if constexpr (std::is_same_v<S, PagedStore<T>>) {
      const std::size_t prefix_len = 6;  // blocks of 4: the fork shares a partial block
      Activations<T> act(cfg, {.max_chunk = 8});
      model.prefill(std::span<const std::int32_t>(prompt).first(prefix_len), store, act);
      const auto before = rows_of(store);
      PagedStore<T> fork = store.fork();
      go(fork, std::span<const std::int32_t>(prompt).subspan(prefix_len));
      EXPECT_EQ(store.size(), prefix_len);
      EXPECT_EQ(rows_of(store), before) << "the sibling of the generating fork changed";
    } else {
      go(store, prompt);
    }
  });
  return result;
}

template <class T>
class SpeculativeGreedyTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SpeculativeGreedyTest, Scalars);

/// Greedy equality needs the verify pass's products to equal decode's bit for bit: f64 always
/// leaves ties only at 1e-16; f32 where the active kernel set's few-token GEMM sums as its GEMV.
template <class T>
bool exact_verify() {
  return std::is_same_v<T, double> || detail::has_gemm_few<float, float>(active_kernel_set());
}

TYPED_TEST(SpeculativeGreedyTest, EqualsPlainGreedyOnEveryStoreAndDrafter) {
  using T = TypeParam;
  if (!exact_verify<T>()) GTEST_SKIP() << "f32 verification uses Eigen's GEMM on this target";
  ModelConfig cfg = small_config(4, 2, 120);
  const Model<T> target(random_weights<T>(cfg, 31));
  const Model<T> other(random_weights<T>(cfg, 77));  // a draft model that often disagrees
  // A prompt that repeats itself, so lookup finds matches.
  Tokens prompt = random_tokens(9, cfg.vocab_size, 5);
  const Tokens again(prompt.begin(), prompt.end());
  prompt.insert(prompt.end(), again.begin(), again.end());
  prompt.insert(prompt.end(), again.begin(), again.begin() + 4);
  const std::size_t n_new = 80;

  std::size_t accepted = 0, rejected = 0;
  for (int k = 0; k < 6; ++k) {
    const auto kind = static_cast<typename Setup<T>::Kind>(k);
    SCOPED_TRACE(kKindNames[k]);
    const RunResult plain = run(target, kind, prompt, n_new, false,
                                [] { return std::make_unique<PromptLookupDrafter>(); });
    ASSERT_EQ(plain.tokens.size(), n_new);
    for (int d = 0; d < 3; ++d) {
      SCOPED_TRACE(d == 0 ? "prompt lookup" : d == 1 ? "draft = target" : "random draft model");
      // The draft model's own store and Activations outlive the run.
      ContiguousStore<T> draft_store(cfg);
      Activations<T> draft_act(cfg, {.max_chunk = 8});
      const Model<T>& draft_model = d == 1 ? target : other;
      RunResult spec;
      if (d == 0) {
        spec = run(target, kind, prompt, n_new, true,
                   [] { return std::make_unique<PromptLookupDrafter>(); });
      } else {
        spec = run(target, kind, prompt, n_new, true, [&] {
          return std::make_unique<DraftModelDrafter<T, T, ContiguousStore<T>>>(
              draft_model, draft_store, draft_act, Setup<T>::kMaxDraft);
        });
      }
      EXPECT_EQ(spec.tokens, plain.tokens);
      EXPECT_EQ(spec.cache_tokens, plain.cache_tokens);
      EXPECT_GT(spec.stats.drafted, 0u);
      EXPECT_LT(spec.stats.target_passes, plain.tokens.size() - 1 + 1);
      // It drafts the target itself, on a store that keeps K/V as they are computed.
      if (d == 1 && (kind == Setup<T>::kContiguous || kind == Setup<T>::kPaged)) {
        EXPECT_EQ(spec.stats.accepted, spec.stats.drafted);
      }
      accepted += spec.stats.accepted;
      rejected += spec.stats.drafted - spec.stats.accepted;
    }
  }
  // Both paths of verification ran: kept proposals and rolled-back ones.
  EXPECT_GT(accepted, 100u);
  EXPECT_GT(rejected, 100u);
}

TYPED_TEST(SpeculativeGreedyTest, RepeatPenaltyScoresEachVerifiedRowAsDecodingDoes) {
  using T = TypeParam;
  if (!exact_verify<T>()) GTEST_SKIP() << "f32 verification uses Eigen's GEMM on this target";
  ModelConfig cfg = small_config(4, 2, 120);
  const Model<T> target(random_weights<T>(cfg, 31));
  const Model<T> other(random_weights<T>(cfg, 77));
  Tokens prompt = random_tokens(9, cfg.vocab_size, 5);
  const Tokens again(prompt.begin(), prompt.end());
  prompt.insert(prompt.end(), again.begin(), again.end());
  const std::size_t n_new = 80;
  // Row i of a pass is penalised over the tokens up to the proposal before it, as decoding
  // penalises that position; a window shorter than the pass's reach tests the ring too.
  const SamplerOptions penalised{.temperature = 0, .repeat_penalty = 1.5, .repeat_last_n = 12};
  const auto lookup = [] { return std::make_unique<PromptLookupDrafter>(); };
  std::size_t accepted = 0, rejected = 0;
  for (int k = 0; k < 6; ++k) {
    const auto kind = static_cast<typename Setup<T>::Kind>(k);
    SCOPED_TRACE(kKindNames[k]);
    const RunResult plain = run(target, kind, prompt, n_new, false, lookup, penalised);
    ASSERT_EQ(plain.tokens.size(), n_new);
    // The penalty changes the text here, so a verification that ignored it would differ.
    EXPECT_NE(plain.tokens, run(target, kind, prompt, n_new, false, lookup).tokens);
    for (int d = 0; d < 2; ++d) {
      SCOPED_TRACE(d == 0 ? "prompt lookup" : "random draft model");
      ContiguousStore<T> draft_store(cfg);
      Activations<T> draft_act(cfg, {.max_chunk = 8});
      const RunResult spec =
          d == 0 ? run(target, kind, prompt, n_new, true, lookup, penalised)
                 : run(
                       target, kind, prompt, n_new, true,
                       [&] {
                         return std::make_unique<DraftModelDrafter<T, T, ContiguousStore<T>>>(
                             other, draft_store, draft_act, Setup<T>::kMaxDraft);
                       },
                       penalised);
      EXPECT_EQ(spec.tokens, plain.tokens);
      EXPECT_EQ(spec.cache_tokens, plain.cache_tokens);
      EXPECT_GT(spec.stats.drafted, 0u);
      accepted += spec.stats.accepted;
      rejected += spec.stats.drafted - spec.stats.accepted;
    }
  }
  std::printf("  accepted %zu, rolled back %zu\n", accepted, rejected);
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(rejected, 0u);
}

TYPED_TEST(SpeculativeGreedyTest, StopsLikeGenerateAtAStopTokenAndAFullCache) {
  using T = TypeParam;
  if (!exact_verify<T>()) GTEST_SKIP() << "f32 verification uses Eigen's GEMM on this target";
  const ModelConfig cfg = small_config(4, 2, 40);
  const Model<T> model(random_weights<T>(cfg, 9));
  const Tokens prompt = {1, 2, 3, 1, 2, 3, 1, 2};
  for (const std::size_t capacity : {std::size_t{20}, std::size_t{40}}) {
    Tokens plain_tokens, spec_tokens;
    ContiguousStore<T> a(cfg, capacity), b(cfg, capacity);
    Activations<T> act(cfg, {.max_chunk = 5});
    Sampler sampler(cfg.vocab_size, {.temperature = 0});
    const GenerationOptions gen{.max_new_tokens = 100};
    const GenerationStats ps = generate(model, a, act, prompt, sampler, gen,
                                        [&](std::int32_t t) { plain_tokens.push_back(t); });
    // Stop at the plain run's 7th token: the speculative run must stop there too.
    const GenerationOptions stop{.max_new_tokens = 100, .stop_token = plain_tokens[6]};
    Tokens plain_stop;
    ContiguousStore<T> c(cfg, capacity);
    generate(model, c, act, prompt, sampler, stop,
             [&](std::int32_t t) { plain_stop.push_back(t); });
    const SamplerOptions greedy{.temperature = 0};
    const PromptLookupDrafter lookup;
    PromptLookupDrafter drafter = lookup;
    const SpeculativeStats ss =
        speculative_generate(model, b, act, prompt, greedy, drafter, gen, {.max_draft = 4},
                             [&](std::int32_t t) { spec_tokens.push_back(t); });
    EXPECT_EQ(spec_tokens, plain_tokens);
    EXPECT_EQ(ss.hit_capacity, ps.hit_capacity);
    EXPECT_EQ(b.size(), a.size());
    Tokens spec_stop;
    ContiguousStore<T> d(cfg, capacity);
    const SpeculativeStats st =
        speculative_generate(model, d, act, prompt, greedy, drafter, stop, {.max_draft = 4},
                             [&](std::int32_t t) { spec_stop.push_back(t); });
    EXPECT_EQ(spec_stop, plain_stop);
    EXPECT_TRUE(st.hit_stop_token);
    EXPECT_EQ(d.size(), c.size());
  }
}

// ---------------------------------------------------------------------------------------------
// generate()'s speculation option: plain greedy generate() is the oracle

TYPED_TEST(SpeculativeGreedyTest, GenerateOptionGivesThePlainGreedyTokens) {
  using T = TypeParam;
  if (!exact_verify<T>()) GTEST_SKIP() << "f32 verification uses Eigen's GEMM on this target";
  const ModelConfig cfg = small_config(4, 2, 120);
  const Model<T> target(random_weights<T>(cfg, 41));
  const Model<T> other(random_weights<T>(cfg, 43));
  Tokens prompt = random_tokens(7, cfg.vocab_size, 3);
  const Tokens again = prompt;
  prompt.insert(prompt.end(), again.begin(), again.end());
  const std::size_t n_new = 60;
  const auto run_with = [&](typename Setup<T>::Kind kind, const Speculation& speculation) {
    Tokens out;
    Setup<T>::with_store(kind, cfg, [&](auto& store) {
      Activations<T> act(
          cfg, {.max_chunk = Setup<T>::kMaxDraft + 1, .store_scratch = store.block_scratch_size()});
      Sampler sampler(cfg.vocab_size, {.temperature = 0});
      const GenerationOptions options{.max_new_tokens = n_new, .speculation = speculation};
      const GenerationStats st = generate(target, store, act, prompt, sampler, options,
                                          [&](std::int32_t t) { out.push_back(t); });
      if (speculation.kind == Speculation::Kind::kNone) {
        EXPECT_EQ(st.drafted, 0u);
        EXPECT_EQ(st.target_passes, n_new - 1);  // one decode step per token after the first
      } else {
        EXPECT_GT(st.drafted, 0u) << "the option did not speculate";
        EXPECT_LT(st.target_passes, n_new - 1);
      }
    });
    return out;
  };
  for (int k = 0; k < 6; ++k) {
    const auto kind = static_cast<typename Setup<T>::Kind>(k);
    SCOPED_TRACE(kKindNames[k]);
    const Tokens plain = run_with(kind, {});
    ASSERT_EQ(plain.size(), n_new);
    EXPECT_EQ(run_with(kind, Speculation::prompt_lookup(Setup<T>::kMaxDraft)), plain);
    // A k far beyond any pass: the pass is capped (max_chunk, the few-token GEMM), not k + 1.
    EXPECT_EQ(run_with(kind, Speculation::prompt_lookup(std::numeric_limits<std::size_t>::max())),
              plain);
    ContiguousStore<T> draft_store(cfg);
    Activations<T> draft_act(cfg, {.max_chunk = 8});
    DraftModelDrafter<T, T, ContiguousStore<T>> drafter(other, draft_store, draft_act,
                                                        Setup<T>::kMaxDraft);
    EXPECT_EQ(run_with(kind, Speculation::with_drafter(drafter, Setup<T>::kMaxDraft)), plain);
  }
}

TEST(SpeculationOptionTest, RefusesWhatItCannotHonourAndChangesNothing) {
  const ModelConfig cfg = small_config(4, 2, 40);
  const Model<double> model(random_weights<double>(cfg, 5));
  const Tokens prompt = {1, 2, 3, 1, 2};
  ContiguousStore<double> store(cfg);
  Activations<double> act(cfg, {.max_chunk = 5});
  const auto refused = [&](const SamplerOptions& so, GenerationOptions options) {
    Sampler sampler(cfg.vocab_size, so);
    std::size_t calls = 0;
    EXPECT_THROW(
        generate(model, store, act, prompt, sampler, options, [&](std::int32_t) { ++calls; }),
        Error);
    EXPECT_EQ(store.size(), 0u);
    EXPECT_EQ(calls, 0u);
  };
  const Speculation lookup = Speculation::prompt_lookup(4);
  refused({.temperature = 0}, {.use_cache = false, .speculation = lookup});
  refused({.temperature = 0}, {.speculation = {.kind = Speculation::Kind::kDrafter}});
}

// ---------------------------------------------------------------------------------------------
// Sampling keeps the target's distribution

/// vocab 5, dim 16, one layer: the joint law of three generated tokens has 125 cells.
ModelConfig sampling_config() {
  return test_config({.dim = 16,
                      .hidden_dim = 32,
                      .n_layers = 1,
                      .n_heads = 2,
                      .n_kv_heads = 1,
                      .vocab_size = 5,
                      .seq_len = 16});
}

struct Law {
  double temperature = 1;
  std::size_t top_k = 0;
  double top_p = 1;
  double min_p = 0;
  double repeat_penalty = 1;
  std::size_t repeat_last_n = 0;
};

/// The sampling distribution written out from its definition: each distinct token among the
/// last repeat_last_n of `seen` has its logit l made l / penalty (l > 0) or l × penalty; then
/// softmax(logits / t); tokens under min_p × the largest probability dropped, renormalised; then
/// the top_k most likely, then the shortest prefix of them (by probability) whose mass exceeds
/// top_p, renormalised.
std::vector<double> target_law(std::span<const double> raw, const Law& law, const Tokens& seen) {
  const std::size_t n = raw.size();
  std::vector<double> logits(raw.begin(), raw.end());
  std::vector<bool> penalised(n, false);
  const std::size_t last = std::min(law.repeat_last_n, seen.size());
  for (std::size_t j = seen.size() - last; j < seen.size(); ++j) {
    const auto id = static_cast<std::size_t>(seen[j]);
    if (law.repeat_penalty == 1 || penalised[id]) continue;
    penalised[id] = true;
    logits[id] = logits[id] > 0 ? logits[id] / law.repeat_penalty : logits[id] * law.repeat_penalty;
  }
  const double t = law.temperature;
  std::vector<double> p(n);
  double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += p[i] = std::exp((logits[i] - mx) / t);
  for (double& x : p) x /= sum;
  const double floor = law.min_p * *std::max_element(p.begin(), p.end());
  double kept = 0;
  for (double& x : p) kept += x = x < floor ? 0.0 : x;
  for (double& x : p) x /= kept;
  const std::size_t top_k = law.top_k;
  const double top_p = law.top_p;
  std::vector<std::size_t> idx(n);
  for (std::size_t i = 0; i < n; ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
  const std::size_t k = top_k == 0 ? n : std::min(top_k, n);
  std::vector<double> out(n, 0.0);
  double mass = 0;
  for (std::size_t j = 0; j < k; ++j) {
    mass += p[idx[j]];
    out[idx[j]] = p[idx[j]];
    if (top_p < 1.0 && mass > top_p) break;
  }
  for (double& x : out) x /= mass;
  return out;
}

/// Chi-square critical value at upper-tail probability 1e-6 (z = 4.753), Wilson–Hilferty:
/// df (1 - 2/(9 df) + z sqrt(2/(9 df)))³, within a few percent of the exact quantile for df ≥ 10.
double chi_square_critical(double df) {
  const double z = 4.753;
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

struct ChiSquare {
  double statistic = 0;
  double df = 0;
};

/// Pearson's statistic of observed counts against expected probabilities; cells expected below
/// 5 are pooled into one (the chi-square approximation needs expected counts ≥ 5).
ChiSquare chi_square(const std::map<std::size_t, std::size_t>& observed,
                     const std::vector<double>& expected_p, std::size_t n) {
  ChiSquare r;
  double pooled_e = 0, pooled_o = 0;
  std::size_t cells = 0;
  for (std::size_t c = 0; c < expected_p.size(); ++c) {
    const double e = expected_p[c] * static_cast<double>(n);
    const auto it = observed.find(c);
    const double o = it == observed.end() ? 0.0 : static_cast<double>(it->second);
    if (e < 5) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    r.statistic += (o - e) * (o - e) / e;
    ++cells;
  }
  if (pooled_e > 0) {
    r.statistic += (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1e-300);
    ++cells;
  }
  r.df = static_cast<double>(cells - 1);
  return r;
}

struct SamplingCase {
  const char* name;
  Law law;
  int drafter;  // 0 lookup, 1 draft model sampling at its own temperature, 2 greedy draft model
};

TEST(SpeculativeSamplingTest, KeepsTheTargetDistribution) {
  const ModelConfig cfg = sampling_config();
  const Model<double> target(random_weights<double>(cfg, 3));
  const Model<double> draft(random_weights<double>(cfg, 4));
  const Tokens prompt = {1, 2, 3, 1, 2};  // lookup proposes after the repeated (1, 2)
  const std::size_t n_tokens = 3;
  const std::size_t vocab = 5;
  const std::size_t runs = 20000;
  const SamplingCase cases[] = {
      {"t=1, lookup", {.temperature = 1.0}, 0},
      {"t=0.7, draft model t=1.3", {.temperature = 0.7}, 1},
      {"t=1, top_k=4, top_p=0.9, greedy draft model", {.top_k = 4, .top_p = 0.9}, 2},
      {"t=1, min_p=0.3, lookup", {.min_p = 0.3}, 0},
      {"t=0.8, repeat penalty 3 over the last 3, draft model t=1.3",
       {.temperature = 0.8, .repeat_penalty = 3, .repeat_last_n = 3},
       1},
  };
  for (const SamplingCase& sc : cases) {
    SCOPED_TRACE(sc.name);
    // The exact law of the 3 tokens: product of the conditionals, from forward_reference.
    const auto law_at = [&](const Law& law) {
      std::vector<double> joint(vocab * vocab * vocab);
      for (std::size_t c = 0; c < joint.size(); ++c) {
        Tokens seq = prompt;
        double pr = 1;
        std::size_t code = c;
        for (std::size_t j = 0; j < n_tokens; ++j) {
          const std::vector<double> all = target.forward_reference(seq);
          const std::vector<double> p =
              target_law(std::span<const double>(all).subspan(all.size() - vocab), law, seq);
          const std::size_t x =
              code / static_cast<std::size_t>(std::pow(vocab, n_tokens - 1 - j)) % vocab;
          pr *= p[x];
          seq.push_back(static_cast<std::int32_t>(x));
        }
        joint[c] = pr;
      }
      return joint;
    };
    std::map<std::size_t, std::size_t> observed;
    std::size_t drafted = 0, accepted = 0;
    ContiguousStore<double> store(cfg), draft_store(cfg);
    Activations<double> act(cfg, {.max_chunk = 4}), draft_act(cfg, {.max_chunk = 4});
    const SamplerOptions draft_sampling{.temperature = sc.drafter == 1 ? 1.3 : 0.0, .top_p = 1.0};
    for (std::size_t r = 0; r < runs; ++r) {
      store.reset();
      const SamplerOptions sampling{.temperature = sc.law.temperature,
                                    .top_p = sc.law.top_p,
                                    .top_k = static_cast<std::int64_t>(sc.law.top_k),
                                    .seed = 1000 + r,
                                    .min_p = sc.law.min_p,
                                    .repeat_penalty = sc.law.repeat_penalty,
                                    .repeat_last_n = sc.law.repeat_last_n};
      std::size_t code = 0;
      const auto on_token = [&](std::int32_t t) {
        code = code * vocab + static_cast<std::size_t>(t);
      };
      const GenerationOptions gen{.max_new_tokens = n_tokens};
      SpeculativeStats st;
      if (sc.drafter == 0) {
        PromptLookupDrafter lookup;
        st = speculative_generate(target, store, act, prompt, sampling, lookup, gen,
                                  {.max_draft = 3}, on_token);
      } else {
        SamplerOptions ds = draft_sampling;
        ds.seed = 7000 + r;
        DraftModelDrafter<double, double, ContiguousStore<double>> drafter(draft, draft_store,
                                                                           draft_act, 3, ds);
        st = speculative_generate(target, store, act, prompt, sampling, drafter, gen,
                                  {.max_draft = 3}, on_token);
      }
      ++observed[code];
      drafted += st.drafted;
      accepted += st.accepted;
    }
    // Both accept and reject decisions were exercised.
    EXPECT_GT(drafted, runs / 2);
    EXPECT_GT(accepted, drafted / 20);
    EXPECT_LT(accepted, drafted);
    const ChiSquare fit = chi_square(observed, law_at(sc.law), runs);
    const double critical = chi_square_critical(fit.df);
    EXPECT_LT(fit.statistic, critical) << "df " << fit.df;
    // The test can fail: the same counts against the law at another temperature are rejected,
    // and against the law without min-p or the penalty where the case has them.
    Law hotter = sc.law;
    hotter.temperature *= 1.3;
    const ChiSquare off = chi_square(observed, law_at(hotter), runs);
    EXPECT_GT(off.statistic, chi_square_critical(off.df)) << "df " << off.df;
    if (sc.law.min_p > 0 || sc.law.repeat_penalty != 1) {
      Law plain = sc.law;
      plain.min_p = 0;
      plain.repeat_penalty = 1;
      const ChiSquare uncut = chi_square(observed, law_at(plain), runs);
      EXPECT_GT(uncut.statistic, chi_square_critical(uncut.df)) << "df " << uncut.df;
    }
    std::printf(
        "  %s: chi-square %.1f (df %.0f, critical %.1f); at 1.3 t: %.1f; accepted %zu/%zu\n",
        sc.name, fit.statistic, fit.df, critical, off.statistic, accepted, drafted);
  }
}

template <class S, class Make>
std::vector<double> decoded_logits(const Model<double>& model, const Tokens& tokens, Make&& make);

/// Why verification of a 4-bit store is capped: a chunk that completes a key group after its
/// first row reads the group quantized where one-at-a-time decoding read it in full precision.
TEST(SpeculativeQ4Test, AChunkPastTheCapReadsDifferentlyFromDecoding) {
  const ModelConfig cfg = tiny_config(2);
  const Model<double> model(random_weights<double>(cfg, 17));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const Tokens tokens = {4, 9, 2, 7, 1};
  const std::vector<double> decoded = decoded_logits<Q4Store<double>>(
      model, tokens, [&] { return Q4Store<double>(cfg, 20, 4, 0); });
  // After one token, the group of 4 ends at position 3: the cap is 2 positions.
  const auto chunk_logits = [&](std::size_t n) {
    Q4Store<double> s(cfg, 20, 4, 0);
    Activations<double> act(cfg, {.max_chunk = 8, .store_scratch = s.block_scratch_size()});
    model.prefill(std::span<const std::int32_t>(tokens).first(1), s, act);
    EXPECT_EQ(speculative_append_limit(s), 2u);
    std::vector<double> all(n * vocab);
    model.prefill(std::span<const std::int32_t>(tokens).subspan(1, n), s, act,
                  std::span<double>(all));
    return max_abs_diff(std::span<const double>(all).first(vocab),
                        std::span<const double>(decoded).subspan(vocab, vocab));
  };
  EXPECT_LT(chunk_logits(2), 1e-12);  // within the cap: what decoding computed
  EXPECT_GT(chunk_logits(4), 1e-6);   // past it: position 1 read the quantized group
}

// ---------------------------------------------------------------------------------------------
// Property: random draft / verify / accept / reject sequences on every store kind

/// Logits [n][vocab] of every position of `tokens` as plain decoding computes them: one decode
/// step at a time into a fresh store made by make() (the oracle of stores that round or shift
/// what they keep: int8, 4-bit, streaming).
template <class S, class Make>
std::vector<double> decoded_logits(const Model<double>& model, const Tokens& tokens, Make&& make) {
  S fresh = make();
  Activations<double> act(model.config(),
                          {.max_chunk = 1, .store_scratch = fresh.block_scratch_size()});
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  std::vector<double> out;
  out.reserve(tokens.size() * vocab);
  for (const std::int32_t t : tokens) {
    const auto l = model.decode(t, fresh, act);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

TEST(SpeculativePropertyTest, RandomVerifyAndRollbackMatchTheRecompute) {
  const std::uint64_t seed = env_or("KVDECODE_SPECULATIVE_SEED", 20261203);
  const std::uint64_t steps = env_or("KVDECODE_SPECULATIVE_STEPS", 10000);
  const ModelConfig cfg = tiny_config(2);
  const Model<double> model(random_weights<double>(cfg, seed ^ 0xABCD));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const std::size_t capacity = 20;
  const std::size_t max_pass = 5;  // the Activations' max_chunk: k ≤ 4
  std::printf("speculative property run: seed %llu, %llu steps per store\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(steps));

  const auto check = [&](auto& store, auto&& reference, const char* name, auto&& after_step) {
    SCOPED_TRACE(name);
    detail::SplitMix64 rng(seed);
    const auto below = [&](std::size_t n) { return static_cast<std::size_t>(rng.next() % n); };
    Activations<double> act(cfg,
                            {.max_chunk = max_pass, .store_scratch = store.block_scratch_size()});
    Tokens expected(store.tokens().begin(), store.tokens().end());
    std::vector<double> all(max_pass * vocab);
    std::size_t verifies = 0, dropped_total = 0;
    for (std::uint64_t step = 0; step < steps; ++step) {
      const std::size_t room = capacity - expected.size();
      if (room == 0 || below(40) == 0) {
        store.reset();
        expected.clear();
        continue;
      }
      // A pass: the fed token and up to 4 proposals, as verification appends them.
      const std::size_t limit = std::min({max_pass, room, speculative_append_limit(store)});
      const std::size_t n = 1 + below(limit);
      Tokens pass(n);
      for (auto& t : pass) t = static_cast<std::int32_t>(below(vocab));
      const std::size_t first = expected.size();
      model.prefill(pass, store, act, std::span<double>(all).first(n * vocab));
      ++verifies;
      Tokens seq = expected;
      seq.insert(seq.end(), pass.begin(), pass.end());
      const std::vector<double> ref = reference(seq);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t v = 0; v < vocab; ++v) {
          const double r = ref[(first + i) * vocab + v];
          ASSERT_NEAR(all[i * vocab + v], r, 1e-9 * (1 + std::abs(r)))
              << "seed " << seed << " step " << step << " row " << i << " of " << n;
        }
      // Accept a random prefix (at least the fed token), roll back the rest.
      const std::size_t keep = 1 + below(n);
      speculative_rollback(store, first + keep);
      dropped_total += n - keep;
      expected.insert(expected.end(), pass.begin(),
                      pass.begin() + static_cast<std::ptrdiff_t>(keep));
      ASSERT_EQ(store.size(), expected.size()) << "step " << step;
      ASSERT_EQ(store.pending(), 0u);
      ASSERT_EQ(Tokens(store.tokens().begin(), store.tokens().end()),
                kvdecode::testing_util::shown_tokens(store, expected))
          << "step " << step;
      after_step(step);
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_GT(verifies, steps / 2);
    EXPECT_GT(dropped_total, steps / 5);
  };
  const auto no_check = [](std::uint64_t) {};
  const auto exact = [&](std::size_t window) {
    return
        [&, window](const Tokens& seq) { return forward_reference(model.weights(), seq, window); };
  };

  {
    ContiguousStore<double> s(cfg, capacity);
    check(s, exact(0), "contiguous", no_check);
  }
  {
    Int8Store<double> s(cfg, capacity);
    check(
        s,
        [&](const Tokens& seq) {
          return decoded_logits<Int8Store<double>>(
              model, seq, [&] { return Int8Store<double>(cfg, capacity); });
        },
        "int8", no_check);
  }
  {
    Q4Store<double> s(cfg, capacity, 4, 4);
    check(
        s,
        [&](const Tokens& seq) {
          return decoded_logits<Q4Store<double>>(
              model, seq, [&] { return Q4Store<double>(cfg, capacity, 4, 4); });
        },
        "q4", no_check);
  }
  {
    const WindowOptions o{.window = 6, .max_chunk = max_pass, .capacity = capacity};
    WindowStore<double> s(cfg, o);
    check(s, exact(6), "window", no_check);
  }
  {
    const WindowOptions o{.window = 8,
                          .sinks = 2,
                          .policy = WindowPolicy::kStreaming,
                          .max_chunk = max_pass,
                          .capacity = capacity};
    WindowStore<double> s(cfg, o);
    check(
        s,
        [&](const Tokens& seq) {
          return decoded_logits<WindowStore<double>>(model, seq,
                                                     [&] { return WindowStore<double>(cfg, o); });
        },
        "streaming", no_check);
  }
  {
    // The tested sequence is a fork of one holding 4 tokens (blocks of 3: a shared partial
    // block); the parent's rows must stay as they were through every step.
    BlockPool<double> pool(cfg, 16, 3, {.capacity = capacity});
    PagedStore<double> parent(pool);
    Activations<double> act(cfg, {.max_chunk = 4});
    model.prefill(Tokens{3, 1, 4, 1}, parent, act);
    const auto before = rows_of(parent);
    PagedStore<double> s = parent.fork();
    check(s, exact(0), "paged", [&](std::uint64_t step) {
      ASSERT_EQ(rows_of(parent), before) << "the fork's sibling changed at step " << step;
    });
  }
}

}  // namespace
}  // namespace kvdecode::testing_util
