// memory_bytes() of every store kind is every byte it allocates: each buffer rounded up as the
// allocator gives it (whole 64-byte lines, or whole 2 MiB pages from 4 MiB on) and the token ids.
// Each figure here is a formula of the shape written in the test, and MemoryPlanner predicts the
// same number before anything is allocated.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using testing_util::allocated;

/// The shape every formula below reads: layers, kv heads, head size.
struct Shape {
  std::uint64_t layers, kv_heads, head_size;
  std::uint64_t heads() const { return layers * kv_heads; }
};

Shape shape_of(const ModelConfig& cfg) {
  return {static_cast<std::uint64_t>(cfg.n_layers), static_cast<std::uint64_t>(cfg.n_kv_heads),
          static_cast<std::uint64_t>(cfg.dim / cfg.n_heads)};
}

// Two layers of 4 heads on 2 kv heads of 16 (small_config); one layer of 6 heads of 48 on 3 kv
// heads; 4 layers of 8 heads of 64 on 8 kv heads (MHA), whose f32 K of 700 positions is 5.7 MB:
// a buffer allocated in 2 MiB pages.
std::vector<ModelConfig> shapes() {
  ModelConfig mha = testing_util::small_config(8, 8, 1024);
  mha.dim = 512;
  mha.n_layers = 4;
  ModelConfig odd = testing_util::small_config(6, 3, 64);
  odd.dim = 288;
  odd.n_layers = 1;
  return {testing_util::small_config(4, 2, 64), odd, mha};
}

constexpr std::uint64_t kIdBytes = 4;  // an int32 token id

template <class S>
void expect_bytes(const S& store, const ModelConfig& cfg, const typename S::Options& options,
                  std::uint64_t expected, const char* what) {
  EXPECT_EQ(store.memory_bytes(), expected) << what;
  EXPECT_EQ(MemoryPlanner<S>(cfg, options).kv_bytes(store.capacity()), expected) << what;
  EXPECT_EQ(S::memory_bytes_for(cfg, options), expected) << what;
}

TEST(StoreMemoryTest, ContiguousIsKeysValuesAndIds) {
  for (const ModelConfig& cfg : shapes()) {
    const Shape d = shape_of(cfg);
    for (const std::uint64_t t : {1u, 13u, 64u, 700u}) {
      const ContiguousStore<float> f(cfg, t);
      expect_bytes(f, cfg, {t}, 2 * allocated(d.heads() * t * d.head_size * 4) + kIdBytes * t,
                   "f32");
      const ContiguousStore<double> g(cfg, t);
      expect_bytes(g, cfg, {t}, 2 * allocated(d.heads() * t * d.head_size * 8) + kIdBytes * t,
                   "f64");
    }
  }
}

TEST(StoreMemoryTest, Int8IsCodesScalesAndIds) {
  for (const ModelConfig& cfg : shapes()) {
    const Shape d = shape_of(cfg);
    for (const std::uint64_t t : {1u, 13u, 64u, 700u}) {
      const Int8Store<float> s(cfg, t);
      expect_bytes(s, cfg, {t},
                   2 * allocated(d.heads() * t * d.head_size) + 2 * allocated(d.heads() * t * 4) +
                       kIdBytes * t,
                   "int8");
    }
  }
}

// Codes of full groups, f16 (min, step) per key channel and per value row, the ring of R + G
// rows of K and V and its cancel copy, the work rows, two counters per layer, the ids.
template <class S>
void expect_low_bit(std::uint64_t bits) {
  for (const ModelConfig& cfg : shapes()) {
    const Shape d = shape_of(cfg);
    const std::uint64_t g = 16, r = 32;
    for (const std::uint64_t t : {1u, 13u, 64u, 700u}) {
      const std::uint64_t groups = d.heads() * (t / g);
      const S s(cfg, t, g, r);
      expect_bytes(s, cfg, {t, g, r, false},
                   2 * allocated(groups * g * d.head_size * bits / 8) +
                       2 * allocated(groups * d.head_size * 2) + 2 * allocated(groups * g * 2) +
                       4 * allocated(d.heads() * (r + g) * d.head_size * 4) +
                       allocated((2 * g * d.head_size + 2 * d.head_size + 2 * g) * 4) +
                       2 * d.layers * 8 + kIdBytes * t,
                   bits == 4 ? "q4" : "q2");
    }
  }
}

TEST(StoreMemoryTest, LowBitIsCodesRangesRingWorkCountersAndIds) {
  expect_low_bit<Q4Store<float>>(4);
  expect_low_bit<Q2Store<float>>(2);
}

// S sink rows and R = W - 1 + max_chunk ring rows of K and V, the [W][head_size / 2] cos and
// sin tables of a streaming window, the ids of the sinks and of 2(R + max_chunk) newest positions
// (a buffer the newest R + max_chunk are moved back in), a row counter per layer: the same for
// every capacity, unbounded included.
TEST(StoreMemoryTest, WindowIsSinksRingTablesIdsAndCountersWhateverItsCapacity) {
  for (const ModelConfig& cfg : shapes()) {
    const Shape d = shape_of(cfg);
    for (const WindowPolicy policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming}) {
      for (const std::uint64_t sinks : {0u, 4u}) {
        const std::uint64_t w = 10, chunk = 3, r = w - 1 + chunk;
        const std::uint64_t tables =
            policy == WindowPolicy::kStreaming ? 2 * allocated(w * d.head_size / 2 * 4) : 0;
        const std::uint64_t expected = 2 * allocated(d.heads() * sinks * d.head_size * 4) +
                                       2 * allocated(d.heads() * r * d.head_size * 4) + tables +
                                       kIdBytes * (sinks + 2 * (r + chunk)) + d.layers * 8;
        for (const std::uint64_t t : {std::uint64_t{0}, std::uint64_t{64},
                                      static_cast<std::uint64_t>(kUnboundedPositions)}) {
          const WindowOptions o{
              .window = w, .sinks = sinks, .policy = policy, .max_chunk = chunk, .capacity = t};
          const WindowStore<float> s(cfg, o);
          EXPECT_EQ(s.memory_bytes(), expected) << "capacity " << t;
          EXPECT_EQ(WindowStore<float>::memory_bytes_for(cfg, o), expected);
          EXPECT_EQ(MemoryPlanner<WindowStore<float>>(cfg, o).kv_bytes(1000000), expected);
        }
      }
    }
  }
}

// A paged store built from Options owns a pool of ceil(capacity / block_size) blocks: K and V of
// block_size positions each, and the sequence's ids.
TEST(StoreMemoryTest, PagedIsItsPoolsBlocksAndIds) {
  for (const ModelConfig& cfg : shapes()) {
    const Shape d = shape_of(cfg);
    for (const std::uint64_t bs : {1u, 16u, 20u}) {
      for (const std::uint64_t t : {1u, 13u, 64u, 700u}) {
        const std::uint64_t blocks = (t + bs - 1) / bs;
        const PagedStore<float> s(cfg, {bs, t});
        expect_bytes(s, cfg, {bs, t},
                     2 * allocated(blocks * bs * d.heads() * d.head_size * 4) + kIdBytes * t,
                     "paged");
      }
    }
  }
}

// A sequence on a shared pool counts the blocks it holds and its ids (reserved for the pool's
// capacity); the pool counts every block as allocated.
TEST(StoreMemoryTest, SharedPoolSequenceIsItsBlocksAndIds) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 64);
  const Shape d = shape_of(cfg);
  const std::uint64_t bs = 8, block = 2 * d.heads() * bs * d.head_size * 4;
  BlockPool<float> pool(cfg, 10, bs);
  EXPECT_EQ(pool.memory_bytes(), 2 * allocated(10 * block / 2));
  PagedStore<float> s(pool);
  EXPECT_EQ(s.memory_bytes(), kIdBytes * 64);
  s.begin_append(std::vector<std::int32_t>(20, 1));
  EXPECT_EQ(s.memory_bytes(), 3 * block + kIdBytes * 64);
  s.cancel_append();
}

}  // namespace
}  // namespace kvdecode
