// EngineMetrics: a snapshot of a serving Engine's state and counters since construction, safe to
// take from any thread (Engine::metrics()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvdecode/serving/latency_histogram.hpp"
#include "kvdecode/serving/prefix_tier.hpp"

namespace kvdecode {

struct EngineMetrics {
  // State at the end of the latest step.
  std::size_t queued = 0;         ///< requests waiting for admission (new or preempted)
  std::size_t running = 0;        ///< admitted sequences (prefilling or decoding)
  std::size_t blocks_total = 0;   ///< blocks of the pool
  std::size_t blocks_held = 0;    ///< blocks some sequence holds
  std::size_t blocks_free = 0;    ///< never written or released uncached
  std::size_t blocks_cached = 0;  ///< cached and held by no sequence (reusable, else evictable)

  // Counters.
  std::uint64_t steps = 0;
  std::uint64_t passes = 0;  ///< model passes run: a step's sub-passes count one each
  std::uint64_t submitted = 0;
  std::uint64_t finished = 0;  ///< ended by a stop token, max_tokens or the context
  std::uint64_t cancelled = 0;
  std::uint64_t failed = 0;
  std::uint64_t preemptions = 0;
  std::uint64_t prompt_tokens = 0;      ///< prompt tokens of admitted requests
  std::uint64_t tokens_reused = 0;      ///< of those, found in the prefix cache (memory or disk)
  std::uint64_t tokens_from_disk = 0;   ///< of those reused, loaded from the prefix tier's files
  std::uint64_t tokens_prefilled = 0;   ///< of those, computed
  std::uint64_t tokens_recomputed = 0;  ///< computed again after a preemption
  std::uint64_t tokens_generated = 0;
  std::uint64_t prefix_block_hits = 0;       ///< full prompt blocks found in the pool's memory
  std::uint64_t prefix_block_disk_hits = 0;  ///< full prompt blocks loaded from the tier's files
  std::uint64_t prefix_block_misses = 0;     ///< full prompt blocks found in neither
  std::uint64_t evictions = 0;               ///< cached blocks reused for other data

  bool prefix_tier = false;  ///< a prefix directory is attached (EngineOptions::prefix_dir)
  /// The tier's counters: files written / evicted, write failures, files skipped by TierSkip
  /// reason, files and bytes on disk. All 0 without a tier.
  PrefixTierStats tier{};

  LatencyHistogram ttft;  ///< submission to first token, per request
  LatencyHistogram itl;   ///< between consecutive tokens of a request

  /// Share of admitted prompt tokens served from the prefix cache.
  double prefix_hit_rate() const {
    return prompt_tokens == 0
               ? 0.0
               : static_cast<double>(tokens_reused) / static_cast<double>(prompt_tokens);
  }
};

}  // namespace kvdecode
