// ThreadPool: a fixed set of persistent worker threads that run one parallel region at a time,
// woken through atomics (spin briefly, then futex-wait), so a decode step's ~100 regions cost
// microseconds, not thread launches. Parts of a region are claimed, not assigned, so a worker the
// OS has descheduled never holds the caller up; run_items deals a region's items out in one
// contiguous share per part, taken over by the others when a part falls behind. Plain
// std::thread; nothing depends on OpenMP.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "kvdecode/detail/cpu.hpp"  // <immintrin.h> for _mm_pause, its warnings silenced
#include "kvdecode/error.hpp"

namespace kvdecode {

/// Runs the parts 0 .. n_threads-1 of a region on up to n_threads threads: the calling thread
/// and n_threads-1 workers claim parts from a shared counter until none is left. The caller owns
/// the pool and passes a pointer to it in Activations; a Model never owns threads, so it stays
/// immutable and shareable.
///
/// Why claim parts: on a loaded machine (more runnable threads than cores) a worker may not run
/// for a whole scheduler time slice, milliseconds, and a decode step has ~100 regions. With
/// fixed assignment every region would wait for it; here the caller takes the absent worker's
/// part, closes the region, and waits only for workers that had already joined it. A worker
/// that wakes after the close skips the region. Two parts never run at once on one thread, so
/// per-part scratch (indexed by the part) is never shared.
///
/// One region runs at a time: run() must not be called concurrently on one pool nor from inside
/// a region (one pool per decoding thread). A region's function must not throw through run()
/// without care: the first exception any thread throws is rethrown by run() after all threads
/// have finished the region.
class ThreadPool {
 public:
  /// n_threads counts the caller; 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(std::size_t n_threads = 0) {
    if (n_threads == 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
    KVDECODE_CHECK(n_threads <= 1024, "ThreadPool: ", n_threads,
                   " threads requested, at most 1024");
    n_threads_ = n_threads;
    shares_ = std::make_unique<Share[]>(n_threads);
    workers_.reserve(n_threads - 1);
    for (std::size_t i = 1; i < n_threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (auto& t : workers_) t.join();
  }

  /// Threads a region runs on, the caller included.
  std::size_t size() const { return n_threads_; }

  /// Calls f(part) exactly once for each part in [0, size()), on the caller and whichever workers
  /// join in time, and returns when all calls have returned. Allocates nothing: f is
  /// referenced, not copied.
  template <class F>
  void run(F&& f) {
    if (n_threads_ == 1) {
      f(std::size_t{0});
      return;
    }
    using Fn = std::remove_reference_t<F>;
    ctx_ = const_cast<void*>(static_cast<const void*>(&f));
    call_ = [](void* ctx, std::size_t i) { (*static_cast<Fn*>(ctx))(i); };
    next_part_.store(0, std::memory_order_relaxed);
    // Reopen (release: a worker that joins sees ctx_ and call_). Clearing only the bit keeps the
    // count of late workers that are stepping out of the previous, closed region.
    joined_.fetch_and(~kClosed, std::memory_order_acq_rel);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    run_parts();
    // Every part is claimed. Close the region so late workers skip it, then wait for the ones
    // inside (they finish within microseconds in a balanced region: spin, then sleep).
    std::uint64_t inside = joined_.fetch_or(kClosed, std::memory_order_acq_rel) & ~kClosed;
    for (int spin = 0; inside != 0; ++spin) {
      if (spin < kSpins) {
        pause();
      } else {
        joined_.wait(kClosed | inside, std::memory_order_acquire);
      }
      inside = joined_.load(std::memory_order_acquire) & ~kClosed;
    }
    if (error_) {
      std::exception_ptr e = std::exchange(error_, nullptr);
      error_claimed_.store(false);
      std::rethrow_exception(e);
    }
  }

  /// Calls f(item, part) exactly once for each item in [0, n_items), on the caller and whichever
  /// workers join in time (part as in run(): per-part scratch stays unshared). Each part owns a
  /// contiguous share of the items and claims them through a counter of its own, so claiming
  /// does not move a cache line between cores (a shared counter costs a core-to-core transfer
  /// per item); a part whose share is done takes items from the others', so a thread the OS
  /// delays holds the region up by one item at most. Allocates nothing.
  template <class F>
  void run_items(std::size_t n_items, F&& f) {
    if (n_threads_ == 1 || n_items <= 1) {
      for (std::size_t i = 0; i < n_items; ++i) f(i, std::size_t{0});
      return;
    }
    // Published to the workers by run()'s reopening of the region (release).
    for (std::size_t p = 0; p < n_threads_; ++p) {
      const auto [begin, end] = share(n_items, n_threads_, p);
      shares_[p].next.store(begin, std::memory_order_relaxed);
      shares_[p].end = end;
    }
    run([&](std::size_t part) {
      for (std::size_t k = 0; k < n_threads_; ++k) {
        Share& s = shares_[(part + k) % n_threads_];
        for (std::size_t i = s.next.fetch_add(1, std::memory_order_relaxed); i < s.end;
             i = s.next.fetch_add(1, std::memory_order_relaxed))
          f(i, part);
      }
    });
  }

  /// The half-open range [begin, end) of `count` items that part `part` of `parts` takes:
  /// near-equal shares whose boundaries are multiples of `align` (except the last end), so SIMD
  /// row blocks never straddle two threads.
  static std::pair<std::size_t, std::size_t> share(std::size_t count, std::size_t parts,
                                                   std::size_t part, std::size_t align = 1) {
    const std::size_t units = (count + align - 1) / align;
    const std::size_t begin = std::min(count, units * part / parts * align);
    const std::size_t end = std::min(count, units * (part + 1) / parts * align);
    return {begin, end};
  }

 private:
  // Pauses before sleeping: enough to span any gap between a decode step's regions, few enough
  // that an idle pool sleeps almost at once (a pause lasts some ns to tens of ns by CPU model).
  static constexpr int kSpins = 1 << 13;

  static void pause() {
#if KVDECODE_X86_KERNELS
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  /// Claims and runs parts until none is left (caller and workers alike).
  void run_parts() {
    for (std::size_t p = next_part_.fetch_add(1, std::memory_order_relaxed); p < n_threads_;
         p = next_part_.fetch_add(1, std::memory_order_relaxed)) {
      try {
        call_(ctx_, p);
      } catch (...) {
        record(std::current_exception());
      }
    }
  }

  void work() {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t g = generation_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen; ++spin) {
        if (spin < kSpins) {
          pause();
        } else {
          generation_.wait(seen, std::memory_order_acquire);
        }
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      // Join the open region, if it still is: a region the caller has closed may already be
      // gone (its function was on the caller's stack), and a newer one will bump the
      // generation again. Joining a newer open region than `g` is fine: its parts are claimed.
      if ((joined_.fetch_add(1, std::memory_order_acq_rel) & kClosed) == 0) run_parts();
      if (joined_.fetch_sub(1, std::memory_order_acq_rel) == (kClosed | 1)) joined_.notify_one();
    }
  }

  void record(std::exception_ptr e) {
    bool expected = false;
    if (error_claimed_.compare_exchange_strong(expected, true)) error_ = std::move(e);
  }

  // One part's items in run_items: the next unclaimed one and the end of its share.
  struct alignas(64) Share {
    std::atomic<std::size_t> next{0};
    std::size_t end = 0;
  };

  std::size_t n_threads_ = 1;
  std::unique_ptr<Share[]> shares_;   // [n_threads], each on a cache line of its own
  std::vector<std::thread> workers_;  // [n_threads - 1]
  // A worker starts a region after a core-to-core transfer per cache line it needs, so what it
  // reads first shares one line (the region and its generation) and what it then updates shares
  // another (joining, claiming a part).
  // The current region: written by the caller before the generation bump (release), read by
  // workers after seeing it (acquire).
  alignas(64) std::atomic<std::uint64_t> generation_{0};  // bumped once per region
  void (*call_)(void*, std::size_t) = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<std::size_t> next_part_{0};  // the next unclaimed part
  // Workers inside the current region, plus kClosed once the caller has closed it.
  std::atomic<std::uint64_t> joined_{kClosed};
  static constexpr std::uint64_t kClosed = std::uint64_t{1} << 63;
  std::atomic<bool> stop_{false};
  std::atomic<bool> error_claimed_{false};
  std::exception_ptr error_;
};

/// Runs f(thread_index, n_threads) on every thread of pool, or f(0, 1) inline without one.
template <class F>
inline void parallel_run(ThreadPool* pool, F&& f) {
  if (pool == nullptr || pool->size() == 1) {
    f(std::size_t{0}, std::size_t{1});
    return;
  }
  const std::size_t n = pool->size();
  pool->run([&](std::size_t i) { f(i, n); });
}

/// Runs f(item, part) for each item in [0, n_items) on pool's threads (ThreadPool::run_items),
/// or in order on the caller (part 0) without one.
template <class F>
inline void run_items(ThreadPool* pool, std::size_t n_items, F&& f) {
  if (pool == nullptr) {
    for (std::size_t i = 0; i < n_items; ++i) f(i, std::size_t{0});
    return;
  }
  pool->run_items(n_items, f);
}

}  // namespace kvdecode
