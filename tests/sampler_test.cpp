// Sampler: run.c's sampled ids (xorshift64* and the sampling rule), greedy ties, and the
// distributions top-k / top-p sample from.
#include "kvdecode/generation/sampler.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"

namespace kvdecode {
namespace {

// run.c's own output as the oracle of the xorshift stream and the sampling rule: run.c sampled
// tests/data/llama2c-tiny/sampled.json's ids from the fixture model. Teacher-forced on them (our
// logits after run.c's tokens), the Sampler with run.c's seed, temperature and top-p draws the
// same id at every step; a different coin stream or cdf walk diverges within a few steps.
// (InteropTest.SampledRunsMatchRunC checks the free-running generation as well.)
struct SampledRun {
  double temperature = 0, top_p = 0;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> ids;
};

/// Each run's "temperature", "topp", "seed" and "sampled_ids" from sampled.json.
std::vector<SampledRun> read_sampled_runs(const std::string& json) {
  const auto number_after = [&](const std::string& key, std::size_t from) {
    const std::size_t at = json.find("\"" + key + "\"", from);
    EXPECT_NE(at, std::string::npos) << "sampled.json: no key " << key;
    return at == std::string::npos ? json.size() : json.find(':', at) + 1;
  };
  std::vector<SampledRun> runs;
  for (std::size_t at = json.find("\"temperature\""); at != std::string::npos;
       at = json.find("\"temperature\"", at + 1)) {
    SampledRun r;
    r.temperature = std::stod(json.substr(number_after("temperature", at), 32));
    r.top_p = std::stod(json.substr(number_after("topp", at), 32));
    r.seed = std::stoull(json.substr(number_after("seed", at), 32));
    const std::size_t open = json.find('[', number_after("sampled_ids", at));
    const std::size_t close = json.find(']', open);
    std::istringstream list(json.substr(open + 1, close - open - 1));
    for (std::string item; std::getline(list, item, ',');) r.ids.push_back(std::stoi(item));
    runs.push_back(std::move(r));
  }
  return runs;
}

TEST(SamplerTest, TeacherForcedDrawsEqualRunCSampledIds) {
  const std::filesystem::path dir = std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny";
  const Model<float> model(load_checkpoint(dir / "model.bin"));
  const ModelConfig& cfg = model.config();
  const std::vector<std::int32_t> prompt = testing_util::read_ids(dir / "prompt_ids.txt");
  const std::vector<SampledRun> runs =
      read_sampled_runs(testing_util::read_text(dir / "sampled.json"));
  ASSERT_EQ(runs.size(), 2u);
  for (const SampledRun& run : runs) {
    ASSERT_EQ(run.ids.size(), 64u);
    Sampler sampler(cfg.vocab_size, SamplerOptions{run.temperature, run.top_p, 0, run.seed});
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 8});
    auto logits = model.prefill(prompt, cache, act);
    for (std::size_t i = 0; i < run.ids.size(); ++i) {
      ASSERT_EQ(sampler.sample(logits), run.ids[i])
          << "-t " << run.temperature << " -p " << run.top_p << " -s " << run.seed << " step " << i;
      if (i + 1 < run.ids.size()) logits = model.decode(run.ids[i], cache, act);
    }
  }
}

TEST(SamplerTest, UniformDrawsLieInTheUnitInterval) {
  XorShiftRng f(7);
  for (int i = 0; i < 1000; ++i) {
    const float x = f.next_f32();
    ASSERT_GE(x, 0.0f);
    ASSERT_LT(x, 1.0f);
  }
}

TEST(SamplerTest, GreedyTakesFirstMaximum) {
  Sampler s(5, SamplerOptions{0.0, 0.9, 0, 1});
  const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f};
  EXPECT_EQ(s.sample(std::span<const float>(logits)), 1);
  const std::vector<double> d = {-1.0, -1.0, -3.0};
  EXPECT_EQ(Sampler::argmax(std::span<const double>(d)), 0);
}

// Frequencies over many draws follow the truncated, renormalised distribution.
std::vector<double> frequencies(const SamplerOptions& o, const std::vector<float>& logits,
                                int draws) {
  Sampler s(static_cast<std::int64_t>(logits.size()), o);
  std::vector<double> f(logits.size());
  for (int i = 0; i < draws; ++i)
    f[static_cast<std::size_t>(s.sample(std::span<const float>(logits)))] += 1.0 / draws;
  return f;
}

std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (const double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

TEST(SamplerTest, MultinomialFollowsSoftmax) {
  const std::vector<double> p = {0.5, 0.3, 0.15, 0.05};
  const auto f = frequencies(SamplerOptions{1.0, 1.0, 0, 9}, logits_of(p), 200000);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i], 0.01) << i;
}

TEST(SamplerTest, TemperatureSharpens) {
  const std::vector<double> p = {0.5, 0.3, 0.15, 0.05};
  // softmax(log p / 0.5) = p² / Σ p².
  double z = 0;
  for (const double x : p) z += x * x;
  const auto f = frequencies(SamplerOptions{0.5, 1.0, 0, 3}, logits_of(p), 200000);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i] * p[i] / z, 0.01) << i;
}

TEST(SamplerTest, TopPKeepsTheNucleus) {
  const std::vector<double> p = {0.15, 0.5, 0.05, 0.3};
  // Sorted: 0.5, 0.3 (sum 0.8 > 0.7: the cut includes the crossing token), renormalised.
  const auto f = frequencies(SamplerOptions{1.0, 0.7, 0, 5}, logits_of(p), 200000);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.01);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.01);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
}

// run.c drops candidates below (1 - top_p) / (n - 1) before sorting; with top_p < 1/n a flat
// distribution has all of them below it (there run.c reads before its array). By the rule's
// definition the nucleus is then the first candidate in (probability, index) order whose
// running sum exceeds top_p: two equal tokens and top_p 0.4 keep token 0 alone (0.5 > 0.4).
TEST(SamplerTest, TopPBelowOneOverNOnAFlatDistributionKeepsTheFirstCandidate) {
  const std::vector<double> p = {0.5, 0.5};
  Sampler s(2, SamplerOptions{1.0, 0.4, 0, 5});
  const std::vector<float> skewed = logits_of({0.1, 0.9});
  const std::vector<float> flat = logits_of(p);
  for (int i = 0; i < 100; ++i) {
    // A skewed draw first, so no candidate list of an earlier call can answer for the flat one.
    ASSERT_EQ(s.sample(std::span<const float>(skewed)), 1);
    ASSERT_EQ(s.sample(std::span<const float>(flat)), 0) << "draw " << i;
  }
  std::vector<double> probs(p.begin(), p.end());
  std::vector<std::int32_t> order(2);
  const auto kept =
      detail::top_k_top_p(std::span<const double>(probs), 2, 0.4, std::span<std::int32_t>(order));
  EXPECT_EQ(kept.count, 1u);
  EXPECT_EQ(order[0], 0);
  EXPECT_EQ(kept.mass, 0.5);
}

// top_k_top_p sorts only the most likely candidates, as many as the cut can need. Against the
// rule written out here (every candidate sorted, the running sum walked in that order), over
// flat to peaked distributions, with ties, every top-p from tiny to 1 and several k: the same
// candidates, in the same order, and the same mass to the last bit.
template <class P>
void expect_cut_as_full_sort(std::size_t n, double spread, bool ties, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, spread);
  std::vector<P> probs(n);
  double z = 0;
  std::vector<double> w(n);
  for (std::size_t i = 0; i < n; ++i) {
    double l = normal(rng);
    if (ties) l = std::round(l * 2) / 2;  // a few distinct values, many equal probabilities
    w[i] = std::exp(l);
    z += w[i];
  }
  for (std::size_t i = 0; i < n; ++i) probs[i] = static_cast<P>(w[i] / z);
  for (const double top_p : {1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 0.99999, 1.0}) {
    for (const std::size_t k : {n, std::size_t{1}, std::size_t{40}, std::size_t{500}, n - 1}) {
      if (k == 0) continue;
      const P p = static_cast<P>(top_p);
      // The rule: candidates at or above (1 - p) / (n - 1) (all when none is), sorted by
      // probability then index, cut after the k-th and after the running sum first exceeds p.
      const P cutoff = p < P(1) && n > 1 ? (P(1) - p) / static_cast<P>(n - 1) : P(0);
      std::vector<std::int32_t> all;
      for (std::size_t i = 0; i < n; ++i)
        if (probs[i] >= cutoff) all.push_back(static_cast<std::int32_t>(i));
      if (all.empty())
        for (std::size_t i = 0; i < n; ++i) all.push_back(static_cast<std::int32_t>(i));
      std::sort(all.begin(), all.end(), [&](std::int32_t a, std::int32_t b) {
        return probs[static_cast<std::size_t>(a)] > probs[static_cast<std::size_t>(b)] ||
               (probs[static_cast<std::size_t>(a)] == probs[static_cast<std::size_t>(b)] && a < b);
      });
      std::size_t count = std::min(k, all.size());
      P mass = 0;
      for (std::size_t i = 0; i < std::min(k, all.size()); ++i) {
        mass += probs[static_cast<std::size_t>(all[i])];
        if (mass > p) {
          count = i + 1;
          break;
        }
      }
      std::vector<std::int32_t> order(n, -1);
      const auto kept =
          detail::top_k_top_p(std::span<const P>(probs), k, p, std::span<std::int32_t>(order));
      const std::string what = "n " + std::to_string(n) + " spread " + std::to_string(spread) +
                               (ties ? " ties" : "") + " top_p " + std::to_string(top_p) + " k " +
                               std::to_string(k);
      ASSERT_EQ(kept.count, count) << what;
      ASSERT_EQ(kept.mass, mass) << what;
      for (std::size_t i = 0; i < count; ++i) ASSERT_EQ(order[i], all[i]) << what << " rank " << i;
      if constexpr (std::is_same_v<P, float>) {  // the Sampler's form: packed keys
        std::vector<std::uint64_t> keys(n);
        const auto by_keys = detail::top_k_top_p(std::span<const float>(probs), k, p,
                                                 std::span<std::uint64_t>(keys));
        ASSERT_EQ(by_keys.count, count) << what << " (keys)";
        ASSERT_EQ(by_keys.mass, mass) << what << " (keys)";
        for (std::size_t i = 0; i < count; ++i)
          ASSERT_EQ(detail::candidate_id(keys[i]), all[i]) << what << " rank " << i << " (keys)";
      }
    }
  }
}

TEST(SamplerTest, TopPCutEqualsTheFullSortBitForBit) {
  std::uint64_t seed = 1;
  for (const std::size_t n : {2u, 3u, 50u, 129u, 1000u, 4096u, 32000u})
    for (const double spread : {0.01, 0.5, 1.0, 2.0, 4.0, 10.0})
      for (const bool ties : {false, true}) {
        expect_cut_as_full_sort<float>(n, spread, ties, ++seed);
        expect_cut_as_full_sort<double>(n, spread, ties, ++seed);
      }
}

// The trap for a cut taken too early: 1222 equal probabilities whose f32 running sum over the
// first 128 falls short of their exact sum, and top_p between the two. Summed exactly, the
// first 128 pass top_p; summed as the cut sums them, only 129 do, which is the rule's answer.
TEST(SamplerTest, TopPCutWaitsForTheRunningSumNotTheExactOne) {
  const std::size_t n = 1222;
  const std::vector<float> probs(n, 1.0f / static_cast<float>(n));
  float c128 = 0.0f;
  for (std::size_t i = 0; i < 128; ++i) c128 += probs[i];
  const float top_p = std::nextafter(c128, 1.0f);
  ASSERT_LT(static_cast<double>(top_p), 128.0 * double{probs[0]}) << "no trap: pick another n";
  std::vector<std::int32_t> order(n, -1);
  const auto kept =
      detail::top_k_top_p(std::span<const float>(probs), n, top_p, std::span<std::int32_t>(order));
  ASSERT_EQ(kept.count, 129u);
  EXPECT_EQ(kept.mass, c128 + probs[0]);
  for (std::size_t i = 0; i < kept.count; ++i) ASSERT_EQ(order[i], static_cast<std::int32_t>(i));
  std::vector<std::uint64_t> keys(n);
  const auto by_keys =
      detail::top_k_top_p(std::span<const float>(probs), n, top_p, std::span<std::uint64_t>(keys));
  ASSERT_EQ(by_keys.count, 129u);
  EXPECT_EQ(by_keys.mass, c128 + probs[0]);
  for (std::size_t i = 0; i < by_keys.count; ++i)
    ASSERT_EQ(detail::candidate_id(keys[i]), static_cast<std::int32_t>(i));
}

TEST(SamplerTest, TopKKeepsTheKMostLikely) {
  const std::vector<double> p = {0.15, 0.5, 0.05, 0.3};
  const auto f = frequencies(SamplerOptions{1.0, 1.0, 2, 5}, logits_of(p), 200000);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.01);
  EXPECT_NEAR(f[3], 0.3 / 0.8, 0.01);
  EXPECT_EQ(f[0] + f[2], 0.0);
  const auto g = frequencies(SamplerOptions{1.0, 0.9, 1, 5}, logits_of(p), 1000);
  EXPECT_NEAR(g[1], 1.0, 1e-9);  // top-k 1 is greedy
}

// min-p: tokens below min_p × p_max are dropped and the rest renormalised. With p = {0.5, 0.3,
// 0.15, 0.05} and min_p 0.25 the floor is 0.125: 0.05 goes, the others keep p / 0.95.
TEST(SamplerTest, MinPDropsTokensBelowAFractionOfTheMostLikely) {
  const std::vector<double> p = {0.5, 0.3, 0.15, 0.05};
  SamplerOptions o{1.0, 1.0, 0, 11};
  o.min_p = 0.25;
  const auto f = frequencies(o, logits_of(p), 200000);
  EXPECT_NEAR(f[0], 0.5 / 0.95, 0.01);
  EXPECT_NEAR(f[1], 0.3 / 0.95, 0.01);
  EXPECT_NEAR(f[2], 0.15 / 0.95, 0.01);
  EXPECT_EQ(f[3], 0.0);
}

// The repetition penalty, written out: a recent token's logit l becomes l / 1.5 if l > 0, else
// l × 1.5, once however often it recurs. Greedy then picks from the penalised logits.
TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  SamplerOptions o{0.0, 1.0, 0, 1};
  o.repeat_penalty = 1.5;
  Sampler s(4, o);
  const std::vector<float> l = {3.0f, 2.5f, -1.0f, -1.2f};
  const std::vector<std::int32_t> none, first = {0, 0, 0};
  EXPECT_EQ(s.sample(std::span<const float>(l), none), 0);
  // 3 / 1.5 = 2 < 2.5: token 1 wins.
  EXPECT_EQ(s.sample(std::span<const float>(l), first), 1);
  // Only negative ones left: {2, 3} penalised, 0 and 1 too: 2, 2.5/1.5 = 1.67, -1.5, -1.2.
  const std::vector<std::int32_t> all = {0, 1, 2};
  EXPECT_EQ(s.sample(std::span<const float>(l), all), 0);
  const std::vector<float> neg = {-1.0f, -1.1f, -5.0f, -5.0f};
  const std::vector<std::int32_t> zero = {0};
  EXPECT_EQ(s.sample(std::span<const float>(neg), zero), 1);  // -1.5 < -1.1
  // Sampling follows softmax of the penalised logits: {ln 0.6 / 1.5 ... } written out.
  SamplerOptions m{1.0, 1.0, 0, 5};
  m.repeat_penalty = 2.0;
  Sampler t(2, m);
  const std::vector<float> two = {2.0f, 1.0f};  // penalised: {1, 1} → 50 / 50
  const std::vector<std::int32_t> recent = {0};
  int zeros = 0;
  for (int i = 0; i < 100000; ++i) zeros += t.sample(std::span<const float>(two), recent) == 0;
  EXPECT_NEAR(zeros / 100000.0, 0.5, 0.01);
  EXPECT_THAT([&] { s.sample(std::span<const float>(l), std::vector<std::int32_t>{4}); },
              ::testing::ThrowsMessage<Error>(
                  ::testing::HasSubstr("recent token id 4 is outside [0, vocab_size 4)")));
  // penalized(): the logits sample() draws from, each distinct recent token once, by the rule.
  const std::vector<std::int32_t> twice = {0, 2, 0};
  const std::span<const float> p = s.penalized(std::span<const float>(l), twice);
  EXPECT_EQ(std::vector<float>(p.begin(), p.end()),
            (std::vector<float>{3.0f / 1.5f, 2.5f, -1.0f * 1.5f, -1.2f}));
  EXPECT_THAT([&] { s.penalized(std::span<const float>(l), std::vector<std::int32_t>{-1}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("recent token id -1")));
  Sampler off(4, {.temperature = 0});
  EXPECT_THAT([&] { off.penalized(std::span<const float>(l), first); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("the repeat penalty is 1")));
}

TEST(SamplerTest, SameSeedSameTokens) {
  const std::vector<float> l = logits_of({0.2, 0.2, 0.2, 0.2, 0.2});
  Sampler a(5, SamplerOptions{1.0, 0.9, 0, 77}), b(5, SamplerOptions{1.0, 0.9, 0, 77});
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(a.sample(std::span<const float>(l)), b.sample(std::span<const float>(l)));
}

TEST(SamplerTest, BadOptionsAreNamed) {
  EXPECT_THAT(
      [] {
        Sampler(4, SamplerOptions{-1.0, 0.9, 0, 1});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("temperature must be")));
  EXPECT_THAT(
      [] {
        Sampler(4, SamplerOptions{1.0, 0.9, -2, 1});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("top_k must be >= 0, got -2")));
  EXPECT_THAT(
      [] {
        Sampler(4, SamplerOptions{1.0, 0.9, 0, 0});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("seed 0")));
  EXPECT_THAT(
      [] {
        SamplerOptions o;
        o.min_p = 1.5;
        Sampler(4, o);
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("min_p must be in [0, 1], got 1.5")));
  EXPECT_THAT(
      [] {
        SamplerOptions o;
        o.repeat_penalty = 0;
        Sampler(4, o);
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("repeat_penalty must be")));
  EXPECT_THAT([] { Sampler(0, SamplerOptions{}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("vocab_size must be in [1,")));
  // Ids past int32 are refused before the [vocab_size] buffers are allocated.
  EXPECT_THAT([] { Sampler(std::int64_t{1} << 31, SamplerOptions{}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("got 2147483648")));
  Sampler s(4, SamplerOptions{});
  const std::vector<float> three(3);
  EXPECT_THAT(
      [&] { s.sample(std::span<const float>(three)); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("3 logits for a vocabulary of 4")));
}

}  // namespace
}  // namespace kvdecode
