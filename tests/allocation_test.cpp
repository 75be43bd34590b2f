// A decode step performs no heap allocation: every operator new in this binary is counted, and
// Eigen's own allocator is forbidden while decoding (EIGEN_RUNTIME_NO_MALLOC).
#define EIGEN_RUNTIME_NO_MALLOC
#include <gtest/gtest.h>

#include "counting_new.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

template <class T>
void expect_decode_allocates_nothing(const ModelConfig& cfg) {
#ifndef NDEBUG
  // An unoptimised (assert-enabled) Eigen evaluates small products into heap temporaries; the
  // no-allocation guarantee is for optimised builds, where this test runs.
  GTEST_SKIP() << "allocation guarantee is checked in NDEBUG builds";
#endif
  const Model<T> model(random_weights<T>(cfg, 3));
  ContiguousStore<T> cache(cfg);
  Activations<T> act(cfg);
  Sampler sampler(cfg.vocab_size, SamplerOptions{0.8, 0.9, 5, 42});
  const auto tokens =
      testing_util::random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 1);
  model.decode(tokens[0], cache, act);  // warm-up outside the counted region
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  std::int32_t token = tokens[1];
  for (std::size_t p = 1; p < tokens.size(); ++p) {
    const auto logits = model.decode(token, cache, act);
    token = sampler.sample(logits);
  }
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode";
  EXPECT_EQ(cache.size(), tokens.size());
}

TEST(AllocationTest, DecodeStepAllocatesNothingFloat) {
  expect_decode_allocates_nothing<float>(testing_util::small_config(4, 2, 300));
}
TEST(AllocationTest, DecodeStepAllocatesNothingDouble) {
  expect_decode_allocates_nothing<double>(testing_util::small_config(8, 1, 40));
}

// The counter itself works: an allocation is seen.
TEST(AllocationTest, CounterSeesAllocations) {
  const long before = g_allocations.load();
  int* volatile p = new int(3);  // volatile: the compiler may not elide the allocation
  delete p;
  EXPECT_EQ(g_allocations.load() - before, 1);
}

}  // namespace
}  // namespace kvdecode
