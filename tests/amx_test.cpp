// The AMX bf16 GEMM (detail/gemm_amx.hpp): against a product computed here in double from the
// bf16-rounded inputs over shapes with every kind of tail (tokens, depth, output columns, a
// thread's slice inside the matrix); through linear_group on a pool with AMX on and off, and with
// panels re-laid beforehand; the layout of a model's AmxPanels against the tile format; and a
// bf16-weight model's prefill on AMX (panels re-laid once or per call) against the
// double-precision forward of the bf16 rule.
// Skipped, saying why, where the CPU lacks AMX-BF16 or the OS refuses the tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "double_forward.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

#define KVDECODE_SKIP_WITHOUT_AMX()                                                          \
  if (!cpu_supports_amx())                                                                   \
  GTEST_SKIP() << "this CPU lacks AMX-BF16, or the OS refused this process the tile state; " \
                  "the AMX kernels cannot run here"

/// Values in [-1, 1) from a fixed seed.
std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& e : v) e = static_cast<float>(rng.symmetric());
  return v;
}

double rounded(float v) { return static_cast<double>(static_cast<float>(bf16(v))); }

// Every tail: tokens below, at and past one and two 16-row tiles; depths below, at and past a
// 32-wide tile row (odd ones split a bf16 pair); outputs below, at and past 16 and the 32 of a
// panel; and a slice [c0, c1) inside the matrix, as a pool thread runs. Each output must be
// within the bound of an f32 sum of `in` exact products, in · 2^-24 · Σ|w x| (any summation
// order: the first-order bound of recursive summation, plus the final rounding); columns outside
// the slice keep their NaN sentinel.
TEST(AmxGemmTest, MatchesDoubleProductOfRoundedInputsOverEveryTail) {
  KVDECODE_SKIP_WITHOUT_AMX();
  for (const std::size_t n : {1, 7, 16, 17, 31, 32, 33, 50, 64, 77})
    for (const std::size_t in : {16, 17, 31, 32, 33, 70, 96, 200})
      for (const std::size_t out : {1, 15, 16, 17, 33, 64, 70}) {
        const auto xf = random_floats(n * in, n * 131 + in);
        const auto wf = random_floats(out * in, out * 7 + in);
        std::vector<bf16> w(out * in);
        std::transform(wf.begin(), wf.end(), w.begin(), [](float v) { return bf16(v); });
        const std::size_t lda = detail::amx_lda(in);
        std::vector<bf16> a(n * lda);                          // [n][lda]
        std::vector<bf16> panel(detail::kAmxPanelRows * lda);  // [32][lda]
        detail::pack_x_amx(a.data(), xf.data(), n, in);
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t c = 0; c < lda; ++c)
            ASSERT_EQ(static_cast<double>(static_cast<float>(a[i * lda + c])),
                      c < in ? rounded(xf[i * in + c]) : 0.0)
                << "packed x, token " << i << " column " << c;
        std::vector<bf16> packed(detail::amx_packed_size(out, in));
        detail::pack_weights_amx(packed.data(), w.data(), out, in);
        const std::size_t slices[][2] = {{0, out},
                                         {std::min<std::size_t>(1, out), out},
                                         {std::min<std::size_t>(16, out), out},
                                         {out / 3, out - out / 4}};
        for (const bool prepacked : {false, true})
          for (const auto& s : slices) {
            const std::size_t c0 = s[0], c1 = s[1];
            if (prepacked && c0 % 16 != 0) continue;  // packed panels start at blocks of 16
            std::vector<float> y(n * out, std::numeric_limits<float>::quiet_NaN());
            detail::gemm_amx(y.data(), a.data(), w.data(), n, in, out, c0, c1, panel.data(),
                             prepacked ? packed.data() : nullptr);
            for (std::size_t i = 0; i < n; ++i)
              for (std::size_t o = 0; o < out; ++o) {
                const float got = y[i * out + o];
                if (o < c0 || o >= c1) {
                  ASSERT_TRUE(std::isnan(got)) << "column " << o << " outside [" << c0 << ", " << c1
                                               << ") written, n " << n << " in " << in;
                  continue;
                }
                double ref = 0, mag = 0;
                for (std::size_t c = 0; c < in; ++c) {
                  const double p = static_cast<double>(static_cast<float>(w[o * in + c])) *
                                   rounded(xf[i * in + c]);
                  ref += p;
                  mag += std::abs(p);
                }
                ASSERT_LE(std::abs(got - ref), static_cast<double>(in + 1) * 0x1p-24 * mag)
                    << "n " << n << " in " << in << " out " << out << " slice [" << c0 << ", " << c1
                    << ") token " << i << " output " << o << (prepacked ? ", prepacked" : "");
              }
          }
      }
}

// Small integers: every product and every partial sum is exact in f32, so the tiles must give
// the double product exactly, whatever their summation order; a misplaced weight or input
// element cannot hide inside a tolerance.
TEST(AmxGemmTest, ExactOnSmallIntegers) {
  KVDECODE_SKIP_WITHOUT_AMX();
  const std::size_t n = 37, in = 75, out = 49;
  std::vector<float> x(n * in);
  std::vector<bf16> w(out * in);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(static_cast<int>(i % 13) - 6);
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = bf16(static_cast<float>(static_cast<int>((i * 7) % 11) - 5));
  const std::size_t lda = detail::amx_lda(in);
  std::vector<bf16> a(n * lda), panel(detail::kAmxPanelRows * lda);
  detail::pack_x_amx(a.data(), x.data(), n, in);
  std::vector<float> y(n * out);
  detail::gemm_amx(y.data(), a.data(), w.data(), n, in, out, 0, out, panel.data());
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t o = 0; o < out; ++o) {
      double ref = 0;
      for (std::size_t c = 0; c < in; ++c)
        ref += static_cast<double>(x[i * in + c]) * static_cast<float>(w[o * in + c]);
      ASSERT_EQ(y[i * out + o], ref) << "token " << i << " output " << o;
    }
}

// linear_group with the avx512bf16 set on pools of 1-3 threads (slices of 16 columns, so a
// thread's slice ends mid-panel), AMX on and off: both within the f32 bound of the double
// product over x rounded to bf16.
TEST(AmxGemmTest, LinearGroupOnPoolsWithAmxOnAndOff) {
  KVDECODE_SKIP_WITHOUT_AMX();
  const std::size_t in = 70, out = 600, n = 40;  // 42000 weights: above kMinParallelWeights
  static_assert(70 * 600 >= detail::kMinParallelWeights);
  const auto xf = random_floats(n * in, 11);
  const auto wf = random_floats(out * in, 12);
  std::vector<bf16> w(out * in);
  std::transform(wf.begin(), wf.end(), w.begin(), [](float v) { return bf16(v); });
  for (const bool on : {true, false}) {
    const ForcedAmx forced(on);
    for (const std::size_t threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> panels(threads * detail::kPanelRows * in), scratch(n * in);
      std::vector<float> y(n * out, std::numeric_limits<float>::quiet_NaN());
      detail::linear_group<float, bf16>({{y.data(), w.data(), out}}, xf.data(), n, in, &pool,
                                        {panels.data(), detail::kPanelRows * in, scratch.data()},
                                        KernelSet::kAvx512Bf16);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t o = 0; o < out; ++o) {
          double ref = 0, mag = 0;
          for (std::size_t c = 0; c < in; ++c) {
            const double p =
                static_cast<double>(static_cast<float>(w[o * in + c])) * rounded(xf[i * in + c]);
            ref += p;
            mag += std::abs(p);
          }
          ASSERT_LE(std::abs(y[i * out + o] - ref), static_cast<double>(in + 1) * 0x1p-24 * mag)
              << (on ? "AMX" : "no AMX") << ", " << threads << " threads, token " << i << " output "
              << o;
        }
    }
  }
}

// A projection given amx_panels reads them, not the row-major matrix: the panels of a second
// matrix w2 beside w must give the double product with w2 (within the f32 bound above), on pools
// of 1-3 threads whose slices start at odd blocks of 16.
TEST(AmxGemmTest, LinearGroupReadsTheGivenPanels) {
  KVDECODE_SKIP_WITHOUT_AMX();
  const ForcedAmx forced(true);
  const std::size_t in = 96, out = 592, n = 45;  // 592 = 18.5 panels: a half panel at the end
  const auto xf = random_floats(n * in, 21);
  std::vector<bf16> w(out * in), w2(out * in);
  for (const auto& [to, seed] : {std::pair{&w, 22}, std::pair{&w2, 23}}) {
    const auto f = random_floats(out * in, static_cast<std::uint64_t>(seed));
    std::transform(f.begin(), f.end(), to->begin(), [](float v) { return bf16(v); });
  }
  std::vector<bf16> packed(detail::amx_packed_size(out, in));
  detail::pack_weights_amx(packed.data(), w2.data(), out, in);
  for (const std::size_t threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    std::vector<float> panels(threads * detail::kPanelRows * in), scratch(n * in);
    std::vector<float> y(n * out, std::numeric_limits<float>::quiet_NaN());
    detail::linear_group<float, bf16>(
        {{y.data(), w.data(), out, packed.data()}}, xf.data(), n, in, &pool,
        {panels.data(), detail::kPanelRows * in, scratch.data()}, KernelSet::kAvx512Bf16);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t o = 0; o < out; ++o) {
        double ref = 0, mag = 0;
        for (std::size_t c = 0; c < in; ++c) {
          const double p =
              static_cast<double>(static_cast<float>(w2[o * in + c])) * rounded(xf[i * in + c]);
          ref += p;
          mag += std::abs(p);
        }
        ASSERT_LE(std::abs(y[i * out + o] - ref), static_cast<double>(in + 1) * 0x1p-24 * mag)
            << threads << " threads, token " << i << " output " << o;
      }
  }
}

// The panels a bf16 model builds hold every layer matrix at the place the B tiles read it,
// written here from the tile format (Intel SDM, TDPBF16PS: row p of a B tile holds the pairs
// (w[j][2p], w[j][2p + 1]) of its 16 outputs j): matrix element (j, k) at block j / 16, depth
// block k / 32, pair row (k % 32) / 2, column j % 16, half k % 2; every other element zero.
TEST(AmxPanelsTest, ModelPanelsHoldEachWeightWhereTheTilesReadIt) {
  KVDECODE_SKIP_WITHOUT_AMX();
  if (!cpu_supports(KernelSet::kAvx512Bf16))
    GTEST_SKIP() << "AMX runs with the avx512bf16 set, which this CPU lacks";
  const ForcedAmx amx(true);
  const ModelConfig cfg = test_config({.dim = 80,  // depth 80: a block of 32 half filled
                                       .hidden_dim = 200,
                                       .n_layers = 2,
                                       .n_heads = 4,
                                       .n_kv_heads = 2,
                                       .vocab_size = 64,
                                       .seq_len = 8});
  const Weights<bf16> w = convert_weights<bf16>(random_weights<float>(cfg, 5));
  const AmxPanels panels(w);
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  std::size_t bytes = 0;
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights<bf16>& lw = w.layers[l];
    const struct {
      const char* name;
      AlignedBuffer<bf16> AmxLayerPanels::*panel;
      const AlignedBuffer<bf16>& m;
      std::size_t out, in;
    } matrices[] = {{"wq", &AmxLayerPanels::wq, lw.wq, dim, dim},
                    {"wk", &AmxLayerPanels::wk, lw.wk, kv_dim, dim},
                    {"wv", &AmxLayerPanels::wv, lw.wv, kv_dim, dim},
                    {"wo", &AmxLayerPanels::wo, lw.wo, dim, dim},
                    {"w1", &AmxLayerPanels::w1, lw.w1, hidden, dim},
                    {"w2", &AmxLayerPanels::w2, lw.w2, dim, hidden},
                    {"w3", &AmxLayerPanels::w3, lw.w3, hidden, dim}};
    for (const auto& m : matrices) {
      const bf16* p = panels.get(l, m.panel);
      ASSERT_NE(p, nullptr) << "layer " << l << " " << m.name;
      const std::size_t depth = (m.in + 31) / 32 * 32;
      const std::size_t blocks = (m.out + 31) / 32 * 2 + 1;  // whole panels and the zero block
      bytes += blocks * 16 * depth * sizeof(bf16);
      std::vector<float> expected(blocks * 16 * depth, 0.0f);
      for (std::size_t j = 0; j < m.out; ++j)
        for (std::size_t k = 0; k < m.in; ++k)
          expected[(j / 16) * 16 * depth + (k / 32) * 512 + (k % 32) / 2 * 32 + (j % 16) * 2 +
                   k % 2] = static_cast<float>(m.m[j * m.in + k]);
      for (std::size_t e = 0; e < expected.size(); ++e)
        ASSERT_EQ(static_cast<float>(p[e]), expected[e])
            << "layer " << l << " " << m.name << " element " << e;
    }
  }
  EXPECT_EQ(panels.bytes(), bytes);
  const Model<float, bf16> model(convert_weights<bf16>(random_weights<float>(cfg, 5)));
  EXPECT_EQ(model.amx_panel_bytes(), bytes);
}

// With AMX off when the model is built there are no panels (no memory spent); turned on later,
// prefill re-lays each panel per call and still follows the bf16 rule (the model test below).
TEST(AmxPanelsTest, NoPanelsWhenAmxIsOffAtConstruction) {
  const ModelConfig cfg = test_config({.dim = 64,
                                       .hidden_dim = 96,
                                       .n_layers = 1,
                                       .n_heads = 4,
                                       .n_kv_heads = 2,
                                       .vocab_size = 32,
                                       .seq_len = 8});
  const bool before = amx_enabled();
  force_amx(false);
  const Model<float, bf16> m(convert_weights<bf16>(random_weights<float>(cfg, 3)));
  force_amx(before);
  EXPECT_EQ(m.amx_panel_bytes(), 0u);
  EXPECT_EQ(AmxPanels().bytes(), 0u);
  EXPECT_EQ(AmxPanels().get(0, &AmxLayerPanels::wq), nullptr);
}

TEST(AmxSwitchTest, ForcingAmxWhereUnavailableThrowsAndChangesNothing) {
  if (cpu_supports_amx()) GTEST_SKIP() << "AMX is available here: nothing to refuse";
  const bool before = amx_enabled();
  EXPECT_THROW(force_amx(true), Error);
  EXPECT_EQ(amx_enabled(), before);
}

// ---------------------------------------------------------------------------------------------
// A bf16-weight model's prefill on AMX against the double-precision forward of the bf16 rule
// (double_forward.hpp: weights and every product's input rounded to bf16, sums in double).
// The tolerances are threads_test.cpp's for every bf16 path (derived there): f32 summation and
// activation rounding keep three positions in four within 1e-5 · (1 + |ref|); an input whose
// f32 and double values round to neighbouring bf16 values moves a position by up to ~2e-2, so
// every position within 5e-2 · (1 + |ref|). Breaking the rule (x kept in f32, a dropped or
// misplaced column) moves every position by 1e-3 or more.
// ---------------------------------------------------------------------------------------------

constexpr double kBf16RuleTolerance = 1e-5;
constexpr double kBf16FlipTolerance = 5e-2;

TEST(AmxModelTest, Bf16PrefillOnAmxFollowsTheBf16Rule) {
  KVDECODE_SKIP_WITHOUT_AMX();
  if (!cpu_supports(KernelSet::kAvx512Bf16))
    GTEST_SKIP() << "AMX runs with the avx512bf16 set, which this CPU lacks";
  const ForcedKernelSet set(KernelSet::kAvx512Bf16);
  const ForcedAmx amx(true);
  const ModelConfig cfg = test_config({.dim = 256,
                                       .hidden_dim = 400,
                                       .n_layers = 1,
                                       .n_heads = 8,
                                       .n_kv_heads = 2,
                                       .vocab_size = 1000,
                                       .seq_len = 48});
  const Weights<float> w = random_weights<float>(cfg, 9);
  const Model<float, bf16> bf(convert_weights<bf16>(w));  // with panels re-laid once
  ASSERT_GT(bf.amx_panel_bytes(), 0u);
  const Model<float, bf16> per_call = [&] {  // built with AMX off: panels re-laid per call
    const ForcedAmx off(false);
    return Model<float, bf16>(convert_weights<bf16>(w));
  }();
  ASSERT_EQ(per_call.amx_panel_bytes(), 0u);
  const auto tokens = random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 7);
  const std::vector<double> ref = double_forward(widen_weights(w, true), tokens, true);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  // Chunks of 48 (three token tiles), 20 (a tail of 4 rows) and 17 (every chunk past
  // kMaxFewTokens): all on AMX.
  for (const std::size_t chunk : {std::size_t{48}, std::size_t{20}, std::size_t{17}})
    for (const std::size_t threads : {std::size_t{1}, std::size_t{2}})
      for (const Model<float, bf16>* model : {&bf, &per_call}) {
        ThreadPool pool(threads);
        ContiguousStore<float> cache(cfg);
        Activations<float> act(cfg, {.max_chunk = chunk, .thread_pool = &pool});
        std::vector<float> all(tokens.size() * vocab);
        model->prefill(tokens, cache, act, std::span<float>(all));
        std::vector<double> errors;
        for (std::size_t p = 0; p < tokens.size(); ++p) {
          double worst = 0;
          for (std::size_t i = 0; i < vocab; ++i) {
            const double r = ref[p * vocab + i];
            const double d =
                std::abs(static_cast<double>(all[p * vocab + i]) - r) / (1 + std::abs(r));
            worst = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(worst, d);
          }
          errors.push_back(worst);
        }
        std::sort(errors.begin(), errors.end());
        const std::string what = "chunks of " + std::to_string(chunk) + ", " +
                                 std::to_string(threads) + " threads, panels " +
                                 (model == &bf ? "re-laid once" : "re-laid per call");
        EXPECT_LE(errors[errors.size() * 3 / 4], kBf16RuleTolerance) << what << ": 75th percentile";
        EXPECT_LE(errors.back(), kBf16FlipTolerance) << what << ": worst position";
      }
}

}  // namespace
}  // namespace kvdecode::testing_util
