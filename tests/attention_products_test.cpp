// Attention's own products (detail/attention_products.hpp), which a build whose Eigen is
// narrower than the CPU runs instead of Eigen's GEMM. This file is compiled without AVX
// (tests/CMakeLists.txt), so its Eigen is SSE2 and every x86 set the CPU has takes the kernels:
// the kernels against sums in double with the f32 bound derived below, then the model (one
// chunk, several chunks, decode; contiguous and fragmented paged stores) against the no-cache
// reference under each set.
#include "kvdecode/detail/attention_products.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

constexpr double kEps = 0x1p-24;  // f32 unit roundoff

class AttentionProductsTest : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << kernel_set_name(GetParam()) << " kernels";
  }
};

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// A sum of m f32 products in any order is within γ_m = m·u/(1 − m·u) of Σ|terms| (Higham 3.1),
// plus one rounding of the product by scale; padded strides show that nothing past hs or cols
// is read or written.
TEST_P(AttentionProductsTest, ScoresAreDotProductsOfQueriesAndKeys) {
  for (const std::size_t hs : {1, 7, 8, 15, 16, 17, 48, 64, 65, 128}) {
    for (const std::size_t n : {1, 3, 5, 6, 7, 13}) {
      for (const std::size_t cols : {1, 15, 16, 17, 31, 32, 33, 100, 256}) {
        const std::size_t q_stride = hs + 3;
        const std::size_t ld = 256 + 5;
        const std::size_t s_stride = cols + 2;
        const std::vector<float> q = random_floats(n * q_stride, 7);
        const std::vector<float> kt = random_floats(hs * ld, 8);
        std::vector<float> s(n * s_stride, 42.0f);
        const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
        detail::attention_scores(GetParam(), s.data(), s_stride, q.data(), q_stride, kt.data(), ld,
                                 n, cols, hs, scale);
        const double gamma =
            static_cast<double>(hs) * kEps / (1.0 - static_cast<double>(hs) * kEps);
        for (std::size_t r = 0; r < n; ++r) {
          for (std::size_t c = 0; c < cols; ++c) {
            double exact = 0.0;
            double magnitude = 0.0;
            for (std::size_t d = 0; d < hs; ++d) {
              const double term = static_cast<double>(q[r * q_stride + d]) * kt[d * ld + c];
              exact += term;
              magnitude += std::abs(term);
            }
            const double want = exact * scale;
            const double bound = (gamma * magnitude + kEps * std::abs(exact)) * scale * (1 + kEps);
            ASSERT_LE(std::abs(s[r * s_stride + c] - want), bound)
                << kernel_set_name(GetParam()) << " hs " << hs << " n " << n << " cols " << cols
                << " at (" << r << ", " << c << ")";
          }
          for (std::size_t c = cols; c < s_stride; ++c) ASSERT_EQ(s[r * s_stride + c], 42.0f);
        }
      }
    }
  }
}

// The key tile's transpose: kt[d][col + c] = keys[c][d] exactly for every set, runs placed one
// after another as attention places them (so a run ending mid-block meets the next run's
// columns), and nothing outside the runs' columns written (a padded stride and ld show it).
TEST_P(AttentionProductsTest, PackKeysTransposesRunsExactly) {
  for (const std::size_t hs : {1, 7, 8, 15, 16, 17, 48, 64, 65}) {
    for (const std::vector<std::size_t>& runs :
         {std::vector<std::size_t>{1}, {16}, {17}, {5, 9, 30}, {100, 156}, {256}}) {
      const std::size_t stride = hs + 3;
      const std::size_t ld = 256;
      std::size_t total = 0;
      for (const std::size_t r : runs) total += r;
      const std::vector<float> keys = random_floats(total * stride, 9);  // [total][stride]
      std::vector<float> kt((hs + 1) * ld, 42.0f);  // [hs + 1][ld]: one spare row
      std::size_t col = 0;
      for (const std::size_t r : runs) {
        detail::pack_keys(GetParam(), kt.data(), ld, col, keys.data() + col * stride, stride, r,
                          hs);
        col += r;
      }
      for (std::size_t d = 0; d <= hs; ++d)
        for (std::size_t c = 0; c < ld; ++c) {
          const float want = d < hs && c < total ? keys[c * stride + d] : 42.0f;
          ASSERT_EQ(kt[d * ld + c], want) << kernel_set_name(GetParam()) << " hs " << hs << " runs "
                                          << runs.size() << " at (" << d << ", " << c << ")";
        }
    }
  }
}

// o += p·v: each output adds rows products to its old value, m = rows + 1 terms.
TEST_P(AttentionProductsTest, PvAccumulatesProbabilityWeightedValues) {
  for (const std::size_t hs : {1, 7, 8, 15, 16, 17, 33, 48, 64, 65, 100, 128}) {
    for (const std::size_t n : {1, 2, 3, 4, 5, 9}) {
      for (const std::size_t rows : {1, 2, 16, 17, 64, 256}) {
        const std::size_t o_stride = hs + 5;
        const std::size_t p_stride = rows + 1;
        const std::size_t v_stride = hs + 2;
        const std::vector<float> p = random_floats(n * p_stride, 9);
        const std::vector<float> v = random_floats(rows * v_stride, 10);
        std::vector<float> o = random_floats(n * o_stride, 11);
        const std::vector<float> before = o;
        detail::attention_pv(GetParam(), o.data(), o_stride, p.data(), p_stride, v.data(), v_stride,
                             n, rows, hs);
        const double m = static_cast<double>(rows + 1);
        const double gamma = m * kEps / (1.0 - m * kEps);
        for (std::size_t r = 0; r < n; ++r) {
          for (std::size_t d = 0; d < hs; ++d) {
            double exact = before[r * o_stride + d];
            double magnitude = std::abs(exact);
            for (std::size_t c = 0; c < rows; ++c) {
              const double term = static_cast<double>(p[r * p_stride + c]) * v[c * v_stride + d];
              exact += term;
              magnitude += std::abs(term);
            }
            ASSERT_LE(std::abs(o[r * o_stride + d] - exact), gamma * magnitude)
                << kernel_set_name(GetParam()) << " hs " << hs << " n " << n << " rows " << rows
                << " at (" << r << ", " << d << ")";
          }
          for (std::size_t d = hs; d < o_stride; ++d)
            ASSERT_EQ(o[r * o_stride + d], before[r * o_stride + d]);
        }
      }
    }
  }
}

/// Odd sizes so every tail runs: head size 18, GQA 4/2.
ModelConfig odd_config() {
  ModelConfig c;
  c.dim = 72;
  c.hidden_dim = 100;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 61;
  c.seq_len = 300;
  c.shared_classifier = false;
  return c;
}

/// The f32 bound the other cached-vs-reference tests measured over 30 positions, grown with the
/// position as the worst-case error of a sum grows with its number of terms (γ_n ∝ n): attention
/// at position p sums p + 1 keys.
double f32_bound(double ref, std::size_t position) {
  return 1e-5 * (1.0 + std::abs(ref)) * std::max(1.0, static_cast<double>(position + 1) / 30.0);
}

/// The no-cache reference, in double, on the model's own (f32) weights.
std::vector<double> reference(const Weights<float>& w, const Tokens& tokens) {
  return forward_reference(convert_weights<double>(w), std::span<const std::int32_t>(tokens));
}

void expect_matches_reference(const std::vector<float>& got, const std::vector<double>& ref,
                              std::size_t vocab, const char* what) {
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(static_cast<double>(got[i]) - ref[i]), f32_bound(ref[i], i / vocab))
        << what << ": position " << i / vocab << " logit " << i % vocab;
}

// 270 tokens (more than one 256-key tile): 200 in one chunk, 60 in chunks of 16, 10 decode
// steps, on a contiguous store; and two sequences on one pool of 4-position blocks, prefilled
// chunk by chunk in turn so their blocks interleave, then decoded.
TEST_P(AttentionProductsTest, ModelMatchesReferenceOnContiguousAndFragmentedStores) {
  const ForcedKernelSet forced(GetParam());
  if (GetParam() != KernelSet::kPortable) {
    ASSERT_TRUE(detail::attention_uses_kernels<float>(GetParam()))
        << "this file must be compiled without AVX for the kernels to run";
  }
  const ModelConfig cfg = odd_config();
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const Weights<float> weights = random_weights<float>(cfg, 41);
  const Model<float> model(convert_weights<float>(weights));
  const Tokens tokens = random_tokens(270, cfg.vocab_size, 6);
  const std::vector<double> ref = reference(weights, tokens);

  ContiguousStore<float> cache(cfg);
  std::vector<float> got(tokens.size() * vocab);
  Activations<float> big(cfg, {.max_chunk = 200});
  model.prefill(std::span(tokens).first(200), cache, big, std::span(got).first(200 * vocab));
  Activations<float> act(cfg, {.max_chunk = 16});
  for (std::size_t p = 200; p < 260; p += 16) {
    const std::size_t n = std::min<std::size_t>(16, 260 - p);
    model.prefill(std::span(tokens).subspan(p, n), cache, act,
                  std::span(got).subspan(p * vocab, n * vocab));
  }
  for (std::size_t p = 260; p < tokens.size(); ++p) {
    const auto logits = model.decode(tokens[p], cache, act);
    std::copy(logits.begin(), logits.end(), got.begin() + static_cast<std::ptrdiff_t>(p * vocab));
  }
  expect_matches_reference(got, ref, vocab, "contiguous");

  const Tokens other = random_tokens(tokens.size(), cfg.vocab_size, 7);
  const std::vector<double> other_ref = reference(weights, other);
  BlockPool<float> pool(cfg, 2 * 270 / 4 + 2, 4, BlockPoolOptions{0, false});
  PagedStore<float> a(pool);
  PagedStore<float> b(pool);
  std::vector<float> got_a(tokens.size() * vocab);
  std::vector<float> got_b(tokens.size() * vocab);
  for (std::size_t p = 0; p < 260; p += 13) {
    model.prefill(std::span(tokens).subspan(p, 13), a, act,
                  std::span(got_a).subspan(p * vocab, 13 * vocab));
    model.prefill(std::span(other).subspan(p, 13), b, act,
                  std::span(got_b).subspan(p * vocab, 13 * vocab));
  }
  for (std::size_t p = 260; p < tokens.size(); ++p) {
    const auto la = model.decode(tokens[p], a, act);
    std::copy(la.begin(), la.end(), got_a.begin() + static_cast<std::ptrdiff_t>(p * vocab));
    const auto lb = model.decode(other[p], b, act);
    std::copy(lb.begin(), lb.end(), got_b.begin() + static_cast<std::ptrdiff_t>(p * vocab));
  }
  expect_matches_reference(got_a, ref, vocab, "paged a");
  expect_matches_reference(got_b, other_ref, vocab, "paged b");
}

INSTANTIATE_TEST_SUITE_P(EverySet, AttentionProductsTest, ::testing::ValuesIn(kKernelSets),
                         [](const ::testing::TestParamInfo<KernelSet>& set) {
                           return std::string(kernel_set_name(set.param));
                         });

}  // namespace
}  // namespace kvdecode::testing_util
