// ThreadPool: every part of every region runs exactly once, on at most one thread at a time,
// whether workers join in time or not (more threads than cores makes some of them late); an
// exception thrown by a part reaches the caller and the pool goes on working.
#include "kvdecode/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kvdecode {
namespace {

/// Runs `regions` regions on pool; part p of region r adds r + 1 to hits[p] and checks no
/// other thread is inside the same part at once.
void run_regions(ThreadPool& pool, std::size_t regions) {
  const std::size_t n = pool.size();
  std::vector<std::atomic<std::size_t>> hits(n);
  std::vector<std::atomic<int>> inside(n);
  std::atomic<std::size_t> overlaps{0};
  for (std::size_t r = 0; r < regions; ++r) {
    pool.run([&](std::size_t part) {
      ASSERT_LT(part, n);
      if (inside[part].fetch_add(1) != 0) overlaps.fetch_add(1);
      hits[part].fetch_add(r + 1);
      inside[part].fetch_sub(1);
    });
  }
  const std::size_t expected = regions * (regions + 1) / 2;  // Σ (r + 1): each part once a region
  for (std::size_t p = 0; p < n; ++p) EXPECT_EQ(hits[p].load(), expected) << "part " << p;
  EXPECT_EQ(overlaps.load(), 0u);
}

TEST(ThreadPoolTest, EveryPartRunsExactlyOncePerRegion) {
  for (const std::size_t threads : {1u, 2u, 3u, 5u}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    run_regions(pool, 20000);
  }
}

// Four pools of three threads on a machine of fewer cores, all running regions at once: workers
// are often descheduled and join late or not at all; the parts must still all run, once.
TEST(ThreadPoolTest, OversubscribedPoolsStillRunEveryPartOnce) {
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([] {
      ThreadPool pool(3);
      run_regions(pool, 5000);
    });
  for (auto& t : callers) t.join();
}

TEST(ThreadPoolTest, AnExceptionInAPartReachesTheCallerAndThePoolGoesOn) {
  ThreadPool pool(3);
  for (int round = 0; round < 100; ++round) {
    std::atomic<std::size_t> ran{0};
    EXPECT_THROW(pool.run([&](std::size_t part) {
      ran.fetch_add(1);
      if (part == static_cast<std::size_t>(round % 3)) throw std::runtime_error("part failed");
    }),
                 std::runtime_error);
    EXPECT_EQ(ran.load(), 3u);  // the other parts still ran
  }
  run_regions(pool, 1000);
}

TEST(ThreadPoolTest, ParallelRunHandsEachPartItsIndexAndTheCount) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> seen(4);
  parallel_run(&pool, [&](std::size_t part, std::size_t parts) {
    EXPECT_EQ(parts, 4u);
    seen[part].fetch_add(1);
  });
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
  int inline_calls = 0;
  parallel_run(nullptr, [&](std::size_t part, std::size_t parts) {
    EXPECT_EQ(part, 0u);
    EXPECT_EQ(parts, 1u);
    ++inline_calls;
  });
  EXPECT_EQ(inline_calls, 1);
}

}  // namespace
}  // namespace kvdecode
