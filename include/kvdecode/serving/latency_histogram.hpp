// LatencyHistogram: durations counted in logarithmic buckets, so a serving engine can report
// percentiles of time to first token and inter-token latency without storing every sample or
// allocating after construction.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvdecode {

/// Counts of durations in buckets whose bounds grow by 2^(1/8) (about 9 % apart) from 1 µs to
/// about 2^28 µs (4.5 minutes); longer ones land in the last bucket. A percentile is the upper
/// bound of the bucket holding it, so it is at most 9 % above the true value. Fixed size: adding
/// a sample allocates nothing.
class LatencyHistogram {
 public:
  static constexpr std::size_t kPerOctave = 8;
  static constexpr std::size_t kBuckets = 28 * kPerOctave + 1;

  /// Adds one duration in milliseconds (negative ones count as 0).
  void add(double ms) {
    const double us = std::max(ms, 0.0) * 1e3;
    std::size_t b = 0;
    if (us > 1.0) {
      const double k = std::ceil(std::log2(us) * static_cast<double>(kPerOctave));
      b = std::min(kBuckets - 1, static_cast<std::size_t>(k));
    }
    ++counts_[b];
    ++count_;
    sum_ms_ += std::max(ms, 0.0);
    max_ms_ = std::max(max_ms_, ms);
  }

  std::uint64_t count() const { return count_; }
  double mean_ms() const { return count_ == 0 ? 0 : sum_ms_ / static_cast<double>(count_); }
  double max_ms() const { return max_ms_; }

  /// The q-quantile (q in [0, 1]) in milliseconds: the upper bound of the bucket holding the
  /// ceil(q × count)-th smallest sample, capped at the largest sample; 0 when empty.
  double percentile_ms(double q) const {
    if (count_ == 0) return 0;
    const auto rank = std::max<std::uint64_t>(
        1, static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(count_))));
    std::uint64_t seen = 0;
    for (std::size_t b = 0; b < kBuckets; ++b) {
      seen += counts_[b];
      if (seen >= rank) return std::min(max_ms_, upper_ms(b));
    }
    return max_ms_;
  }

  /// The upper bound of bucket b in milliseconds: 2^(b / kPerOctave) µs.
  static double upper_ms(std::size_t b) {
    return std::exp2(static_cast<double>(b) / static_cast<double>(kPerOctave)) * 1e-3;
  }

 private:
  std::array<std::uint64_t, kBuckets> counts_{};  // [kBuckets] samples in (upper(b-1), upper(b)]
  std::uint64_t count_ = 0;
  double sum_ms_ = 0;
  double max_ms_ = 0;
};

}  // namespace kvdecode
