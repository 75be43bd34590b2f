// A serving request and the handle its caller keeps: what to generate (prompt, sampling, limits,
// stop tokens), and RequestStream, through which the engine's step thread hands over tokens as
// they are sampled and the caller, on any thread, reads them, waits, or cancels.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

#include "kvdecode/generation/sampler.hpp"

namespace kvdecode {

/// What one request asks of an Engine.
struct RequestOptions {
  std::vector<std::int32_t> prompt{};  ///< token ids; the last one's logits give the first token
  SamplerOptions sampling{.temperature = 0.0};  ///< greedy unless set; the seed is per request
  std::size_t max_tokens = 16;                  ///< tokens to generate at most, >= 1
  /// Generation ends after emitting any of these (the stop token is part of the output, as in
  /// generate()).
  std::vector<std::int32_t> stop_tokens{};
  /// Called on the engine's step thread with each token as soon as it is sampled, before the
  /// stream sees it. Must be quick and must not call back into the engine.
  std::function<void(std::int32_t)> on_token{};
};

/// Why a request ended.
enum class FinishReason {
  kRunning,      ///< not finished yet
  kStopToken,    ///< emitted one of its stop tokens
  kMaxTokens,    ///< generated max_tokens
  kContextFull,  ///< the sequence reached the pool's capacity
  kCancelled,    ///< RequestStream::cancel()
  kStopString,  ///< RequestStream::stop(): the caller found its own end (a stop string) in the text
  kError,       ///< the step failed; error() says why
};

inline std::string_view to_string(FinishReason r) {
  switch (r) {
    case FinishReason::kRunning:
      return "running";
    case FinishReason::kStopToken:
      return "stop";
    case FinishReason::kMaxTokens:
      return "length";
    case FinishReason::kContextFull:
      return "context_full";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

/// What a request cost, as its caller may report it (an API's "usage").
struct RequestUsage {
  std::size_t prompt_tokens = 0;  ///< tokens of the prompt
  std::size_t cached_tokens = 0;  ///< prompt tokens found in the prefix cache at admission
  std::size_t cached_from_disk_tokens = 0;  ///< of those, loaded from the prefix tier's files
  std::size_t prefilled_tokens = 0;         ///< prompt tokens computed (prompt - cached)
  std::size_t recomputed_tokens = 0;        ///< tokens computed again after preemptions
  std::size_t generated_tokens = 0;
  std::size_t preemptions = 0;
  double queue_ms = 0;  ///< submission to first admission
  double ttft_ms = 0;   ///< submission to the first token
};

namespace detail {
/// How a handle wakes the engine's step loop (a cancellation should not wait for the next step).
struct WakeSignal {
  std::mutex mutex;
  std::condition_variable_any cv;
  bool pending = false;
  void notify() {
    {
      std::lock_guard lock(mutex);
      pending = true;
    }
    cv.notify_all();
  }
};

/// Wakes every reader that waits for a next token on any stream of an engine, with one call
/// per pass: a pass appends a token to each of its streams, and a wake-up per stream can hand
/// the step thread's core to each reader in turn before the next pass starts. A reader notes
/// the generation, looks at its stream, then sleeps while the generation has not moved. Linux:
/// one futex wake for all; elsewhere a condition variable's notify_all.
class ReaderSignal {
 public:
  std::uint32_t generation() const { return generation_.load(std::memory_order_acquire); }

  void wake_all() {
#if defined(__linux__)
    generation_.fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, futex_word(), FUTEX_WAKE_PRIVATE, std::numeric_limits<int>::max(), nullptr,
            nullptr, 0);
#else
    {
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
#endif
  }

  /// Sleeps while the generation is `seen`, at most `timeout` (a spurious return is allowed).
  void wait(std::uint32_t seen, std::chrono::nanoseconds timeout) {
#if defined(__linux__)
    const auto ns = std::max<std::int64_t>(0, timeout.count());
    timespec relative{.tv_sec = static_cast<std::time_t>(ns / 1'000'000'000),
                      .tv_nsec = static_cast<long>(ns % 1'000'000'000)};
    syscall(SYS_futex, futex_word(), FUTEX_WAIT_PRIVATE, seen, &relative, nullptr, 0);
#else
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, timeout, [&] { return generation() != seen; });
#endif
  }

 private:
#if defined(__linux__)
  std::uint32_t* futex_word() { return reinterpret_cast<std::uint32_t*>(&generation_); }
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
#else
  std::mutex mutex_;
  std::condition_variable cv_;
#endif
  std::atomic<std::uint32_t> generation_{0};
};
}  // namespace detail

/// The caller's side of one request: thread-safe. The engine appends tokens (the vector was
/// reserved for max_tokens at submission, so appending allocates nothing) and finishes it once.
class RequestStream {
 public:
  enum class Wait { kToken, kFinished, kTimeout };

  RequestStream(std::uint64_t id, std::size_t max_tokens, std::shared_ptr<detail::WakeSignal> wake,
                std::shared_ptr<detail::ReaderSignal> readers)
      : id_(id), wake_(std::move(wake)), readers_(std::move(readers)) {
    tokens_.reserve(max_tokens);
  }

  /// The engine's number for this request (unique per engine, from 1).
  std::uint64_t id() const { return id_; }

  /// Asks the engine to stop the request; it releases its blocks at its next step and finishes
  /// it with kCancelled (unless it finished first).
  void cancel() {
    cancel_requested_.store(true, std::memory_order_release);  // after stop()'s flag
    wake_->notify();
  }
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }

  /// Ends the request as complete, not abandoned: the caller found the end of the text itself
  /// (a stop string, which only the text shows). Like cancel(), its blocks are released at the
  /// engine's next step; it finishes with kStopString (unless it finished first) and counts as
  /// finished in the metrics, not as cancelled.
  void stop() {
    stop_requested_.store(true, std::memory_order_relaxed);
    cancel();
  }
  bool stop_requested() const { return stop_requested_.load(std::memory_order_relaxed); }

  /// The next token not yet read by next(): waits up to `timeout` for it. kFinished once the
  /// request has ended and every token has been read.
  ///
  /// Until its first token a request may wait in the queue for many passes, so its reader sleeps
  /// on the stream's own condition variable (the first token and the finish wake it); after it,
  /// on the engine's ReaderSignal, which each pass wakes once for all its streams.
  Wait next_for(std::int32_t& token, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const std::uint32_t seen = readers_->generation();  // before looking, so no wake is lost
      std::unique_lock lock(mutex_);
      if (read_ < tokens_.size()) {
        token = tokens_[read_++];
        return Wait::kToken;
      }
      if (reason_ != FinishReason::kRunning) return Wait::kFinished;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return Wait::kTimeout;
      if (tokens_.empty()) {
        cv_.wait_until(lock, deadline);
      } else {
        lock.unlock();
        readers_->wait(seen, deadline - now);
      }
    }
  }
  /// next_for without a time limit: false once finished and drained.
  bool next(std::int32_t& token) {
    for (;;) {
      const Wait w = next_for(token, std::chrono::milliseconds(1000));
      if (w != Wait::kTimeout) return w == Wait::kToken;
    }
  }

  /// Waits until the request has ended.
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return reason_ != FinishReason::kRunning; });
  }
  /// Waits up to `timeout`; whether the request has ended.
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return reason_ != FinishReason::kRunning; });
  }

  bool finished() const {
    std::lock_guard lock(mutex_);
    return reason_ != FinishReason::kRunning;
  }
  FinishReason finish_reason() const {
    std::lock_guard lock(mutex_);
    return reason_;
  }
  /// Every token generated so far (a copy).
  std::vector<std::int32_t> tokens() const {
    std::lock_guard lock(mutex_);
    return tokens_;
  }
  RequestUsage usage() const {
    std::lock_guard lock(mutex_);
    return usage_;
  }
  /// The message of a kError finish, else empty.
  std::string error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }

  // ---------------------------------------------------------------------------------------------
  // The engine's side (its step thread only).

  /// Appends a token. Only the first wakes the reader; the engine wakes the readers of later
  /// ones after the pass (ReaderSignal::wake_all).
  void push(std::int32_t token, const RequestUsage& usage) {
    bool first = false;
    {
      std::lock_guard lock(mutex_);
      first = tokens_.empty();
      tokens_.push_back(token);  // within the reservation: at most max_tokens
      usage_ = usage;
    }
    if (first) cv_.notify_all();
  }
  void finish(FinishReason reason, const RequestUsage& usage, std::string error = {}) {
    {
      std::lock_guard lock(mutex_);
      reason_ = reason;
      usage_ = usage;
      error_ = std::move(error);
    }
    cv_.notify_all();
    readers_->wake_all();
  }

 private:
  const std::uint64_t id_;
  std::shared_ptr<detail::WakeSignal> wake_;
  std::shared_ptr<detail::ReaderSignal> readers_;
  std::atomic<bool> cancel_requested_{false};
  std::atomic<bool> stop_requested_{false};  // set before cancel_requested_
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::int32_t> tokens_;  // [≤ max_tokens] generated so far
  std::size_t read_ = 0;              // tokens handed out by next()
  FinishReason reason_ = FinishReason::kRunning;
  RequestUsage usage_;
  std::string error_;
};

}  // namespace kvdecode
