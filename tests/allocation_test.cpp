// A decode step performs no heap allocation, in every build type: every allocation in this
// binary is counted (operator new and the malloc family, which Eigen's allocator uses), and
// Eigen's own allocator is forbidden while decoding (EIGEN_RUNTIME_NO_MALLOC, an assert in
// builds without NDEBUG).
// EIGEN_RUNTIME_NO_MALLOC: defined for every test by tests/CMakeLists.txt.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "counting_new.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

template <class T, class Store = ContiguousStore<T>>
void expect_decode_allocates_nothing(const ModelConfig& cfg, Store cache) {
  const Model<T> model(random_weights<T>(cfg, 3));
  Activations<T> act(cfg, {.max_chunk = 1, .store_scratch = cache.block_scratch_size()});
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
  const ModelConfig cfg = testing_util::small_config(4, 2, 300);
  expect_decode_allocates_nothing<float>(cfg, ContiguousStore<float>(cfg));
}
TEST(AllocationTest, DecodeStepAllocatesNothingDouble) {
  const ModelConfig cfg = testing_util::small_config(8, 1, 40);
  expect_decode_allocates_nothing<double>(cfg, ContiguousStore<double>(cfg));
}
// The quantized stores: a decode step attends to their codes (or decodes them into the
// Activations' scratch in a set without those kernels), groups quantized and rotated as it goes.
TEST(AllocationTest, DecodeStepOnQuantizedStoresAllocatesNothing) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 300);
  expect_decode_allocates_nothing<float>(cfg, Int8Store<float>(cfg));
  expect_decode_allocates_nothing<float>(cfg, Q4Store<float>(cfg, 0, 16, 32, /*rotate=*/true));
  expect_decode_allocates_nothing<float>(cfg, Q2Store<float>(cfg, 0, 16, 0, /*rotate=*/false));
}

// A window store with sinks and no length limit decodes 100 times S + 2R positions (30 times
// seq_len, 40 times its buffer of token ids) allocating nothing, and holds the same bytes
// throughout: the ids of old positions are dropped in place, not grown. Both policies.
TEST(AllocationTest, WindowStoreDecodesFarPastItsWindowAllocatingNothing) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 5));
  for (const WindowPolicy policy : {WindowPolicy::kStreaming, WindowPolicy::kTrainedWindow}) {
    const std::size_t S = 2, W = 8, chunk = 1, R = W - 1 + chunk, n = 100 * (S + 2 * R);
    WindowStore<float> cache(cfg, {.window = W,
                                   .sinks = S,
                                   .policy = policy,
                                   .max_chunk = chunk,
                                   .capacity = kUnboundedPositions});
    Activations<float> act(cfg, {.max_chunk = chunk, .store_scratch = cache.block_scratch_size()});
    const auto tokens = testing_util::random_tokens(n, cfg.vocab_size, 6);
    model.decode(tokens[0], cache, act);  // warm-up outside the counted region
    const std::size_t bytes = cache.memory_bytes();
    const long before = g_allocations.load();
    Eigen::internal::set_is_malloc_allowed(false);
    for (std::size_t p = 1; p < n; ++p) {
      model.decode(tokens[p], cache, act);
      if (cache.memory_bytes() != bytes) break;  // checked below, once
    }
    Eigen::internal::set_is_malloc_allowed(true);
    EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode";
    EXPECT_EQ(cache.memory_bytes(), bytes);
    EXPECT_EQ(cache.size(), n);
    // The ids it shows: those of the newest R positions; the sinks' and R + max_chunk newest
    // at least are held, in S + 2(R + max_chunk) slots (counted in memory_bytes()).
    const auto held = cache.tokens();
    ASSERT_EQ(held.size(), R);
    EXPECT_GT(cache.dropped_tokens(), 0u);
    EXPECT_TRUE(std::equal(held.begin(), held.end(), tokens.end() - static_cast<long>(R)));
  }
}

// Block-format weights: the input quantization writes into the Activations' scratch, on one
// thread and on a pool.
template <class B>
void expect_quantized_decode_allocates_nothing(ThreadPool* pool) {
  const ModelConfig cfg =
      testing_util::small_config(4, 2, 60);  // dim 64, hidden 96: multiples of 32
  const Model<float, B> model(quantize_weights<B>(random_weights<float>(cfg, 3)));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1, .thread_pool = pool});
  const auto tokens =
      testing_util::random_tokens(static_cast<std::size_t>(cfg.seq_len), cfg.vocab_size, 1);
  // This model is too small for the projections to wake the pool, so its threads may still be
  // starting (and allocating, under a sanitizer) when counting begins. A region whose parts wait
  // for each other cannot close before every worker has joined it: then all have started.
  if (pool != nullptr) {
    std::atomic<std::size_t> entered{0};
    pool->run([&](std::size_t) {
      entered.fetch_add(1);
      while (entered.load() < pool->size()) std::this_thread::yield();
    });
  }
  model.decode(tokens[0], cache, act);  // warm-up outside the counted region
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (std::size_t p = 1; p < tokens.size(); ++p) model.decode(tokens[p], cache, act);
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode";
  EXPECT_EQ(cache.size(), tokens.size());
}

TEST(AllocationTest, DecodeStepAllocatesNothingQ8) {
  expect_quantized_decode_allocates_nothing<Q8_0>(nullptr);
  ThreadPool pool(2);
  expect_quantized_decode_allocates_nothing<Q8_0>(&pool);
}
TEST(AllocationTest, DecodeStepAllocatesNothingQ4) {
  expect_quantized_decode_allocates_nothing<Q4_0>(nullptr);
  ThreadPool pool(2);
  expect_quantized_decode_allocates_nothing<Q4_0>(&pool);
}

// Multi-token f32 Activations hold x_rounded, the bf16-rounded input of bf16 weights' GEMMs,
// only when told the weights are bf16: one buffer (one allocation) of max_chunk × max(dim,
// hidden_dim) fewer for f32 weights, which prefill exactly as before without it.
TEST(AllocationTest, ActivationsForF32WeightsLeaveTheBf16InputOut) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const std::size_t chunk = 8;
  long before = g_allocations.load();
  Activations<float> full(cfg, {.max_chunk = chunk});
  const long full_count = g_allocations.load() - before;
  before = g_allocations.load();
  Activations<float> lean(cfg, {.max_chunk = chunk, .bf16_weights = false});
  const long lean_count = g_allocations.load() - before;
  EXPECT_EQ(full_count - lean_count, 1);
  EXPECT_EQ(full.x_rounded.size(),
            chunk * static_cast<std::size_t>(std::max(cfg.dim, cfg.hidden_dim)));
  EXPECT_TRUE(lean.x_rounded.empty());

  const Model<float> model(random_weights<float>(cfg, 3));
  const auto tokens = testing_util::random_tokens(20, cfg.vocab_size, 2);
  ContiguousStore<float> a(cfg), b(cfg);
  const auto la = model.prefill(tokens, a, full);
  const std::vector<float> expected(la.begin(), la.end());
  const auto lb = model.prefill(tokens, b, lean);
  EXPECT_EQ(std::vector<float>(lb.begin(), lb.end()), expected);

  // bf16 weights need the buffer: the model refuses lean Activations before touching the store.
  const Model<float, bf16> rounded(convert_weights<bf16>(random_weights<float>(cfg, 3)));
  ContiguousStore<float> c(cfg);
  EXPECT_THROW(rounded.prefill(tokens, c, lean), Error);
  EXPECT_EQ(c.size(), 0u);
}

// The counter itself works: each kind of allocation is seen, once.
TEST(AllocationTest, CounterSeesAllocations) {
  long before = g_allocations.load();
  int* volatile p = new int(3);  // volatile: the compiler may not elide the allocation
  delete p;
  EXPECT_EQ(g_allocations.load() - before, 1) << "operator new";

  // volatile function pointers: the compiler may not elide a call it cannot see.
  void* (*volatile c_malloc)(std::size_t) = std::malloc;
  void* (*volatile c_calloc)(std::size_t, std::size_t) = std::calloc;
  void* (*volatile c_realloc)(void*, std::size_t) = std::realloc;
  void* (*volatile c_aligned_alloc)(std::size_t, std::size_t) = std::aligned_alloc;
  int (*volatile c_posix_memalign)(void**, std::size_t, std::size_t) = posix_memalign;
  before = g_allocations.load();
  void* m = c_malloc(24);
  EXPECT_EQ(g_allocations.load() - before, 1) << "malloc";
  m = c_realloc(m, 4096);
  EXPECT_EQ(g_allocations.load() - before, 2) << "realloc";
  std::free(m);
  before = g_allocations.load();
  std::free(c_calloc(3, 8));
  EXPECT_EQ(g_allocations.load() - before, 1) << "calloc";
  before = g_allocations.load();
  std::free(c_aligned_alloc(64, 128));
  EXPECT_EQ(g_allocations.load() - before, 1) << "aligned_alloc";
  before = g_allocations.load();
  void* a = nullptr;
  ASSERT_EQ(c_posix_memalign(&a, 64, 100), 0);
  std::free(a);
  EXPECT_EQ(g_allocations.load() - before, 1) << "posix_memalign";

  // Eigen's allocator (a dynamic-size temporary), whatever the build type.
  before = g_allocations.load();
  {
    const Eigen::VectorXf v = Eigen::VectorXf::Constant(1000, 2.0f);
    EXPECT_EQ(v.sum(), 2000.0f);
  }
  EXPECT_GE(g_allocations.load() - before, 1) << "Eigen::VectorXf";
}

}  // namespace
}  // namespace kvdecode
