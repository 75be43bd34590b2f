// ContiguousStore: the conformance suite, its element order and its byte count.
#include "kvdecode/store/contiguous_store.hpp"

#include <gtest/gtest.h>

#include <memory>

#include "store_conformance.hpp"

namespace kvdecode::testing_util {

template <class T>
struct StoreTraits<ContiguousStore<T>> {
  struct Holder {
    ContiguousStore<T> s;
    ContiguousStore<T>& store() { return s; }
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{ContiguousStore<T>(cfg, capacity)});
  }
  static constexpr bool kExactRows = true;
  static constexpr double kRowTolerance = 0;
  static constexpr double kLogitTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};

using ContiguousStores = ::testing::Types<ContiguousStore<float>, ContiguousStore<double>>;
INSTANTIATE_TYPED_TEST_SUITE_P(Contiguous, StoreConformance, ContiguousStores);

namespace {

TEST(ContiguousStoreTest, MemoryBytesFollowsTheFormula) {
  for (const auto& [heads, kv_heads] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{8, 1}}) {
    const ModelConfig cfg = small_config(heads, kv_heads, 48);
    for (const std::size_t capacity : {1u, 17u, 48u, 1000u}) {
      const ContiguousStore<float> f(cfg, capacity);
      const ContiguousStore<double> d(cfg, capacity);
      // Keys and values of 2 layers × kv_heads × 16 elements a position, and a 4-byte id.
      const std::size_t elems = 2 * capacity * static_cast<std::size_t>(kv_heads) * 16;
      EXPECT_EQ(f.memory_bytes(),
                2 * testing_util::allocated(elems * sizeof(float)) + 4 * capacity);
      EXPECT_EQ(d.memory_bytes(),
                2 * testing_util::allocated(elems * sizeof(double)) + 4 * capacity);
      EXPECT_EQ(f.capacity(), capacity);
    }
  }
  EXPECT_EQ(ContiguousStore<float>(small_config(4, 2, 48)).capacity(), 48u);  // 0 = seq_len
}

// Head-major order: one (layer, kv head)'s positions are one dense block, stride head_size.
TEST(ContiguousStoreTest, EachKvHeadIsOneDenseBlock) {
  const ModelConfig cfg = small_config(4, 2, 48);
  ContiguousStore<float> s(cfg, 10);
  s.begin_append(test_tokens(0, 3));
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t i = 0; i < 3; ++i) {
      const auto k = test_row<float>(l, i, 32, false);
      s.write(l, i, k.data(), k.data());
    }
  s.commit_append();
  std::size_t blocks = 0;
  s.for_each_block(1, 1, 3, {}, [&](const KvBlock<float>& b) {
    ++blocks;
    EXPECT_EQ(b.stride, 16u);
    EXPECT_EQ(b.n, 3u);
    EXPECT_EQ(b.first, 0u);
    EXPECT_EQ(b.keys + 16, s.key(1, 1, 1).data());
  });
  EXPECT_EQ(blocks, 1u);
  EXPECT_THROW(s.begin_append(test_tokens(0, 8)), Error);
  s.begin_append(test_tokens(0, 2));
  EXPECT_THROW(s.begin_append(test_tokens(0, 1)), Error);  // one append at a time
  s.cancel_append();
}

}  // namespace
}  // namespace kvdecode::testing_util
