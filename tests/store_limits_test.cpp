// Every size a caller passes a store is checked against the config and against overflow
// before anything is reserved: an Error naming the size, never a wrapped product or a
// multi-gigabyte allocation attempt.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <limits>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

constexpr std::size_t kHuge = std::numeric_limits<std::size_t>::max() / 3;

TEST(StoreLimitsTest, CapacitiesThatOverflowAreRefusedNamingThem) {
  const ModelConfig cfg = small_config(4, 2, 64);
  using ::testing::HasSubstr;
  EXPECT_THAT(error_of([&] { ContiguousStore<float>(cfg, kHuge); }),
              HasSubstr("ContiguousStore: capacity " + std::to_string(kHuge)));
  EXPECT_THAT(error_of([&] { Int8Store<float>(cfg, kHuge); }),
              HasSubstr("Int8Store: capacity " + std::to_string(kHuge)));
  EXPECT_THAT(error_of([&] { Q4Store<float>(cfg, kHuge); }),
              HasSubstr("Q4Store: capacity " + std::to_string(kHuge)));
  EXPECT_THAT(error_of([&] { Q4Store<float>(cfg, 64, kHuge); }),
              HasSubstr("Q4Store: group size " + std::to_string(kHuge) + " overflows"));
  EXPECT_THAT(
      error_of([&] { BlockPool<float>(cfg, kHuge, 16); }),
      HasSubstr("BlockPool: " + std::to_string(kHuge) + " blocks of 16 positions overflow"));
  EXPECT_THAT(error_of([&] { BlockPool<float>(cfg, 4, kHuge); }),
              HasSubstr("blocks of " + std::to_string(kHuge) + " positions overflow"));
  EXPECT_THAT(error_of([&] {
                WindowStore<float>(cfg, {.window = kHuge, .capacity = kUnboundedPositions});
              }),
              HasSubstr("overflow"));
}

TEST(StoreLimitsTest, SizesWithinTheLimitsAreAccepted) {
  const ModelConfig cfg = small_config(4, 2, 64);
  EXPECT_EQ(ContiguousStore<float>(cfg, 100).capacity(), 100u);  // past seq_len is allowed
  EXPECT_EQ(Int8Store<float>(cfg).capacity(), 64u);
  EXPECT_EQ(Q4Store<float>(cfg, 64, 64).capacity(), 64u);
  EXPECT_EQ(Q4Store<float>(cfg, 1, 64).capacity(), 1u);  // a group longer than the store is fine
  EXPECT_EQ(BlockPool<float>(cfg, 4, 16).n_blocks(), 4u);
}

}  // namespace
}  // namespace kvdecode::testing_util
