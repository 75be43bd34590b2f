// Decode with a thread pool equals decode without, bit for bit (every GEMV row and attention
// head is computed by the same arithmetic on whichever thread takes it); prefill with a pool is
// within the f32 bound (Eigen's GEMM may block a column slice differently). And the bf16-weight
// model against the f32 model, within a bound derived from bf16's rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "double_forward.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using testing_util::max_abs_diff;
using testing_util::random_tokens;

/// Large enough that every projection passes kMinParallelWeights (dim × dim = 65536) and
/// attention passes kMinParallelAttention, so the pool really splits the work; GQA 8/2.
ModelConfig threaded_config() {
  return testing_util::test_config({.dim = 256,
                                    .hidden_dim = 400,  // not a multiple of 16 × threads: uneven
                                    .n_layers = 2,
                                    .n_heads = 8,
                                    .n_kv_heads = 2,
                                    .vocab_size = 1000,
                                    .seq_len = 80});
}

template <class W>
void expect_pool_decode_bit_identical(const Model<float, W>& model) {
  const ModelConfig& cfg = model.config();
  const auto tokens = random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 5);
  ContiguousStore<float> plain_cache(cfg);
  Activations<float> plain(cfg, {.max_chunk = 1});
  std::vector<std::vector<float>> expected;
  for (const auto t : tokens) {
    const auto l = model.decode(t, plain_cache, plain);
    expected.emplace_back(l.begin(), l.end());
  }
  for (const std::size_t threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 1, .thread_pool = &pool});
    for (std::size_t p = 0; p < tokens.size(); ++p) {
      const auto l = model.decode(tokens[p], cache, act);
      ASSERT_TRUE(std::equal(l.begin(), l.end(), expected[p].begin()))
          << threads << " threads, position " << p;
    }
    EXPECT_TRUE(testing_util::same_contents(cache, plain_cache, tokens.size()));
  }
}

TEST(ThreadsTest, PoolDecodeEqualsSingleThreadF32) {
  expect_pool_decode_bit_identical(Model<float>(random_weights<float>(threaded_config(), 3)));
}

TEST(ThreadsTest, PoolDecodeEqualsSingleThreadBf16) {
  expect_pool_decode_bit_identical(
      Model<float, bf16>(convert_weights<bf16>(random_weights<float>(threaded_config(), 3))));
}

TEST(ThreadsTest, PoolPrefillMatchesReference) {
  const ModelConfig cfg = threaded_config();
  const Model<float> model(random_weights<float>(cfg, 4));
  const auto tokens = random_tokens(40, cfg.vocab_size, 6);
  const std::vector<float> ref = model.forward_reference(tokens);
  double scale = 0;
  for (const float v : ref) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (const std::size_t threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg,
                           {.max_chunk = 16, .thread_pool = &pool});  // chunks of 16: 16, 16, 8
    std::vector<float> all(ref.size());
    model.prefill(tokens, cache, act, std::span<float>(all));
    EXPECT_LE(max_abs_diff(all, ref), 1e-5 * (1 + scale)) << threads << " threads";
  }
}

TEST(ThreadsTest, ActivationsRejectALargerPoolThanTheyWereSizedFor) {
  const ModelConfig cfg = threaded_config();
  const Model<float> model(random_weights<float>(cfg, 4));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1});  // sized for one thread
  ThreadPool pool(2);
  act.pool = &pool;
  EXPECT_THROW(model.decode(1, cache, act), Error);
  EXPECT_EQ(cache.size(), 0u);
}

// ---------------------------------------------------------------------------------------------
// bf16 weights against the f32 model.
//
// Bound, derived before measuring (u = 2^-8, bf16's unit roundoff): every path, decode and
// prefill alike (gemv.hpp's rule), rounds every weight and every projection input to bf16, so
// each of the M = 7 n_layers + 1 weight matrices on the path perturbs its output by at most 2u
// relative (|Σ w̃x̃ - Σ wx| ≤ (2u + u²) Σ|wx|, and Σ|wx| is of the order of ‖y‖ for these
// incoherent random weights). To first order the perturbations add, and RMSNorm renormalises
// the residual before every block, so the logits' normalised error ‖Δ‖₂/‖logits‖₂ ≤ M · 2u.
// ---------------------------------------------------------------------------------------------

/// ‖got - ref‖₂ / ‖ref‖₂; +infinity when either holds a NaN (so a max over calls keeps it).
template <class A, class B>
double normalised_error(std::span<const A> got, std::span<const B> ref) {
  double d = 0, r = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    d += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
    r += static_cast<double>(ref[i]) * ref[i];
  }
  const double e = std::sqrt(d / r);
  return std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
}

// ---------------------------------------------------------------------------------------------
// bf16 weights against a double-precision forward over the same rounded weights.
//
// The rule every bf16 path follows: each weight is bf16 (rounded to nearest-even from f32),
// each weight product's input x is rounded to bf16 (nearest-even), and the bf16 × bf16
// products, exact in f32, are summed in f32. The reference (double_forward.hpp) rounds the f32
// weights and every product's input with its own round_to_bf16 and sums in double, so what
// remains is f32 summation and activation rounding (measured ≤ 1.1e-6 · (1 + |ref|) at 90 % of
// positions), except where an input element's f32 value and its double counterpart round to
// different bf16 neighbours: one ulp (2^-8 relative) of one input, measured up to 1.8e-2 on a
// logit, and carried to later positions by the K/V cache. So: three positions in four within
// kBf16RuleTolerance = 1e-5 · (1 + |ref|), every position within kBf16FlipTolerance = 5e-2 ·
// (1 + |ref|). One layer keeps flips rare (about one position in ten here). A truncating
// rounding of weights or inputs, or a product that drops input columns, moves every position by
// 1e-3 or more.
// ---------------------------------------------------------------------------------------------

constexpr double kBf16RuleTolerance = 1e-5;
constexpr double kBf16FlipTolerance = 5e-2;

ModelConfig bf16_config() {
  ModelConfig cfg = threaded_config();
  cfg.n_layers = 1;
  cfg.seq_len = 48;
  return cfg;
}

/// Checks per-position errors (|Δ| / (1 + |ref|), worst logit of each position) against the
/// rule: three in four within kBf16RuleTolerance, all within kBf16FlipTolerance.
void expect_bf16_rule(std::vector<double> errors, const std::string& what) {
  std::sort(errors.begin(), errors.end());
  const double p75 = errors[errors.size() * 3 / 4], worst = errors.back();
  EXPECT_LE(p75, kBf16RuleTolerance) << what << ": 75th percentile";
  EXPECT_LE(worst, kBf16FlipTolerance) << what << ": worst position";
  std::printf("%s vs the bf16-rule reference: |Δ|/(1+|ref|) p75 %.3g, worst %.3g\n", what.c_str(),
              p75, worst);
}

/// max over logits of |got - ref| / (1 + |ref|), +infinity on a NaN.
double worst_relative(std::span<const float> got, std::span<const double> ref) {
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - ref[i]) / (1 + std::abs(ref[i]));
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, d);
  }
  return worst;
}

TEST(Bf16ModelTest, DecodeFollowsTheBf16RuleOnRoundedWeights) {
  const ModelConfig cfg = bf16_config();
  const Weights<float> w = random_weights<float>(cfg, 9);
  const Model<float, bf16> bf(convert_weights<bf16>(w));
  const testing_util::DoubleWeights ref_w = testing_util::widen_weights(w, true);
  const auto tokens = random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 7);
  for (const std::size_t threads : {1, 2}) {
    ThreadPool pool(threads);
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 1, .thread_pool = &pool});
    testing_util::DoubleCache ref_cache(cfg);
    std::vector<double> errors;
    for (std::size_t p = 0; p < tokens.size(); ++p) {
      const auto logits = bf.decode(tokens[p], cache, act);
      const std::vector<double> ref =
          testing_util::double_step(ref_w, tokens[p], p, ref_cache, true);
      errors.push_back(worst_relative(logits, ref));
    }
    expect_bf16_rule(errors, "bf16 decode, " + std::to_string(threads) + " threads");
  }
}

// Prefill (several tokens per product) rounds its inputs to bf16 as decode does, in every kernel
// set this CPU runs (AMX off: the avx512bf16 set's own GEMM, bf16 pairs; amx_test.cpp holds the
// tiles to the same rule). Chunks of 5: gemm_few; of 32: the set's GEMM (Eigen's in the portable
// set, packed f32 panels in avx2 and avx512, bf16 pairs in avx512bf16).
TEST(Bf16ModelTest, PrefillFollowsTheBf16RuleOnRoundedWeightsInEverySet) {
  const ModelConfig cfg = bf16_config();
  const Weights<float> w = random_weights<float>(cfg, 9);
  const Model<float, bf16> bf(convert_weights<bf16>(w));
  const auto tokens = random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 7);
  const std::vector<double> ref =
      testing_util::double_forward(testing_util::widen_weights(w, true), tokens, true);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const testing_util::ForcedAmx amx_off(false);
  for (const KernelSet set : kKernelSets) {
    if (!cpu_supports(set)) {
      std::printf("kernel set %s: skipped, this CPU cannot run it\n", kernel_set_name(set));
      continue;
    }
    const testing_util::ForcedKernelSet forced(set);
    for (const std::size_t threads : {1, 2})
      for (const std::size_t chunk : {std::size_t{5}, std::size_t{32}}) {
        ThreadPool pool(threads);
        ContiguousStore<float> cache(cfg);
        Activations<float> act(cfg, {.max_chunk = chunk, .thread_pool = &pool});
        std::vector<float> all(tokens.size() * vocab);
        bf.prefill(tokens, cache, act, std::span<float>(all));
        std::vector<double> errors;
        for (std::size_t p = 0; p < tokens.size(); ++p)
          errors.push_back(worst_relative(std::span<const float>(all).subspan(p * vocab, vocab),
                                          std::span<const double>(ref).subspan(p * vocab, vocab)));
        expect_bf16_rule(errors, std::string("bf16 prefill, set ") + kernel_set_name(set) + ", " +
                                     std::to_string(threads) + " threads, chunks of " +
                                     std::to_string(chunk));
      }
  }
}

// The derived bound of the header comment above, a second, looser check of the same paths.
TEST(Bf16ModelTest, LogitsWithinDerivedBoundOfF32Model) {
  ModelConfig cfg = threaded_config();
  cfg.n_layers = 4;
  const Weights<float> w = random_weights<float>(cfg, 9);
  const Model<float, bf16> bf(convert_weights<bf16>(w));
  const Model<float> f32(convert_weights<float>(w));
  const double u = 0x1p-8;
  const double m = 7.0 * static_cast<double>(cfg.n_layers) + 1;
  const auto tokens = random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 7);
  ContiguousStore<float> cb(cfg), cf(cfg);
  Activations<float> ab(cfg, {.max_chunk = 1}), af(cfg, {.max_chunk = 1});
  double worst = 0;
  for (const auto t : tokens) {
    const auto lb = bf.decode(t, cb, ab);
    const auto lf = f32.decode(t, cf, af);
    worst = std::max(worst, normalised_error(lb, lf));
  }
  EXPECT_LE(worst, m * 2 * u);
  std::printf("bf16 decode: worst normalised logit error %.4g, bound M·2u = %.4g\n", worst,
              m * 2 * u);

  ContiguousStore<float> pb(cfg), pf(cfg);
  Activations<float> xb(cfg, {.max_chunk = 32}), xf(cfg, {.max_chunk = 32});
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  std::vector<float> all_b(tokens.size() * vocab), all_f(all_b.size());
  bf.prefill(tokens, pb, xb, std::span<float>(all_b));
  f32.prefill(tokens, pf, xf, std::span<float>(all_f));
  double worst_prefill = 0;
  for (std::size_t p = 0; p < tokens.size(); ++p)
    worst_prefill = std::max(
        worst_prefill, normalised_error(std::span<const float>(all_b).subspan(p * vocab, vocab),
                                        std::span<const float>(all_f).subspan(p * vocab, vocab)));
  EXPECT_LE(worst_prefill, m * 2 * u);
  std::printf("bf16 prefill: worst normalised logit error %.4g, bound M·2u = %.4g\n", worst_prefill,
              m * 2 * u);
}

}  // namespace
}  // namespace kvdecode
