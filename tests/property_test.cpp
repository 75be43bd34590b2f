// Property tests: long random sequences of cache operations (prefill chunks, decodes, truncates,
// resets, and appends that must fail) on a tiny model, every step checked against the no-cache
// recompute forward_reference() of the tokens the store should hold. Seeded and reproducible:
//   KVDECODE_PROPERTY_SEED=<seed printed by a failure>  KVDECODE_PROPERTY_OPS=<operations>
// (default 10000 operations per store; the asan CI run uses the same default).
//
// The suite is typed over the store: a store adds a PropertyStore specialisation and its type to
// PropertyStores below. Stores whose logits match the reference (within rounding) are checked
// against forward_reference; the int8 store against a double recompute with int8 K/V (see its
// traits).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "double_forward.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace {

using kvdecode::Activations;
using kvdecode::BlockPool;
using kvdecode::ContiguousStore;
using kvdecode::Error;
using kvdecode::Int8Store;
using kvdecode::Model;
using kvdecode::ModelConfig;
using kvdecode::PagedStore;
using kvdecode::WindowStore;
using kvdecode::testing_util::env_or;
using kvdecode::testing_util::tiny_config;

/// How to build a store for the property run (make() returns a holder owning the store and
/// anything it lives on), which reference its logits must match and how closely
/// (|Δ| <= kTolerance × (1 + |ref|)), and how far back a truncate may go.
template <class Store>
struct PropertyStore;

template <class T>
constexpr double kExactTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;

template <class T>
struct PropertyStore<ContiguousStore<T>> {
  struct Holder {
    ContiguousStore<T> store;
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{ContiguousStore<T>(cfg, capacity)});
  }
  static constexpr std::size_t kWindow = 0;  // the plain causal mask
  static constexpr double kTolerance = kExactTolerance<T>;
  static constexpr std::size_t kMaxAppend = 9;  // tokens one prefill appends at most
  static std::size_t lowest_truncate(std::size_t) { return 0; }  // (longest size since reset)
};

/// Blocks of 3 positions, and exactly as many blocks as a full sequence needs, so block
/// boundaries fall inside prefill chunks and every block is reused after truncates and resets.
template <class T>
struct PropertyStore<PagedStore<T>> {
  struct Holder {
    Holder(const ModelConfig& cfg, std::size_t capacity)
        : pool(cfg, (capacity + 2) / 3, 3, {.capacity = capacity}), store(pool) {}
    BlockPool<T> pool;
    PagedStore<T> store;
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(cfg, capacity);
  }
  static constexpr std::size_t kWindow = 0;
  static constexpr double kTolerance = kExactTolerance<T>;
  static constexpr std::size_t kMaxAppend = 9;  // tokens one prefill appends at most
  static std::size_t lowest_truncate(std::size_t) { return 0; }  // (longest size since reset)
};

/// A model trained with a window of 6: the reference applies the same windowed causal mask.
/// The ring keeps the last R = W - 1 + max_chunk positions written, so a truncate to n must
/// leave the window of the query at n, [n - W + 1, n), resident: n >= longest - R + W - 1,
/// where `longest` is the largest size since the last reset.
template <class T>
struct PropertyStore<WindowStore<T>> {
  static constexpr std::size_t kWindow = 6;
  static constexpr std::size_t kMaxChunk = 4;  // = the Activations' max_chunk below
  struct Holder {
    WindowStore<T> store;
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{
        WindowStore<T>(cfg, {.window = kWindow, .max_chunk = kMaxChunk, .capacity = capacity})});
  }
  static constexpr double kTolerance = kExactTolerance<T>;
  /// Onto a non-empty ring an append may bring at most max_chunk positions (a cancel must be
  /// able to restore what it would overwrite).
  static constexpr std::size_t kMaxAppend = kMaxChunk;
  static std::size_t lowest_truncate(std::size_t longest) {
    constexpr std::size_t ring = kWindow - 1 + kMaxChunk;
    return longest > ring ? longest - ring + kWindow - 1 : 0;
  }
};

/// The int8 store rounds K/V, so forward_reference is not its oracle. Its oracle is a double
/// forward whose K/V rows go through int8 as int8_store.hpp specifies it (int8_double_forward,
/// double_forward.hpp). Rows are quantized once when written, so the recompute of the expected
/// tokens must give the incremental store's logits to the last bits whatever the chunking,
/// truncates, resets and refused appends before. The quantization error itself is bounded
/// against the f32 cache in quant_error_budget_test.cpp.
template <>
struct PropertyStore<Int8Store<double>> {
  struct Holder {
    Int8Store<double> store;
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{Int8Store<double>(cfg, capacity)});
  }
  static std::vector<double> reference(const Model<double>& model,
                                       const std::vector<std::int32_t>& tokens) {
    return kvdecode::testing_util::int8_double_forward(
        kvdecode::testing_util::widen_weights(model.weights()), tokens);
  }
  static constexpr double kTolerance = 1e-9;
  static constexpr std::size_t kMaxAppend = 9;
  static std::size_t lowest_truncate(std::size_t) { return 0; }
};

template <class Store>
class PropertyTest : public ::testing::Test {};

using PropertyStores = ::testing::Types<ContiguousStore<float>, ContiguousStore<double>,
                                        PagedStore<float>, PagedStore<double>, WindowStore<float>,
                                        WindowStore<double>, Int8Store<double>>;
TYPED_TEST_SUITE(PropertyTest, PropertyStores);

TYPED_TEST(PropertyTest, RandomOperationsMatchTheNoCacheRecompute) {
  using Store = TypeParam;
  using T = typename Store::Scalar;
  using Traits = PropertyStore<Store>;
  const std::uint64_t seed = env_or("KVDECODE_PROPERTY_SEED", 20260308);
  const std::uint64_t ops = env_or("KVDECODE_PROPERTY_OPS", 10000);
  std::printf("property run: seed %llu, %llu operations (rerun with KVDECODE_PROPERTY_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(ops),
              static_cast<unsigned long long>(seed));

  const ModelConfig cfg = tiny_config(1);
  const Model<T> model(kvdecode::random_weights<T>(cfg, seed ^ 0x5EED));
  const std::size_t capacity = 20;
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const auto holder = Traits::make(cfg, capacity);
  Store& store = holder->store;
  Activations<T> act(
      cfg, {.max_chunk = 4,
            .store_scratch = store.block_scratch_size()});  // chunks of 4: prefill splits longer
  kvdecode::detail::SplitMix64 rng(seed);
  const auto below = [&](std::size_t n) { return static_cast<std::size_t>(rng.next() % n); };
  const auto random_token = [&] { return static_cast<std::int32_t>(below(vocab)); };

  std::vector<std::int32_t> expected;  // the tokens the store should hold
  const auto reference = [&] {
    if constexpr (requires { Traits::reference(model, expected); }) {
      return Traits::reference(model, expected);
    } else {
      return kvdecode::forward_reference(model.weights(), expected, Traits::kWindow);
    }
  };
  std::size_t longest = 0;  // the largest size since the last reset
  std::vector<T> all_logits;
  std::size_t counts[7] = {};
  const auto check_row = [&](std::span<const T> logits, std::size_t position,
                             const std::vector<T>& ref, std::uint64_t op) {
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[position * vocab + i];
      ASSERT_NEAR(logits[i], r, Traits::kTolerance * (1 + std::abs(r)))
          << "seed " << seed << " operation " << op << " position " << position << " logit " << i;
    }
  };
  const auto check_unchanged = [&](std::uint64_t op) {
    ASSERT_EQ(store.size(), expected.size()) << "seed " << seed << " operation " << op;
    ASSERT_EQ(store.pending(), 0u);
    const auto t = store.tokens();
    ASSERT_EQ(std::vector<std::int32_t>(t.begin(), t.end()),
              kvdecode::testing_util::shown_tokens(store, expected))
        << "seed " << seed << " operation " << op;
  };

  for (std::uint64_t op = 0; op < ops; ++op) {
    const std::size_t room = capacity - expected.size();
    const std::size_t kind = below(100);
    if (kind < 35 && room > 0) {  // prefill a chunk, sometimes asking for every position's logits
      ++counts[0];
      std::vector<std::int32_t> chunk(1 + below(std::min(room, Traits::kMaxAppend)));
      for (auto& t : chunk) t = random_token();
      const bool want_all = below(4) == 0;
      all_logits.assign(want_all ? chunk.size() * vocab : 0, T{});
      const auto last = model.prefill(chunk, store, act, std::span<T>(all_logits));
      const std::size_t first = expected.size();
      expected.insert(expected.end(), chunk.begin(), chunk.end());
      const std::vector<T> ref = reference();
      check_row(last, expected.size() - 1, ref, op);
      for (std::size_t i = 0; want_all && i < chunk.size(); ++i)
        check_row(std::span<const T>(all_logits).subspan(i * vocab, vocab), first + i, ref, op);
    } else if (kind < 70 && room > 0) {  // decode one token
      ++counts[1];
      const std::int32_t token = random_token();
      const auto logits = model.decode(token, store, act);
      expected.push_back(token);
      check_row(logits, expected.size() - 1, reference(), op);
    } else if (kind < 80) {  // truncate (rollback) to any length, including the current one
      ++counts[2];
      const std::size_t lo = Traits::lowest_truncate(longest);
      const std::size_t n = lo + below(expected.size() - lo + 1);
      store.truncate(n);
      expected.resize(n);
    } else if (kind < 83) {  // reset
      ++counts[3];
      store.reset();
      expected.clear();
      longest = 0;
    } else if (kind < 90) {  // an append past the capacity: refused, nothing changes
      ++counts[4];
      std::vector<std::int32_t> chunk(room + 1 + below(3));
      for (auto& t : chunk) t = random_token();
      if (chunk.size() == 1) {
        EXPECT_THROW(model.decode(chunk[0], store, act), Error);
      } else {
        EXPECT_THROW(model.prefill(chunk, store, act), Error);
      }
    } else if (kind < 97) {  // a chunk with one bad token id: refused, nothing changes
      ++counts[5];
      std::vector<std::int32_t> chunk(1 + below(5));
      for (auto& t : chunk) t = random_token();
      chunk[below(chunk.size())] = below(2) == 0 ? -1 : static_cast<std::int32_t>(vocab + below(3));
      EXPECT_THROW(model.prefill(chunk, store, act), Error);
    } else {  // a truncate beyond the size: refused, nothing changes
      ++counts[6];
      EXPECT_THROW(store.truncate(expected.size() + 1 + below(3)), Error);
    }
    check_unchanged(op);
    if (::testing::Test::HasFatalFailure()) return;
    longest = std::max(longest, expected.size());
  }
  std::printf(
      "  prefill %zu, decode %zu, truncate %zu, reset %zu, over capacity %zu, bad token "
      "%zu, bad truncate %zu\n",
      counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6]);
  // Every kind of operation ran often enough to matter.
  for (const std::size_t c : counts) EXPECT_GT(c, ops / 100);
}

}  // namespace
