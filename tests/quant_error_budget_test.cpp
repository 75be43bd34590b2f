// The quantized stores' error budget (docs/QUANTIZATION.md), measured against the f32 cache:
// the attention-output bound derived from the quantization step, checked on real K/V; and on
// the trained KJV model, the llama2c fixture and random GQA/MQA models of head size 16, 48 and
// 64, KL of the next-token distribution (mean, max) and top-1 agreement over a 150-token greedy
// continuation, teacher-forced, against the budget of docs/QUANTIZATION.md §3.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/store/int8_store.hpp"
#include "kvdecode/store/memory_planner.hpp"
#include "kvdecode/store/q4_store.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

const std::filesystem::path kFixture =
    std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny" / "model.bin";
constexpr std::size_t kGroup = 32;  // KIVI's key group

/// The error bound of every element of one (layer, kv head): [T][head_size] for keys and values.
struct ElementBounds {
  std::vector<double> key, value;
};

// 8-bit: every element of a row within half its step over the row's [min, max] (255 steps).
// 4-bit: keys within half the step over the channel's range in its group, values over the
// row's range (15 steps); the open group (positions past the last full group) exact.
ElementBounds int8_bounds(const ContiguousStore<float>& c, std::size_t l, std::size_t h,
                          std::size_t n) {
  const std::size_t hs = c.head_size();
  ElementBounds b{std::vector<double>(n * hs), std::vector<double>(n * hs)};
  for (std::size_t p = 0; p < n; ++p) {
    double klo = 1e30, khi = -1e30, vlo = 1e30, vhi = -1e30;
    for (std::size_t i = 0; i < hs; ++i) {
      klo = std::min(klo, double{c.key(l, h, p)[i]});
      khi = std::max(khi, double{c.key(l, h, p)[i]});
      vlo = std::min(vlo, double{c.value(l, h, p)[i]});
      vhi = std::max(vhi, double{c.value(l, h, p)[i]});
    }
    for (std::size_t i = 0; i < hs; ++i) {
      b.key[p * hs + i] = range_half_step(klo, khi, 255);
      b.value[p * hs + i] = range_half_step(vlo, vhi, 255);
    }
  }
  return b;
}

double q4_half_step(double lo, double hi) { return range_half_step(lo, hi, 15); }
ElementBounds q4_bounds(const ContiguousStore<float>& c, std::size_t l, std::size_t h,
                        std::size_t n) {
  const std::size_t hs = c.head_size();
  ElementBounds b{std::vector<double>(n * hs, 0.0), std::vector<double>(n * hs, 0.0)};
  for (std::size_t g0 = 0; g0 + kGroup <= n; g0 += kGroup) {
    for (std::size_t i = 0; i < hs; ++i) {
      double lo = 1e30, hi = -1e30;
      for (std::size_t p = g0; p < g0 + kGroup; ++p) {
        lo = std::min(lo, double{c.key(l, h, p)[i]});
        hi = std::max(hi, double{c.key(l, h, p)[i]});
      }
      const double e = q4_half_step(lo, hi);
      for (std::size_t p = g0; p < g0 + kGroup; ++p) b.key[p * hs + i] = e;
    }
    for (std::size_t p = g0; p < g0 + kGroup; ++p) {
      double lo = 1e30, hi = -1e30;
      for (std::size_t i = 0; i < hs; ++i) {
        lo = std::min(lo, double{c.value(l, h, p)[i]});
        hi = std::max(hi, double{c.value(l, h, p)[i]});
      }
      for (std::size_t i = 0; i < hs; ++i) b.value[p * hs + i] = q4_half_step(lo, hi);
    }
  }
  return b;
}

/// Copies the first n positions of c into s, one append.
template <class S>
void copy_rows(const ContiguousStore<float>& c, std::size_t n, S& s) {
  const std::size_t hs = c.head_size(), kv_dim = c.n_kv_heads() * hs;
  s.begin_append(std::vector<std::int32_t>(n, 0));
  std::vector<float> k(kv_dim), v(kv_dim);  // [kv_dim]
  for (std::size_t l = 0; l < c.n_layers(); ++l)
    for (std::size_t p = 0; p < n; ++p) {
      for (std::size_t h = 0; h < c.n_kv_heads(); ++h) {
        std::copy_n(c.key(l, h, p).data(), hs, k.data() + h * hs);
        std::copy_n(c.value(l, h, p).data(), hs, v.data() + h * hs);
      }
      s.write(l, p, k.data(), v.data());
    }
  s.commit_append();
}

// Derived bound (docs/QUANTIZATION.md §2): with key errors e_k and value errors e_v per
// element, each score of query head h moves by at most δ = max_t Σ_i |q_i| e_k(t, i) / √hs, so
// every softmax weight by a factor within e^{±2δ} and Σ_t |p̂_t - p_t| ≤ e^{2δ} - 1. As Σ_t (p̂_t -
// p_t) = 0, output channel i moves by at most (e^{2δ} - 1) · (max_t v_ti - min_t v_ti) / 2 +
// max_t e_v(t, i). The avx512bf16 set's integer products (§1) add, with steps ≤ 2 e:
// - 4-bit keys: the folded query q ⊙ kstep is rounded to int8, so each of a score's hs terms
//   moves by at most max_i |q_i kstep_i| / 254 times a code ≤ 15 more;
// - 8-bit keys: q is rounded to 15 bits, each term by at most max_i |q_i| / 32766 · kstep times
//   a code ≤ 255;
// - p·v: a tile's weights p · vstep are rounded to 15 bits, which moves the output by at most
//   max vstep · the largest code · the tile's rows / 32766.
struct VnniRounding {
  unsigned key_bits = 0;  // 4 or 8: the scores round the query so; 0: f32 scores
  double code_max = 0;    // the values' largest code where p·v rounds its weights, else 0
  std::size_t tile = 0;   // rows of a tile whose weights are rounded together
};

template <class S>
void expect_attention_within_bound(const char* name,
                                   ElementBounds (*bounds)(const ContiguousStore<float>&,
                                                           std::size_t, std::size_t, std::size_t),
                                   VnniRounding vnni = {}) {
  const Model<float> model(load_checkpoint(kFixture));
  const ModelConfig cfg = model.config();
  const std::size_t n_ctx = 120, hs = static_cast<std::size_t>(cfg.head_size());
  const auto dim = static_cast<std::size_t>(cfg.dim);
  ContiguousStore<float> c(cfg, n_ctx);
  Activations<float> act(cfg, {.max_chunk = 16});
  model.prefill(random_tokens(n_ctx, cfg.vocab_size, 11), c, act);
  S s(cfg, n_ctx);
  copy_rows(c, n_ctx, s);

  detail::SplitMix64 rng(12);
  double worst_ratio = 0;
  for (const std::size_t nq : {std::size_t{1}, std::size_t{5}}) {
    const std::size_t q_first = n_ctx - nq;
    std::vector<float> q(nq * dim), out_f(nq * dim), out_q(nq * dim);  // [nq][dim]
    for (auto& x : q) x = static_cast<float>(2.0 * rng.symmetric());
    AttentionScratch<float> sf(cfg, nq, 0), sq(cfg, nq, s.block_scratch_size());
    for (std::size_t l = 0; l < c.n_layers(); ++l) {
      attend(cfg, c, l, q_first, nq, q.data(), out_f.data(), sf);
      attend(cfg, s, l, q_first, nq, q.data(), out_q.data(), sq);
      for (std::size_t h = 0; h < static_cast<std::size_t>(cfg.n_heads); ++h) {
        const std::size_t g = h / static_cast<std::size_t>(cfg.kv_mul());
        const ElementBounds e = bounds(c, l, g, n_ctx);
        for (std::size_t r = 0; r < nq; ++r) {
          const std::size_t visible = q_first + r + 1;
          const float* qh = q.data() + r * dim + h * hs;
          double delta = 0;
          for (std::size_t t = 0; t < visible; ++t) {
            double d = 0, top = 0, qtop = 0, step = 0;
            for (std::size_t i = 0; i < hs; ++i) {
              d += std::abs(double{qh[i]}) * e.key[t * hs + i];
              top = std::max(top, std::abs(double{qh[i]}) * 2 * e.key[t * hs + i]);
              qtop = std::max(qtop, std::abs(double{qh[i]}));
              step = std::max(step, 2 * e.key[t * hs + i]);
            }
            if (vnni.key_bits == 4) d += top / 254 * 15 * static_cast<double>(hs);
            if (vnni.key_bits == 8) d += qtop / 32766 * step * 255 * static_cast<double>(hs);
            delta = std::max(delta, d / std::sqrt(static_cast<double>(hs)));
          }
          for (std::size_t i = 0; i < hs; ++i) {
            double lo = 1e30, hi = -1e30, ev = 0;
            for (std::size_t t = 0; t < visible; ++t) {
              lo = std::min(lo, double{c.value(l, g, t)[i]});
              hi = std::max(hi, double{c.value(l, g, t)[i]});
              ev = std::max(ev, e.value[t * hs + i]);
            }
            // f32 arithmetic of the two attention runs: 1e-5 relative to the value range.
            const double pv = 2 * ev * vnni.code_max * static_cast<double>(vnni.tile) / 32766;
            const double bound = std::expm1(2 * delta) * (hi - lo) / 2 + ev + pv +
                                 1e-5 * (1 + std::abs(lo) + std::abs(hi));
            const double err =
                std::abs(double{out_q[r * dim + h * hs + i]} - double{out_f[r * dim + h * hs + i]});
            ASSERT_LE(err, bound) << name << " layer " << l << " head " << h << " query " << r
                                  << " channel " << i << " δ " << delta;
            worst_ratio = std::max(worst_ratio, err / bound);
          }
        }
      }
    }
  }
  std::printf("[budget] %s attention: worst error / derived bound = %.3f\n", name, worst_ratio);
}

TEST(QuantErrorBudgetTest, Int8AttentionOutputWithinTheDerivedBound) {
  const bool vnni = active_kernel_set() == KernelSet::kAvx512Bf16;
  expect_attention_within_bound<Int8Store<float>>(
      "int8", int8_bounds,
      vnni ? VnniRounding{8, 255, Int8Store<float>::kBlockRows} : VnniRounding{});
}

// No residual window and no rotation: the bound above is per element of unrotated rows.
struct Q4Group32 : Q4Store<float> {
  Q4Group32(const ModelConfig& cfg, std::size_t capacity)
      : Q4Store<float>(cfg, capacity, kGroup, /*residual=*/0, /*rotate=*/false) {}
};

TEST(QuantErrorBudgetTest, Q4AttentionOutputWithinTheDerivedBound) {
  const bool vnni = active_kernel_set() == KernelSet::kAvx512Bf16;
  expect_attention_within_bound<Q4Group32>("q4", q4_bounds,
                                           vnni ? VnniRounding{4, 15, kGroup} : VnniRounding{});
}

// --- Logits ---------------------------------------------------------------------------------

std::vector<double> softmax(std::span<const float> x) {
  const double m = *std::max_element(x.begin(), x.end());
  std::vector<double> p(x.size());
  double sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) sum += p[i] = std::exp(double{x[i]} - m);
  for (auto& v : p) v /= sum;
  return p;
}
std::size_t argmax(std::span<const float> x) {
  return static_cast<std::size_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

/// A model of the fixed set, the prefix its measurement starts from and how many greedy
/// positions follow it.
struct Case {
  std::string name;
  Model<float> model;
  std::vector<std::int32_t> prefix;
  std::size_t n_gen;
  bool trained;  // the KJV model: the tighter budget
};

/// The f32 greedy continuation: its tokens [n_gen] and the logits [n_gen][vocab] that chose
/// them (the first from the prefix's prefill).
struct Reference {
  std::vector<std::int32_t> tokens;
  std::vector<float> logits;
};

template <class S>
std::vector<float> run(const Model<float>& m, S& s, const std::vector<std::int32_t>& prefix,
                       const std::vector<std::int32_t>& feed, std::vector<std::int32_t>* chosen) {
  Activations<float> act(m.config(), {.max_chunk = 16, .store_scratch = s.block_scratch_size()});
  const std::size_t vocab = static_cast<std::size_t>(m.config().vocab_size);
  std::vector<float> out;
  auto l = m.prefill(prefix, s, act);
  for (std::size_t i = 0; i < feed.size(); ++i) {
    out.insert(out.end(), l.begin(), l.begin() + static_cast<std::ptrdiff_t>(vocab));
    const std::int32_t next = chosen ? static_cast<std::int32_t>(argmax(l)) : feed[i];
    if (chosen) chosen->push_back(next);
    if (i + 1 < feed.size()) l = m.decode(next, s, act);
  }
  return out;
}

struct Metrics {
  double kl_mean = 0, kl_max = 0, top1 = 0;
  double per_position = 0;  // bytes per position / f32's, asymptotically
  double at_seq_len = 0;    // memory_bytes() at seq_len / f32's
};

/// The quantized cache teacher-forced on the f32 continuation: KL(p_f32 ‖ p_quant) and top-1
/// agreement at each of its positions, and the store's bytes against f32's.
template <class S>
Metrics measure(const Case& c, const Reference& ref, const typename S::Options& o,
                const char* setting) {
  const ModelConfig& cfg = c.model.config();
  const std::size_t vocab = static_cast<std::size_t>(cfg.vocab_size);
  S s(cfg, o);
  const auto logits = run(c.model, s, c.prefix, ref.tokens, nullptr);
  Metrics r;
  for (std::size_t i = 0; i < ref.tokens.size(); ++i) {
    const std::span<const float> a(ref.logits.data() + i * vocab, vocab);
    const std::span<const float> b(logits.data() + i * vocab, vocab);
    const auto p = softmax(a), pq = softmax(b);
    double kl = 0;
    for (std::size_t v = 0; v < vocab; ++v)
      if (p[v] > 0) kl += p[v] * (std::log(p[v]) - std::log(pq[v]));
    r.kl_mean += kl / static_cast<double>(ref.tokens.size());
    r.kl_max = std::max(r.kl_max, kl);
    r.top1 += argmax(a) == argmax(b) ? 1.0 / static_cast<double>(ref.tokens.size()) : 0.0;
  }
  const MemoryPlanner<ContiguousStore<float>> f32(cfg);
  const MemoryPlanner<S> q(cfg, o);
  const auto seq_len = static_cast<std::uint64_t>(cfg.seq_len);
  r.per_position = q.bytes_per_position() / f32.bytes_per_position();
  r.at_seq_len =
      static_cast<double>(q.kv_bytes(seq_len)) / static_cast<double>(f32.kv_bytes(seq_len));
  std::printf("[budget] | %s | %s | %.2e | %.2e | %.3f | %.1f %% | %.1f %% |\n", c.name.c_str(),
              setting, r.kl_mean, r.kl_max, r.top1, 100 * r.per_position, 100 * r.at_seq_len);
  return r;
}

ModelConfig shape(std::int64_t dim, std::int64_t heads, std::int64_t kv, std::int64_t layers,
                  RopeStyle style) {
  ModelConfig c = testing_util::test_config({.dim = dim,
                                             .hidden_dim = 2 * dim,
                                             .n_layers = layers,
                                             .n_heads = heads,
                                             .n_kv_heads = kv,
                                             .vocab_size = 256,
                                             .seq_len = 512});
  c.rope_style = style;
  return c;
}

std::filesystem::path models_dir() {
  return std::filesystem::path(KVDECODE_TEST_DATA_DIR) / ".." / ".." / "models";
}

/// The fixed model set: the trained KJV model on held-out scripture, the llama2c fixture, and
/// random GQA/MQA models of head size 16, 48 and 64. Each measures 150 greedy positions after
/// a prefix of 256 tokens (the fixture, of seq_len 128, 64 after 64), so most of the context
/// is older than the default residual window.
std::vector<Case> model_set() {
  std::vector<Case> cases;
  {
    Model<float> kjv(load_checkpoint(models_dir() / "kjv_tiny.bin"));
    const Tokenizer tok = Tokenizer::load(models_dir() / "tokenizer.bin", kjv.config().vocab_size);
    auto ids = tok.encode(
        read_text(std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "oracle" / "encode_text.txt"),
        true, false);
    ids.resize(256);
    cases.push_back({"kjv_tiny (hs 32, 6/2 heads, 4 layers)", std::move(kjv), ids, 150, true});
  }
  cases.push_back({"llama2c-tiny (hs 16, 4/2, 2)", Model<float>(load_checkpoint(kFixture)),
                   random_tokens(64, 512, 31), 64, false});
  const auto random_case = [&](const char* name, const ModelConfig& cfg, std::uint64_t seed) {
    cases.push_back({name, Model<float>(random_weights<float>(cfg, seed)),
                     random_tokens(256, cfg.vocab_size, 31), 150, false});
  };
  random_case("random hs16 gqa (8/2, 2)", shape(128, 8, 2, 2, RopeStyle::kAdjacentPairs), 24);
  random_case("random hs48 gqa (4/2, 2)", shape(192, 4, 2, 2, RopeStyle::kHalfSplit), 25);
  random_case("random hs64 mqa (2/1, 3)", shape(128, 2, 1, 3, RopeStyle::kHalfSplit), 22);
  random_case("random hs64 gqa (4/2, 2)", shape(256, 4, 2, 2, RopeStyle::kAdjacentPairs), 23);
  return cases;
}

// The budget (docs/QUANTIZATION.md §3), for the stores as built by default.
constexpr double kInt8KlMean = 1e-3;
constexpr double kQ4KlMean = 3e-2, kQ4KlMeanTrained = 1e-2, kQ4Top1Trained = 0.95;

/// Models measured over a budget, listed in docs/QUANTIZATION.md §3 as open: the test expects
/// them to stay over it and fails once one comes within it (the list is then out of date).
/// The budget itself is not moved for them.
struct Open {
  std::string_view model, store;
};
constexpr std::array<Open, 4> kOpen = {{{"random hs16 gqa (8/2, 2)", "q4"},
                                        {"random hs48 gqa (4/2, 2)", "q4"},
                                        {"random hs64 mqa (2/1, 3)", "q4"},
                                        {"random hs64 gqa (4/2, 2)", "q4"}}};

void expect_within(const std::string& model, std::string_view store, double kl_mean,
                   double budget) {
  const bool open = std::any_of(kOpen.begin(), kOpen.end(), [&](const Open& o) {
    return o.model == model && o.store == store;
  });
  if (open) {
    std::printf("[budget] OVER BUDGET (open): %s %.*s KL mean %.2e > %.0e\n", model.c_str(),
                static_cast<int>(store.size()), store.data(), kl_mean, budget);
    EXPECT_GT(kl_mean, budget) << model << " " << store << " is within budget now: update kOpen";
  } else {
    EXPECT_LE(kl_mean, budget) << model << " " << store;
  }
}

TEST(QuantErrorBudgetTest, LogitBudgetOverTheModelSet) {
  std::printf("[budget] | model | setting | KL mean | KL max | top-1 | bytes/pos | at seq_len |\n");
  for (const Case& c : model_set()) {
    const ModelConfig& cfg = c.model.config();
    Reference ref;
    {
      ContiguousStore<float> f32(cfg);
      ref.logits = run(c.model, f32, c.prefix, std::vector<std::int32_t>(c.n_gen), &ref.tokens);
    }
    const Metrics i8 = measure<Int8Store<float>>(c, ref, {}, "int8");
    expect_within(c.name, "int8", i8.kl_mean, kInt8KlMean);
    // The default 4-bit store (G 64, R 128, not rotated): the budget.
    const Metrics q4 = measure<Q4Store<float>>(c, ref, {}, "q4 G64 R128 -");
    expect_within(c.name, "q4", q4.kl_mean, kQ4KlMean);
    if (c.trained) {
      EXPECT_LE(q4.kl_mean, kQ4KlMeanTrained) << c.name;
      EXPECT_GE(q4.top1, kQ4Top1Trained) << c.name;
    }
    // The other settings, reported (docs/QUANTIZATION.md §3 tabulates them).
    measure<Q4Store<float>>(c, ref, {.rotate = true}, "q4 G64 R128 rot");
    measure<Q4Store<float>>(c, ref, {.group = 32, .residual = 128}, "q4 G32 R128 -");
    measure<Q4Store<float>>(c, ref, {.group = 128, .residual = 128}, "q4 G128 R128 -");
    measure<Q4Store<float>>(c, ref, {.residual = 0}, "q4 G64 R0 -");
    measure<Q4Store<float>>(c, ref, {.residual = 0, .rotate = true}, "q4 G64 R0 rot");
    measure<Q4Store<float>>(c, ref, {.residual = 256}, "q4 G64 R256 -");
    measure<Q2Store<float>>(c, ref, {}, "q2 G64 R128 -");
    measure<Q2Store<float>>(c, ref, {.rotate = true}, "q2 G64 R128 rot");
    measure<Q2Store<float>>(c, ref, {.group = 32, .residual = 128, .rotate = true},
                            "q2 G32 R128 rot");
  }
}

}  // namespace
}  // namespace kvdecode::testing_util
