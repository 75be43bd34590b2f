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
