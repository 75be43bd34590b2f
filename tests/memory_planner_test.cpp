// MemoryPlanner: its byte counts equal what ContiguousStore reserves, its largest context for a
// budget is the exact maximum, and it works at compile time.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

ModelConfig shape(std::int64_t dim, std::int64_t n_layers, std::int64_t n_heads,
                  std::int64_t n_kv_heads, std::int64_t seq_len) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = 3 * dim;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 512;
  c.seq_len = seq_len;
  return c;
}

// MHA, GQA and MQA variants of a few widths.
std::vector<ModelConfig> configs() {
  return {shape(64, 2, 4, 4, 64),   shape(64, 2, 4, 2, 64), shape(64, 3, 4, 1, 32),
          shape(288, 6, 6, 6, 256), shape(96, 1, 6, 3, 16), shape(128, 4, 8, 2, 128)};
}

template <class T>
void expect_matches_store() {
  for (const ModelConfig& cfg : configs()) {
    const MemoryPlanner<T> plan(cfg);
    for (const std::size_t capacity :
         {std::size_t{1}, std::size_t{7}, std::size_t{16}, static_cast<std::size_t>(cfg.seq_len)}) {
      const ContiguousStore<T> store(cfg, capacity);
      EXPECT_EQ(plan.kv_bytes(capacity), store.memory_bytes())
          << "heads " << cfg.n_heads << "/" << cfg.n_kv_heads << " capacity " << capacity;
      EXPECT_EQ(plan.kv_bytes(capacity, 3), 3 * store.memory_bytes());
    }
    // Capacity 0 means seq_len in the store.
    EXPECT_EQ(plan.kv_bytes(static_cast<std::uint64_t>(cfg.seq_len)),
              ContiguousStore<T>(cfg).memory_bytes());
    EXPECT_EQ(plan.bytes_per_position(), ContiguousStore<T>(cfg, 1).memory_bytes());
  }
}

TEST(MemoryPlannerTest, BytesEqualWhatContiguousStoreReserves) {
  expect_matches_store<float>();
  expect_matches_store<double>();
}

/// Every layout the planner knows, with the parameters the stores below are built with.
std::vector<StoreLayout> layouts() {
  std::vector<StoreLayout> l = {{.kind = StoreKind::kContiguous}, {.kind = StoreKind::kInt8}};
  for (const std::uint64_t g : {2u, 16u, 64u}) l.push_back({.kind = StoreKind::kQ4, .group = g});
  for (const bool streaming : {false, true})
    l.push_back({.kind = StoreKind::kWindow,
                 .window = 5,
                 .sinks = 2,
                 .max_chunk = 3,
                 .streaming = streaming});
  for (const std::uint64_t bs : {1u, 5u, 16u})
    l.push_back({.kind = StoreKind::kPaged, .block_size = bs});
  return l;
}

/// memory_bytes() of the store the layout describes, built for `capacity` positions (a paged
/// sequence holding `capacity` pending positions, on a pool large enough).
template <class T>
std::uint64_t store_bytes(const ModelConfig& cfg, const StoreLayout& l, std::size_t capacity) {
  switch (l.kind) {
    case StoreKind::kContiguous:
      return ContiguousStore<T>(cfg, capacity).memory_bytes();
    case StoreKind::kInt8:
      return Int8Store<T>(cfg, capacity).memory_bytes();
    case StoreKind::kQ4:
      return Q4Store<T>(cfg, capacity, l.group).memory_bytes();
    case StoreKind::kWindow:
      return WindowStore<T>(cfg, {.window = l.window,
                                  .sinks = l.sinks,
                                  .policy = l.streaming ? WindowPolicy::kStreaming
                                                        : WindowPolicy::kTrainedWindow,
                                  .max_chunk = l.max_chunk,
                                  .max_positions = capacity})
          .memory_bytes();
    case StoreKind::kPaged: {
      BlockPool<T> pool(cfg, (capacity + l.block_size - 1) / l.block_size, l.block_size,
                        {.max_seq_len = capacity});
      PagedStore<T> seq(pool);
      const std::vector<std::int32_t> tokens(capacity, 1);
      seq.begin_append(tokens);  // takes every block the positions need
      const std::uint64_t bytes = seq.memory_bytes();
      seq.cancel_append();
      return bytes;
    }
  }
  return 0;
}

template <class T>
void expect_every_store_matches() {
  for (const ModelConfig& cfg : configs()) {
    for (const StoreLayout& l : layouts()) {
      const MemoryPlanner<T> plan(cfg, l);
      for (const std::size_t capacity : {1u, 7u, 16u, 63u, 64u, 65u, 130u}) {
        EXPECT_EQ(plan.kv_bytes(capacity), store_bytes<T>(cfg, l, capacity))
            << "kind " << static_cast<int>(l.kind) << " heads " << cfg.n_heads << "/"
            << cfg.n_kv_heads << " head_size " << cfg.head_size() << " capacity " << capacity;
        EXPECT_EQ(plan.kv_bytes(capacity, 3), 3 * plan.kv_bytes(capacity));
      }
    }
  }
}

TEST(MemoryPlannerTest, BytesEqualWhatEveryStoreKindReserves) {
  expect_every_store_matches<float>();
  expect_every_store_matches<double>();
}

// The int8 store's scale costs 4 bytes per head_size values: 1/4 + 1/head_size of the f32
// cache, within 27 % from head_size 64 up (26.6 % at 64, 27.1 % at 48).
TEST(MemoryPlannerTest, Int8CacheIsAtMost27PercentOfF32FromHeadSize64) {
  for (const std::int64_t hs : {64, 96, 128, 256}) {
    const ModelConfig cfg = shape(4 * hs, 2, 4, 2, 64);
    const MemoryPlanner<float> f32(cfg), i8(cfg, {.kind = StoreKind::kInt8});
    const double ratio = static_cast<double>(i8.bytes_per_position()) /
                         static_cast<double>(f32.bytes_per_position());
    EXPECT_DOUBLE_EQ(ratio, 0.25 + 1.0 / static_cast<double>(hs)) << "head_size " << hs;
    EXPECT_LE(ratio, 0.27) << "head_size " << hs;
  }
}

TEST(MemoryPlannerTest, MaxContextIsTheLargestThatFitsForEveryStoreKind) {
  constexpr std::uint64_t kUnbounded = std::numeric_limits<std::uint64_t>::max();
  for (const ModelConfig& cfg : configs()) {
    for (const StoreLayout& l : layouts()) {
      const MemoryPlanner<float> plan(cfg, l);
      for (const std::uint64_t batch : {1u, 3u}) {
        for (const std::uint64_t budget :
             {std::uint64_t{0}, plan.kv_bytes(1, batch) - 1, plan.kv_bytes(1, batch),
              plan.kv_bytes(100, batch) + 17, std::uint64_t{1} << 24}) {
          const std::uint64_t t = plan.max_context(budget, batch);
          if (t == kUnbounded) {  // a window's memory does not grow with the context
            EXPECT_EQ(l.kind, StoreKind::kWindow);
            EXPECT_LE(plan.kv_bytes(1 << 20, batch), budget);
            continue;
          }
          if (t > 0) {
            EXPECT_LE(plan.kv_bytes(t, batch), budget) << "budget " << budget;
          }
          EXPECT_GT(plan.kv_bytes(t + 1, batch), budget)
              << "kind " << static_cast<int>(l.kind) << " budget " << budget << " batch " << batch;
        }
      }
    }
  }
}

TEST(MemoryPlannerTest, MaxContextIsTheLargestThatFits) {
  for (const ModelConfig& cfg : configs()) {
    const MemoryPlanner<float> plan(cfg);
    const std::uint64_t per = plan.bytes_per_position();
    for (const std::uint64_t batch : {1u, 2u, 5u}) {
      for (const std::uint64_t budget :
           {std::uint64_t{0}, per - 1, per, per * batch, per * batch + 1, std::uint64_t{1} << 20,
            (std::uint64_t{3} << 30) + 12345, std::uint64_t{24} << 30}) {
        const std::uint64_t t = plan.max_context(budget, batch);
        EXPECT_LE(plan.kv_bytes(t, batch), budget) << "budget " << budget << " batch " << batch;
        EXPECT_GT(plan.kv_bytes(t + 1, batch), budget) << "budget " << budget << " batch " << batch;
      }
    }
  }
}

TEST(MemoryPlannerTest, SharedKvHeadsShrinkTheCacheByTheGroupSize) {
  const MemoryPlanner<float> mha(shape(256, 4, 8, 8, 64));
  const MemoryPlanner<float> gqa(shape(256, 4, 8, 2, 64));
  const MemoryPlanner<float> mqa(shape(256, 4, 8, 1, 64));
  EXPECT_EQ(mha.kv_bytes(1000), 4 * gqa.kv_bytes(1000));
  EXPECT_EQ(mha.kv_bytes(1000), 8 * mqa.kv_bytes(1000));
}

TEST(MemoryPlannerTest, WeightBytesEqualWeightsBytes) {
  for (ModelConfig cfg : configs()) {
    for (const bool shared : {true, false}) {
      cfg.shared_classifier = shared;
      EXPECT_EQ(weight_bytes<float>(cfg), Weights<float>(cfg).bytes());
      EXPECT_EQ(weight_bytes<bf16>(cfg), Weights<bf16>(cfg).bytes());
    }
  }
}

// A server can size caches at compile time: the 15M shape with seq_len 2048 (6 layers, 6 kv
// heads of 48) takes 2 × 6 × 6 × 48 × 4 = 13824 bytes per position.
TEST(MemoryPlannerTest, WorksAtCompileTime) {
  constexpr ModelConfig cfg = [] {
    ModelConfig c;
    c.dim = 288;
    c.hidden_dim = 768;
    c.n_layers = 6;
    c.n_heads = 6;
    c.n_kv_heads = 6;
    c.vocab_size = 32000;
    c.seq_len = 2048;
    return c;
  }();
  constexpr MemoryPlanner<float> plan(cfg);
  static_assert(plan.bytes_per_position() == 13824);
  static_assert(plan.kv_bytes(2048, 4) == 4ull * 2048 * 13824);
  static_assert(plan.max_context(std::uint64_t{1} << 30) == (std::uint64_t{1} << 30) / 13824);
  static_assert(weight_bytes<float>(cfg) > 0);
  EXPECT_EQ(plan.kv_bytes(2048), ContiguousStore<float>(cfg).memory_bytes());
}

TEST(MemoryPlannerTest, RejectsBadInputsWithErrors) {
  const MemoryPlanner<float> plan(shape(64, 2, 4, 2, 64));
  EXPECT_THROW(plan.max_context(1000, 0), Error);
  EXPECT_THROW(plan.kv_bytes(std::numeric_limits<std::uint64_t>::max() / 2, 2), Error);
  ModelConfig bad = shape(64, 2, 4, 2, 64);
  bad.n_kv_heads = 0;
  try {
    const MemoryPlanner<float> p(bad);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_heads must be positive, got 0"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kvdecode
