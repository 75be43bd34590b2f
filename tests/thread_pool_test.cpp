// ThreadPool: every part of every region runs exactly once, on at most one thread at a time,
// whether workers join in time or not (more threads than cores makes some of them late); an
// exception thrown by a part reaches the caller and the pool goes on working. run_items: every
// item once, a part's items on one thread at a time, and a held-up part's share taken by the
// others.
#include "kvdecode/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
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

/// Runs `regions` run_items regions of n_items items on pool (or inline without one); item i of
/// region r adds r + 1 to hits[i], and no two threads are inside one part at once.
void run_item_regions(ThreadPool* pool, std::size_t n_items, std::size_t regions) {
  const std::size_t parts = pool == nullptr ? 1 : pool->size();
  std::vector<std::atomic<std::size_t>> hits(n_items);
  std::vector<std::atomic<int>> inside(parts);
  std::atomic<std::size_t> overlaps{0};
  std::atomic<std::size_t> bad_parts{0};
  for (std::size_t r = 0; r < regions; ++r) {
    run_items(pool, n_items, [&](std::size_t i, std::size_t part) {
      if (part >= parts) {
        bad_parts.fetch_add(1);
        return;
      }
      if (inside[part].fetch_add(1) != 0) overlaps.fetch_add(1);
      hits[i].fetch_add(r + 1);
      inside[part].fetch_sub(1);
    });
  }
  const std::size_t expected = regions * (regions + 1) / 2;
  for (std::size_t i = 0; i < n_items; ++i)
    ASSERT_EQ(hits[i].load(), expected) << "item " << i << " of " << n_items;
  EXPECT_EQ(overlaps.load(), 0u);
  EXPECT_EQ(bad_parts.load(), 0u);
}

TEST(ThreadPoolTest, RunItemsRunsEveryItemExactlyOnce) {
  for (const std::size_t threads : {1u, 2u, 3u, 5u}) {
    ThreadPool pool(threads);
    // Fewer items than parts, one each, a remainder, many.
    for (const std::size_t items : {0u, 1u, 2u, 3u, 4u, 7u, 64u, 1001u})
      run_item_regions(&pool, items, items > 100 ? 200 : 2000);
  }
  run_item_regions(nullptr, 9, 10);
}

TEST(ThreadPoolTest, OversubscribedPoolsStillRunEveryItemOnce) {
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([] {
      ThreadPool pool(3);
      run_item_regions(&pool, 50, 2000);
    });
  for (auto& t : callers) t.join();
}

// The thread that claims the first item of part 1's share waits there until every other item
// is done: the other thread must take the rest of that share too (with one fixed share per
// thread it would wait forever; the wait gives up after 20 s so that the test fails, not hangs).
TEST(ThreadPoolTest, RunItemsTakesTheShareOfAHeldUpPart) {
  ThreadPool pool(2);
  for (const std::size_t n : {2u, 10u, 101u}) {
    const std::size_t held = ThreadPool::share(n, 2, 1).first;  // first item of part 1's share
    std::atomic<std::size_t> others_done{0};
    std::atomic<bool> gave_up{false};
    std::vector<std::atomic<int>> hits(n);
    pool.run_items(n, [&](std::size_t i, std::size_t) {
      if (i == held) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (others_done.load() != n - 1) {
          if (std::chrono::steady_clock::now() > deadline) {
            gave_up = true;
            break;
          }
          std::this_thread::yield();
        }
      } else {
        others_done.fetch_add(1);
      }
      hits[i].fetch_add(1);
    });
    EXPECT_FALSE(gave_up.load()) << n << " items: the held-up share was not taken";
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "item " << i;
  }
}

TEST(ThreadPoolTest, AnExceptionInAnItemReachesTheCallerAndThePoolGoesOn) {
  ThreadPool pool(3);
  for (int round = 0; round < 100; ++round) {
    EXPECT_THROW(pool.run_items(30,
                                [&](std::size_t i, std::size_t) {
                                  if (i == static_cast<std::size_t>(round % 30))
                                    throw std::runtime_error("item failed");
                                }),
                 std::runtime_error);
  }
  run_item_regions(&pool, 30, 1000);
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
