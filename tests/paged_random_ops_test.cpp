// Random sequences of operations on one BlockPool — append (prefill or decode), fork, truncate,
// release, and new requests sharing a prefix with an earlier one — checked after every step:
// every live sequence's logits against a no-cache recompute of its tokens, and the pool's
// accounting (reference counts = block-table holders, free list, cached blocks) exact. Pools are
// small, so exhaustion happens, and must leave every sequence intact. Seeded; a failure prints
// its seed, block size and step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvdecode/store/block_pool.hpp"
#include "kvdecode/store/paged_store.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

template <class T>
struct Live {
  PagedStore<T> seq;
  Tokens tokens;  // what the sequence must hold
};

template <class T>
class RandomOps {
 public:
  RandomOps(std::uint64_t seed, std::size_t block_size, std::size_t n_blocks)
      : cfg_(small_config(4, 2, kMaxLen)),
        model_(random_weights<T>(cfg_, seed)),
        pool_(cfg_, n_blocks, block_size),
        act_(cfg_, {.max_chunk = 8}),
        rng_(seed) {}

  void run(std::size_t steps) {
    for (step_ = 0; step_ < steps; ++step_) {
      SCOPED_TRACE("step " + std::to_string(step_));
      one_op();
      if (::testing::Test::HasFatalFailure()) return;
      check_all();
      if (::testing::Test::HasFatalFailure()) return;
    }
    // Releasing everything leaks nothing: every block is free or cached, none held.
    live_.clear();
    ASSERT_EQ(pool_.n_held(), 0u);
    ASSERT_EQ(pool_.n_free() + pool_.n_evictable(), pool_.n_blocks());
    check_accounting();
    ASSERT_GT(ops_failed_, 0u) << "no operation hit an exhausted pool: the pool is too large";
    std::printf("  %zu steps: %zu fork probes checked, %zu refused by an exhausted pool\n", steps,
                probes_checked_, probes_refused_);
    // The probes are where shared and copied blocks meet the reference, so enough of them must
    // reach it. Three steps in ten add a sequence and three extend one, so live sequences are
    // several at most steps and each is probed every step; only an exhausted pool refuses a
    // probe, and a release (one step in ten) or an eviction makes room again. Measured on
    // these seeds: 1.2 to 21 checked probes per step; the floor is one per four steps.
    ASSERT_GE(probes_checked_, steps / 4) << "fork probes mostly refused: the checks did not run";
    ASSERT_GT(pool_.stats().hits, 0u) << "no request hit the prefix cache";
  }

 private:
  static constexpr std::int64_t kMaxLen = 96;
  static constexpr double kTol = std::is_same_v<T, float> ? 1e-5 : 1e-12;

  std::size_t uniform(std::size_t n) { return static_cast<std::size_t>(rng_.next() % n); }
  Tokens random_suffix(std::size_t n) {
    Tokens t(n);
    for (auto& id : t)
      id = static_cast<std::int32_t>(uniform(static_cast<std::size_t>(cfg_.vocab_size)));
    return t;
  }

  /// Runs `more` on live sequence i (prefill then a decode of the last token, or one decode),
  /// checks the logits, or on an exhausted pool checks that nothing changed.
  void append(Live<T>& s, const Tokens& more) {
    const Snapshot before = snapshot();
    try {
      const std::span<const std::int32_t> m(more);
      if (m.size() > 1) model_.prefill(m.first(m.size() - 1), s.seq, act_);
      const auto logits = model_.decode(m.back(), s.seq, act_);
      Tokens all = s.tokens;
      all.insert(all.end(), more.begin(), more.end());
      expect_logits(logits, all);
      s.tokens = std::move(all);
    } catch (const Error& e) {
      // The prefill may have succeeded and the decode failed: only the failing call must change
      // nothing, so compare with the state after the part that went through.
      ++ops_failed_;
      ASSERT_NE(std::string(e.what()).find("but the pool has"), std::string::npos) << e.what();
      s.tokens.assign(s.seq.tokens().begin(), s.seq.tokens().end());
      if (s.seq.size() == before.sizes[index_of(s)]) expect_unchanged(before);
    }
  }

  void one_op() {
    const std::size_t kind = live_.empty() ? 0 : uniform(10);
    if (kind <= 2) {  // a new request, often sharing a prefix with an earlier one
      Tokens prompt;
      if (!history_.empty() && uniform(4) != 0) {
        const Tokens& h = history_[uniform(history_.size())];
        prompt.assign(h.begin(), h.begin() + static_cast<std::ptrdiff_t>(uniform(h.size() + 1)));
      }
      const std::size_t room = kMaxLen - prompt.size();
      if (room == 0) prompt.pop_back();
      for (const auto t :
           random_suffix(1 + uniform(std::min<std::size_t>(12, std::max<std::size_t>(room, 1)))))
        if (prompt.size() < kMaxLen) prompt.push_back(t);
      auto s = std::make_unique<Live<T>>(Live<T>{PagedStore<T>::open(pool_, prompt), {}});
      s->tokens.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(s->seq.size()));
      ASSERT_EQ(Tokens(s->seq.tokens().begin(), s->seq.tokens().end()), s->tokens);
      live_.push_back(std::move(s));
      append(*live_.back(),
             Tokens(prompt.begin() + static_cast<std::ptrdiff_t>(live_.back()->seq.size()),
                    prompt.end()));
      remember(live_.back()->tokens);
    } else if (kind <= 5) {  // extend a sequence: a decode step, or a new turn
      Live<T>& s = *live_[uniform(live_.size())];
      const std::size_t room = kMaxLen - s.tokens.size();
      if (room == 0) return;
      append(s,
             random_suffix(1 + (uniform(2) == 0 ? 0 : uniform(std::min<std::size_t>(room, 10)))));
      remember(s.tokens);
    } else if (kind == 6) {  // fork: parallel sampling
      const Live<T>& s = *live_[uniform(live_.size())];
      live_.push_back(std::make_unique<Live<T>>(Live<T>{s.seq.fork(), s.tokens}));
    } else if (kind <= 8) {  // rollback
      Live<T>& s = *live_[uniform(live_.size())];
      const std::size_t n = uniform(s.tokens.size() + 1);
      s.seq.truncate(n);
      s.tokens.resize(n);
    } else {  // release
      live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(uniform(live_.size())));
    }
  }

  void remember(const Tokens& t) {
    if (t.empty()) return;
    if (history_.size() < 16) {
      history_.push_back(t);
    } else {
      history_[uniform(history_.size())] = t;
    }
  }

  /// Every live sequence holds its tokens, and decoding one more token on a fork of it gives the
  /// reference logits of those tokens plus it: its cached K/V are right, shared or not.
  void check_all() {
    check_accounting();
    for (const auto& s : live_) {
      ASSERT_EQ(Tokens(s->seq.tokens().begin(), s->seq.tokens().end()), s->tokens);
      if (s->tokens.empty() || s->tokens.size() >= kMaxLen) continue;
      const std::int32_t probe = static_cast<std::int32_t>(s->tokens.size() % 50);
      PagedStore<T> f = s->seq.fork();
      try {
        const auto logits = model_.decode(probe, f, act_);
        Tokens all = s->tokens;
        all.push_back(probe);
        expect_logits(logits, all);
        if (::testing::Test::HasFatalFailure()) return;
        ++probes_checked_;
      } catch (const Error& e) {
        // Only an exhausted pool may refuse the probe, and the fork is then as it was.
        ASSERT_NE(std::string(e.what()).find("but the pool has"), std::string::npos) << e.what();
        ASSERT_EQ(f.size(), s->tokens.size());
        ++probes_refused_;
      }
    }
    check_accounting();
  }

  void expect_logits(std::span<const T> logits, const Tokens& tokens) {
    const std::vector<T> ref = model_.forward_reference(tokens);
    const std::size_t vocab = logits.size();
    const std::size_t row = tokens.size() - 1;
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[row * vocab + i];
      ASSERT_NEAR(logits[i], r, kTol * (1 + std::abs(r)))
          << "logit " << i << " of a sequence of " << tokens.size() << " tokens";
    }
  }

  /// Reference counts equal the number of live block tables holding each block; the pool's own
  /// lists agree with its states.
  void check_accounting() {
    std::vector<std::size_t> refs(pool_.n_blocks(), 0);
    std::size_t held = 0;
    for (const auto& s : live_)
      for (const std::size_t b : s->seq.block_table()) held += refs[b]++ == 0 ? 1 : 0;
    for (std::size_t b = 0; b < pool_.n_blocks(); ++b)
      ASSERT_EQ(pool_.ref_count(b), refs[b]) << "block " << b;
    ASSERT_EQ(pool_.n_held(), held);
    ASSERT_NO_THROW(pool_.check_invariants());
  }

  struct Snapshot {
    std::vector<std::vector<std::size_t>> tables;
    std::vector<std::size_t> sizes;
    std::size_t free = 0, evictable = 0;
  };
  Snapshot snapshot() const {
    Snapshot s;
    for (const auto& l : live_) {
      s.tables.emplace_back(l->seq.block_table().begin(), l->seq.block_table().end());
      s.sizes.push_back(l->seq.size());
    }
    s.free = pool_.n_free();
    s.evictable = pool_.n_evictable();
    return s;
  }
  std::size_t index_of(const Live<T>& s) const {
    for (std::size_t i = 0; i < live_.size(); ++i)
      if (live_[i].get() == &s) return i;
    return live_.size();
  }
  void expect_unchanged(const Snapshot& before) {
    const Snapshot now = snapshot();
    ASSERT_EQ(now.tables, before.tables);
    ASSERT_EQ(now.sizes, before.sizes);
    ASSERT_EQ(now.free, before.free);
    ASSERT_EQ(now.evictable, before.evictable);
  }

  ModelConfig cfg_;
  Model<T> model_;
  BlockPool<T> pool_;
  Activations<T> act_;
  detail::SplitMix64 rng_;
  std::vector<std::unique_ptr<Live<T>>> live_;  // declared after pool_: released before it
  std::vector<Tokens> history_;                 // token lists new requests draw prefixes from
  std::size_t step_ = 0;
  std::size_t ops_failed_ = 0;
  std::size_t probes_checked_ = 0;  // fork probes whose logits were compared with the reference
  std::size_t probes_refused_ = 0;  // fork probes an exhausted pool refused
};

TEST(PagedRandomOpsTest, DoubleAgainstNoCacheRecomputeAtSeveralBlockSizes) {
  const std::size_t block_sizes[] = {1, 3, 4, 16};
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    const std::size_t bs = block_sizes[seed % 4];
    SCOPED_TRACE("seed " + std::to_string(seed) + ", block size " + std::to_string(bs));
    // Room for about two full-length sequences, so exhaustion is common.
    RandomOps<double> ops(seed, bs, 2 * 96 / bs + 2);
    ops.run(120);
    if (HasFatalFailure()) return;
  }
}

TEST(PagedRandomOpsTest, FloatAgainstNoCacheRecompute) {
  for (std::uint64_t seed = 100; seed <= 101; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", block size 16");
    RandomOps<float> ops(seed, 16, 14);
    ops.run(150);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace kvdecode::testing_util
