// MemoryPlanner: its byte counts equal what every store kind reserves, its largest context for a
// budget is the exact maximum, and it works at compile time.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

ModelConfig shape(std::int64_t dim, std::int64_t n_layers, std::int64_t n_heads,
                  std::int64_t n_kv_heads, std::int64_t seq_len) {
  return testing_util::test_config({.dim = dim,
                                    .hidden_dim = 3 * dim,
                                    .n_layers = n_layers,
                                    .n_heads = n_heads,
                                    .n_kv_heads = n_kv_heads,
                                    .vocab_size = 512,
                                    .seq_len = seq_len});
}

// MHA, GQA and MQA variants of a few widths.
std::vector<ModelConfig> configs() {
  return {shape(64, 2, 4, 4, 64),   shape(64, 2, 4, 2, 64), shape(64, 3, 4, 1, 32),
          shape(288, 6, 6, 6, 256), shape(96, 1, 6, 3, 16), shape(128, 4, 8, 2, 128)};
}

template <class T>
void expect_matches_store() {
  for (const ModelConfig& cfg : configs()) {
    const MemoryPlanner<ContiguousStore<T>> plan(cfg);
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
    // K and V of every layer and kv head, and a 4-byte token id.
    const auto kv_dim = static_cast<std::uint64_t>(cfg.n_kv_heads * cfg.head_size());
    EXPECT_EQ(
        plan.bytes_per_position(),
        static_cast<double>(2 * static_cast<std::uint64_t>(cfg.n_layers) * kv_dim * sizeof(T) + 4));
    EXPECT_EQ(plan.fixed_bytes(), 0u);
  }
}

TEST(MemoryPlannerTest, BytesEqualWhatContiguousStoreReserves) {
  expect_matches_store<float>();
  expect_matches_store<double>();
}

/// One store kind with the options it is built with: the planner's figures, and memory_bytes()
/// of the store itself built for a capacity (a paged sequence holding `capacity` pending
/// positions, on a pool large enough).
struct Case {
  std::string name;
  bool grows = true;  ///< whether memory grows with the context (not for a window)
  std::function<std::uint64_t(std::uint64_t, std::uint64_t)> kv_bytes;
  std::function<std::uint64_t(std::uint64_t, std::uint64_t)> max_context;
  std::function<std::uint64_t(std::size_t)> store_bytes;
};

template <class S, class Build>
Case make_case(std::string name, const ModelConfig& cfg, typename S::Options options, Build build,
               bool grows = true) {
  const MemoryPlanner<S> plan(cfg, options);
  return {std::move(name), grows,
          [plan](std::uint64_t t, std::uint64_t b) { return plan.kv_bytes(t, b); },
          [plan](std::uint64_t budget, std::uint64_t b) { return plan.max_context(budget, b); },
          [cfg, build](std::size_t capacity) { return build(cfg, capacity); }};
}

/// Every store kind the library has, with a few option values each.
template <class T>
std::vector<Case> cases(const ModelConfig& cfg) {
  std::vector<Case> c;
  c.push_back(make_case<ContiguousStore<T>>("contiguous", cfg, {}, [](auto& m, std::size_t n) {
    return ContiguousStore<T>(m, n).memory_bytes();
  }));
  c.push_back(make_case<Int8Store<T>>(
      "int8", cfg, {}, [](auto& m, std::size_t n) { return Int8Store<T>(m, n).memory_bytes(); }));
  for (const std::size_t g : {2u, 16u, 64u})
    c.push_back(make_case<Q4Store<T>>(
        "q4 group " + std::to_string(g), cfg, {.group = g},
        [g](auto& m, std::size_t n) { return Q4Store<T>(m, n, g).memory_bytes(); }));
  for (const auto policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming}) {
    const WindowOptions o{.window = 5, .sinks = 2, .policy = policy, .max_chunk = 3};
    c.push_back(make_case<WindowStore<T>>(
        policy == WindowPolicy::kStreaming ? "window streaming" : "window trained", cfg, o,
        [o](auto& m, std::size_t n) {
          WindowOptions with = o;
          with.capacity = n;
          return WindowStore<T>(m, with).memory_bytes();
        },
        false));
  }
  for (const std::size_t bs : {1u, 5u, 16u})
    c.push_back(make_case<PagedStore<T>>(
        "paged block " + std::to_string(bs), cfg, {.block_size = bs},
        [bs](auto& m, std::size_t n) -> std::uint64_t {
          BlockPool<T> pool(m, (n + bs - 1) / bs, bs, {.capacity = n});
          PagedStore<T> seq(pool);
          const std::vector<std::int32_t> tokens(n, 1);
          seq.begin_append(tokens);  // takes every block the positions need
          const std::uint64_t bytes = seq.memory_bytes();
          seq.cancel_append();
          return bytes;
        }));
  return c;
}

template <class T>
void expect_every_store_matches() {
  for (const ModelConfig& cfg : configs()) {
    for (const Case& c : cases<T>(cfg)) {
      for (const std::size_t capacity : {1u, 7u, 16u, 63u, 64u, 65u, 130u}) {
        EXPECT_EQ(c.kv_bytes(capacity, 1), c.store_bytes(capacity))
            << c.name << " heads " << cfg.n_heads << "/" << cfg.n_kv_heads << " head_size "
            << cfg.head_size() << " capacity " << capacity;
        EXPECT_EQ(c.kv_bytes(capacity, 3), 3 * c.kv_bytes(capacity, 1));
      }
    }
  }
}

TEST(MemoryPlannerTest, BytesEqualWhatEveryStoreKindReserves) {
  expect_every_store_matches<float>();
  expect_every_store_matches<double>();
}

// The int8 store's scale costs 4 bytes per head_size values: about 1/4 + 1/head_size of the f32
// cache (both with a 4-byte token id per position), within 27 % from head_size 64 up (26.7 % at
// 64 here, 27.2 % at 48).
TEST(MemoryPlannerTest, Int8CacheIsAtMost27PercentOfF32FromHeadSize64) {
  for (const std::int64_t hs : {64, 96, 128, 256}) {
    const ModelConfig cfg = shape(4 * hs, 2, 4, 2, 64);  // 2 layers × 2 kv heads
    const MemoryPlanner<ContiguousStore<float>> f32(cfg);
    const MemoryPlanner<Int8Store<float>> i8(cfg);
    const double ratio = i8.bytes_per_position() / f32.bytes_per_position();
    const auto h = static_cast<double>(hs);
    EXPECT_DOUBLE_EQ(ratio, (2 * 4 * (h + 4) + 4) / (2 * 4 * h * 4 + 4)) << "head_size " << hs;
    EXPECT_LE(ratio, 0.27) << "head_size " << hs;
  }
}

// The fixed part of a 4-bit cache: the ring of R + G exact rows of K and V per (layer, kv head)
// and its cancel copy (four buffers), one group's work rows (2·G·hs + 2·hs + 2·G floats), each
// buffer allocated in whole 64-byte lines, and two counters per layer.
TEST(MemoryPlannerTest, Q4FixedBytesAreTheRingAndTheWorkRows) {
  const auto lines = [](std::uint64_t bytes) { return (bytes + 63) / 64 * 64; };
  for (const ModelConfig& cfg : configs()) {
    for (const std::size_t g : {16u, 64u}) {
      const MemoryPlanner<Q4Store<float>> plan(cfg, {.group = g, .residual = 128});
      const auto hs = static_cast<std::uint64_t>(cfg.head_size());
      EXPECT_EQ(plan.fixed_bytes(),
                4 * lines(static_cast<std::uint64_t>(cfg.n_layers * cfg.n_kv_heads) * (128 + g) *
                          hs * 4u) +
                    lines((2 * g * hs + 2 * hs + 2 * g) * 4u) +
                    2 * static_cast<std::uint64_t>(cfg.n_layers) * sizeof(std::size_t));
    }
  }
}

// A paged sequence pays for whole blocks: its padding is the rows of its last block past its end,
// 2 × n_layers × kv_dim × sizeof(T) bytes each; a contiguous store sized to the context has none.
TEST(MemoryPlannerTest, PaddingIsTheLastBlocksUnusedRows) {
  const ModelConfig cfg = shape(256, 4, 8, 4, 1024);  // kv_dim 128
  const std::uint64_t row = 2 * 4 * 128 * sizeof(float);
  const MemoryPlanner<PagedStore<float>> b16(cfg, {.block_size = 16});
  const MemoryPlanner<PagedStore<float>> b64(cfg, {.block_size = 64});
  EXPECT_EQ(b16.padding_bytes(1000), (1008 - 1000) * row);
  EXPECT_EQ(b16.padding_bytes(1008), 0u);
  EXPECT_EQ(b16.padding_bytes(1000, 3), 3 * (1008 - 1000) * row);
  EXPECT_EQ(b64.padding_bytes(1000), (1024 - 1000) * row);
  EXPECT_EQ(b64.padding_bytes(1), 63 * row);
  EXPECT_EQ(b64.padding_bytes(1000) + 1000 * (row + 4), b64.kv_bytes(1000));  // and token ids
  EXPECT_EQ(MemoryPlanner<ContiguousStore<float>>(cfg).padding_bytes(1000), 0u);
}

// The streaming block size: the smallest power of two from 16 up whose rows of one (layer, kv
// head) fill 4096 bytes.
TEST(MemoryPlannerTest, StreamingBlockSizeFillsAPagePerLayerAndHead) {
  EXPECT_EQ(PagedStore<float>::streaming_block_size(shape(256, 4, 8, 4, 64)), 32u);   // hs 32
  EXPECT_EQ(PagedStore<double>::streaming_block_size(shape(256, 4, 8, 4, 64)), 16u);  // 32 × 8
  EXPECT_EQ(PagedStore<float>::streaming_block_size(shape(512, 2, 8, 8, 64)), 16u);   // hs 64
  EXPECT_EQ(PagedStore<float>::streaming_block_size(shape(64, 2, 8, 8, 64)), 128u);   // hs 8
}

TEST(MemoryPlannerTest, MaxContextIsTheLargestThatFitsForEveryStoreKind) {
  constexpr std::uint64_t kUnbounded = std::numeric_limits<std::uint64_t>::max();
  for (const ModelConfig& cfg : configs()) {
    for (const Case& c : cases<float>(cfg)) {
      for (const std::uint64_t batch : {1u, 3u}) {
        for (const std::uint64_t budget :
             {std::uint64_t{0}, c.kv_bytes(1, batch) - 1, c.kv_bytes(1, batch),
              c.kv_bytes(100, batch) + 17, std::uint64_t{1} << 24}) {
          const std::uint64_t t = c.max_context(budget, batch);
          if (t == kUnbounded) {  // a window's memory does not grow with the context
            EXPECT_FALSE(c.grows) << c.name;
            EXPECT_LE(c.kv_bytes(1 << 20, batch), budget);
            continue;
          }
          if (t > 0) {
            EXPECT_LE(c.kv_bytes(t, batch), budget) << "budget " << budget;
          }
          EXPECT_GT(c.kv_bytes(t + 1, batch), budget)
              << c.name << " budget " << budget << " batch " << batch;
        }
      }
    }
  }
}

TEST(MemoryPlannerTest, MaxContextIsTheLargestThatFits) {
  for (const ModelConfig& cfg : configs()) {
    const MemoryPlanner<ContiguousStore<float>> plan(cfg);
    const auto per = static_cast<std::uint64_t>(plan.bytes_per_position());
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
  const MemoryPlanner<ContiguousStore<float>> mha(shape(256, 4, 8, 8, 64));
  const MemoryPlanner<ContiguousStore<float>> gqa(shape(256, 4, 8, 2, 64));
  const MemoryPlanner<ContiguousStore<float>> mqa(shape(256, 4, 8, 1, 64));
  // K and V shrink (3.9 MB each for MHA: whole 64-byte lines); the 4-byte token ids do not.
  const std::uint64_t ids = 4 * 1000;
  EXPECT_EQ(mha.kv_bytes(1000) - ids, 4 * (gqa.kv_bytes(1000) - ids));
  EXPECT_EQ(mha.kv_bytes(1000) - ids, 8 * (mqa.kv_bytes(1000) - ids));
}

TEST(MemoryPlannerTest, WeightBytesEqualWeightsBytes) {
  for (ModelConfig cfg : configs()) {
    for (const bool shared : {true, false}) {
      cfg.shared_classifier = shared;
      EXPECT_EQ(weight_bytes<float>(cfg), Weights<float>(cfg).bytes());
      EXPECT_EQ(weight_bytes<bf16>(cfg), Weights<bf16>(cfg).bytes());
      if (cfg.dim % 32 == 0 && cfg.hidden_dim % 32 == 0) {
        EXPECT_EQ(weight_bytes<Q8_0>(cfg), Weights<Q8_0>(cfg).bytes());
        EXPECT_EQ(weight_bytes<Q4_0>(cfg), Weights<Q4_0>(cfg).bytes());
      }
    }
  }
}

// Block formats by hand, the 15M shape: 9216000 embedding + 6 × 995328 layer matrix weights
// = 15187968, in blocks of 32 (34 bytes q8_0, 18 bytes q4_0), and 13 f32 gains of 288.
TEST(MemoryPlannerTest, WeightBytesOfBlockFormats) {
  constexpr ModelConfig cfg = testing_util::test_config({.dim = 288,
                                                         .hidden_dim = 768,
                                                         .n_layers = 6,
                                                         .n_heads = 6,
                                                         .n_kv_heads = 6,
                                                         .vocab_size = 32000,
                                                         .seq_len = 256});
  static_assert(weight_bytes<Q8_0>(cfg) == 15187968 / 32 * 34 + 13 * 288 * 4);
  static_assert(weight_bytes<Q4_0>(cfg) == 15187968 / 32 * 18 + 13 * 288 * 4);
  static_assert(weight_bytes<float>(cfg) == (15187968 + 13 * 288) * 4);
  EXPECT_EQ(weight_bytes<Q8_0>(cfg), 16152192u);
  EXPECT_EQ(weight_bytes<Q4_0>(cfg), 8558208u);
}

// A server can size caches at compile time: the 15M shape with seq_len 2048 (6 layers, 6 kv
// heads of 48) takes 2 × 6 × 6 × 48 × 4 = 13824 bytes of K and V per position and a 4-byte
// token id. K and V of 2048 positions are 6912 × 2048 = 13.5 MiB each, allocated as 14 MiB
// (whole 2 MiB huge pages). 1 GiB holds 77368 positions: 6912 × 77368 bytes fit 255 huge pages,
// so the two buffers and the ids take 2 × 255 × 2 MiB + 4 × 77368 ≤ 2^30; one more position
// needs 256 pages each.
TEST(MemoryPlannerTest, WorksAtCompileTime) {
  constexpr ModelConfig cfg = testing_util::test_config({.dim = 288,
                                                         .hidden_dim = 768,
                                                         .n_layers = 6,
                                                         .n_heads = 6,
                                                         .n_kv_heads = 6,
                                                         .vocab_size = 32000,
                                                         .seq_len = 2048});
  constexpr MemoryPlanner<ContiguousStore<float>> plan(cfg);
  constexpr std::uint64_t kMiB = 1 << 20;
  static_assert(plan.bytes_per_position() == 13828);
  static_assert(plan.kv_bytes(2048, 4) == 4 * (2 * 14 * kMiB + 4 * 2048));
  static_assert(plan.max_context(std::uint64_t{1} << 30) == 77368);
  static_assert(weight_bytes<float>(cfg) > 0);
  EXPECT_EQ(plan.kv_bytes(2048), ContiguousStore<float>(cfg).memory_bytes());
}

TEST(MemoryPlannerTest, RejectsBadInputsWithErrors) {
  const MemoryPlanner<ContiguousStore<float>> plan(shape(64, 2, 4, 2, 64));
  EXPECT_THROW(plan.max_context(1000, 0), Error);
  EXPECT_THROW(plan.kv_bytes(std::numeric_limits<std::uint64_t>::max() / 2, 2), Error);
  ModelConfig bad = shape(64, 2, 4, 2, 64);
  bad.n_kv_heads = 0;
  try {
    const MemoryPlanner<ContiguousStore<float>> p(bad);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_heads must be positive, got 0"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kvdecode
