// PassCostModel: what one model pass of n tokens costs, fixed + per_token × n, learned from the
// passes an Engine times. The fixed part (every weight read once, the threads started) is what a
// step pays again for each extra sub-pass; SubPassPlanner weighs it against earlier tokens.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <optional>

namespace kvdecode {

/// The cost of one pass over n tokens: fixed_ms + token_ms × n.
struct PassCost {
  double fixed_ms = 0;  ///< paid once per pass, whatever its size
  double token_ms = 0;  ///< paid per token of the pass
  double of(std::size_t tokens) const { return fixed_ms + token_ms * static_cast<double>(tokens); }
};

/// Learns a PassCost from timed passes. Passes are grouped by size class (powers of two: 1,
/// 2–3, 4–7, ...), each class keeping a running mean of its sizes and times, and the line is fitted
/// through the classes' means with equal weight: the many small decode passes of a steady state
/// do not drown the few large prefill passes that fix the slope, and a class forgets old load
/// as it sees new passes. Allocates nothing.
class PassCostModel {
 public:
  /// Records a pass of `tokens` tokens (≥ 1) that took `ms`.
  void add(std::size_t tokens, double ms) {
    if (tokens == 0) return;
    const std::size_t k = std::min<std::size_t>(std::bit_width(tokens) - 1, kClasses - 1);
    Class& c = classes_[k];
    const double n = static_cast<double>(tokens);
    if (c.passes == 0) {
      c.tokens = n;
      c.ms = ms;
    } else {
      // A running mean over the class's latest passes (the weight of a pass decays by 1 - kDecay).
      c.tokens += kDecay * (n - c.tokens);
      c.ms += kDecay * (ms - c.ms);
    }
    ++c.passes;
  }

  /// The least-squares line through the size classes seen; none before two classes have passes
  /// or when the time does not grow with the tokens (then one pass is all a step should run).
  std::optional<PassCost> estimate() const {
    double n = 0, sum_tokens = 0, sum_ms = 0;
    for (const Class& c : classes_) {
      if (c.passes == 0) continue;
      n += 1;
      sum_tokens += c.tokens;
      sum_ms += c.ms;
    }
    if (n < 2) return std::nullopt;
    const double mean_tokens = sum_tokens / n, mean_ms = sum_ms / n;
    double sxx = 0, sxy = 0;
    for (const Class& c : classes_) {
      if (c.passes == 0) continue;
      sxx += (c.tokens - mean_tokens) * (c.tokens - mean_tokens);
      sxy += (c.tokens - mean_tokens) * (c.ms - mean_ms);
    }
    if (sxx <= 0 || sxy <= 0) return std::nullopt;
    const double token_ms = sxy / sxx;
    // A negative intercept is noise around a small fixed cost: a pass is never cheaper than free.
    return PassCost{.fixed_ms = std::max(0.0, mean_ms - token_ms * mean_tokens),
                    .token_ms = token_ms};
  }

 private:
  static constexpr std::size_t kClasses = 24;  // sizes up to 2^24 tokens and beyond
  static constexpr double kDecay = 0.125;      // about the latest eight passes of a class
  struct Class {
    double tokens = 0;  // running mean of the class's pass sizes
    double ms = 0;      // running mean of their times
    std::size_t passes = 0;
  };
  std::array<Class, kClasses> classes_{};  // [kClasses] one per power-of-two pass size
};

}  // namespace kvdecode
