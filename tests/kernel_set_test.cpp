// The model under each kernel set this CPU supports (forced process-wide, restored after; a set
// the CPU lacks is skipped by name): f32 decode, few-token and many-token prefill against the
// no-cache reference; bf16 weights give the same logits whichever path runs a token (one chunk,
// chunks of one, a batched decode step) up to f32 summation order, because every path rounds x
// to bf16 the same way; a batched step's logits do not depend on the batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

class ModelKernelSetTest : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << kernel_set_name(GetParam()) << " kernels";
    forced_ = std::make_unique<ForcedKernelSet>(GetParam());
  }
  void TearDown() override { forced_.reset(); }
  std::unique_ptr<ForcedKernelSet> forced_;
};

/// Odd sizes, so every kernel runs its tails: dim 72 (head size 18), hidden 100, vocab 61.
ModelConfig odd_config() {
  ModelConfig c = testing_util::test_config({.dim = 72,
                                             .hidden_dim = 100,
                                             .n_layers = 2,
                                             .n_heads = 4,
                                             .n_kv_heads = 2,
                                             .vocab_size = 61,
                                             .seq_len = 40});
  c.shared_classifier = false;
  return c;
}

/// The f32 bound of the other cached-vs-reference tests.
double f32_bound(double ref) { return 1e-5 * (1.0 + std::abs(ref)); }

// Prefill of 18 tokens in one chunk (gemm_cols), then 7 in chunks of 4 and 3 (gemm_few), then
// 5 decode steps (GEMV): every position's logits within the f32 bound of the reference.
TEST_P(ModelKernelSetTest, F32DecodeAndPrefillMatchReference) {
  const ModelConfig cfg = odd_config();
  const Model<float> model(random_weights<float>(cfg, 31));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const Tokens tokens = random_tokens(30, cfg.vocab_size, 5);
  const std::vector<float> ref = model.forward_reference(tokens);
  ContiguousStore<float> cache(cfg);
  std::vector<float> got(tokens.size() * vocab);
  Activations<float> big(cfg, {.max_chunk = 18});
  model.prefill(std::span(tokens).first(18), cache, big, std::span(got).first(18 * vocab));
  Activations<float> few(cfg, {.max_chunk = 4});
  model.prefill(std::span(tokens).subspan(18, 7), cache, few,
                std::span(got).subspan(18 * vocab, 7 * vocab));
  Activations<float> one(cfg, {.max_chunk = 1});
  for (std::size_t p = 25; p < tokens.size(); ++p) {
    const auto logits = model.decode(tokens[p], cache, one);
    std::copy(logits.begin(), logits.end(), got.begin() + static_cast<std::ptrdiff_t>(p * vocab));
  }
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(static_cast<double>(got[i]) - ref[i]), f32_bound(ref[i]))
        << kernel_set_name(GetParam()) << ": position " << i / vocab << " logit " << i % vocab;
}

/// All logits of prefilling `tokens` into an empty cache in chunks of `chunk` tokens.
template <class W>
std::vector<float> prefill_logits(const Model<float, W>& model, const Tokens& tokens,
                                  std::size_t chunk) {
  const ModelConfig& cfg = model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = chunk});
  std::vector<float> all(tokens.size() * static_cast<std::size_t>(cfg.vocab_size));
  model.prefill(tokens, cache, act, all);
  return all;
}

/// Relative RMS difference of two logit sets, ‖a − b‖₂ / ‖b‖₂.
double relative_rms(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

// bf16 weights: every path rounds x to bf16 at each weight product, so one chunk (gemm_cols),
// chunks of one (GEMV) and of five (gemm_few; attention over five queries) differ only in f32
// summation order, and agree within the f32 bound of the reference tests... except that bf16
// rounding is discontinuous: where an order difference moves an input across a rounding tie,
// two correct paths take neighbouring bf16 values, and the logits move by up to ~1/3 of what
// breaking the rule does (measured over 20 models). That happens on ~30 % of these small random
// models. A path that breaks the rule (x kept in f32, truncated, ties rounded away) differs at
// every input, so it is outside the f32 bound on every model: the test asks that at least half
// of 24 models agree within the f32 bound at every logit, and that on every model the paths
// differ by less than half of what keeping x in f32 does (the same weights as an f32 model).
TEST_P(ModelKernelSetTest, Bf16ChunkingAgreesWithinF32BoundAwayFromRoundingTies) {
  const ModelConfig cfg = odd_config();
  const Tokens tokens = random_tokens(20, cfg.vocab_size, 8);
  std::size_t within_bound = 0;
  for (std::uint64_t seed = 70; seed < 94; ++seed) {
    const Model<float, bf16> model(convert_weights<bf16>(random_weights<float>(cfg, seed)));
    const Model<float> widened(convert_weights<float>(model.weights()));
    const std::vector<float> whole = prefill_logits(model, tokens, 20);  // gemm_cols
    const std::vector<float> ones = prefill_logits(model, tokens, 1);    // GEMV
    const std::vector<float> fives = prefill_logits(model, tokens, 5);   // gemm_few
    const std::vector<float> f32_x = prefill_logits(widened, tokens, 20);
    bool agree = true;
    for (std::size_t i = 0; i < whole.size(); ++i)
      agree = agree && std::abs(ones[i] - whole[i]) <= f32_bound(whole[i]) &&
              std::abs(fives[i] - whole[i]) <= f32_bound(whole[i]);
    within_bound += agree ? 1 : 0;
    const double rule = relative_rms(f32_x, whole);
    EXPECT_GT(rule, 1e-3) << "seed " << seed << ": x in f32 should be far outside the bound";
    EXPECT_LT(relative_rms(ones, whole), rule / 2) << "seed " << seed << ": chunks of 1";
    EXPECT_LT(relative_rms(fives, whole), rule / 2) << "seed " << seed << ": chunks of 5";
  }
  EXPECT_GE(within_bound, 12u) << "models on which every path agreed within the f32 bound";
}

// A batched decode step (2..16 sequences) sums each product in lanes (gemm_lanes), one fma chain
// per output whatever the batch, and runs each sequence's own attention: with bf16 weights a
// sequence's logits are the same bit for bit in any batch (16 take the token-lane tiles where
// the set has them, fewer the weight-lane ones), whatever the rounding ties. Against
// decode() (the GEMV's order) they differ in f32 summation order only, so as in the chunking test
// above they must stay within half of what keeping x in f32 moves them (relative RMS).
TEST_P(ModelKernelSetTest, Bf16BatchedDecodeIsBatchIndependentAndFollowsTheRule) {
  const ModelConfig cfg = odd_config();
  const Model<float, bf16> model(convert_weights<bf16>(random_weights<float>(cfg, 77)));
  const Model<float> widened(convert_weights<float>(model.weights()));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  // Sequence 0 rides with sequences 1 and 2 in `three`, with sequence 3 in `two` (its twin), and
  // with sequences 3..17 in `sixteen`.
  constexpr std::size_t kMany = detail::kMaxFewTokens;
  static_assert(kMany >= detail::kTokenPairLanesMin);
  std::vector<ContiguousStore<float>> three, two, sixteen, singles, wide;
  Activations<float> one(cfg, {.max_chunk = 1}), batch(cfg, {.max_chunk = 1, .max_batch = kMany});
  Activations<float> prompt_act(cfg, {.max_chunk = 8});
  std::vector<Tokens> prompts;
  for (std::size_t b = 0; b < kMany + 2; ++b)
    prompts.push_back(random_tokens(3 + 2 * (b % 4), cfg.vocab_size, 40 + b));
  for (std::size_t b = 0; b < 3; ++b) {
    three.emplace_back(cfg);
    singles.emplace_back(cfg);
    wide.emplace_back(cfg);
    model.prefill(prompts[b], three.back(), prompt_act);
    model.prefill(prompts[b], singles.back(), prompt_act);
    widened.prefill(prompts[b], wide.back(), prompt_act);
  }
  for (const std::size_t b : {0, 3}) {
    two.emplace_back(cfg);
    model.prefill(prompts[b], two.back(), prompt_act);
  }
  sixteen.reserve(kMany);
  for (std::size_t b = 0; b < kMany; ++b) {
    sixteen.emplace_back(cfg);
    model.prefill(prompts[b == 0 ? 0 : b + 2], sixteen.back(), prompt_act);
  }
  std::vector<ContiguousStore<float>*> ptrs3 = {&three[0], &three[1], &three[2]};
  std::vector<ContiguousStore<float>*> ptrs2 = {&two[0], &two[1]};
  std::vector<ContiguousStore<float>*> ptrs16;
  for (auto& s : sixteen) ptrs16.push_back(&s);
  for (std::size_t step = 0; step < 4; ++step) {
    const Tokens next = random_tokens(kMany, cfg.vocab_size, 100 + step);
    const auto run = [&](std::vector<ContiguousStore<float>*>& ptrs, const Tokens& t) {
      const auto l = model.decode_batch(std::span<const std::int32_t>(t),
                                        std::span<ContiguousStore<float>* const>(ptrs), batch);
      return std::vector<float>(l.begin(), l.end());
    };
    const std::vector<float> batched = run(ptrs3, Tokens(next.begin(), next.begin() + 3));
    const std::vector<float> pair = run(ptrs2, Tokens{next[0], next[2]});
    const std::vector<float> many = run(ptrs16, next);
    for (std::size_t i = 0; i < vocab; ++i) {
      ASSERT_EQ(batched[i], pair[i]) << "step " << step << " logit " << i;
      ASSERT_EQ(many[i], pair[i]) << "step " << step << " logit " << i << " in a batch of 16";
    }
    for (std::size_t b = 0; b < 3; ++b) {
      const auto s = model.decode(next[b], singles[b], one);
      const std::vector<float> single(s.begin(), s.end());
      const auto f = widened.decode(next[b], wide[b], one);
      const std::vector<float> f32_x(f.begin(), f.end());
      const std::vector<float> mine(batched.begin() + static_cast<std::ptrdiff_t>(b * vocab),
                                    batched.begin() + static_cast<std::ptrdiff_t>((b + 1) * vocab));
      const double rule = relative_rms(f32_x, single);
      EXPECT_GT(rule, 1e-3) << "step " << step << ": x in f32 should be far from the rule";
      EXPECT_LT(relative_rms(mine, single), rule / 2) << "step " << step << " sequence " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EverySet, ModelKernelSetTest, ::testing::ValuesIn(kKernelSets),
                         [](const ::testing::TestParamInfo<KernelSet>& set) {
                           return std::string(kernel_set_name(set.param));
                         });

}  // namespace
}  // namespace kvdecode::testing_util
