// A decode step performs no heap allocation: every operator new in this binary is counted, and
// Eigen's own allocator is forbidden while decoding (EIGEN_RUNTIME_NO_MALLOC).
#define EIGEN_RUNTIME_NO_MALLOC
// The replacements below pair operator new with std::free by design (both ends are ours); GCC
// cannot see that through inlining and warns.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace {
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

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
