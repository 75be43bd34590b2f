// SubPassPlanner: how an Engine step splits its planned work into sub-passes, so that sequences
// whose prompt completes early in the step publish their first token after their own sub-pass
// instead of at the end of the whole step. Each extra pass costs the fixed part of a PassCost.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "kvdecode/serving/pass_cost_model.hpp"

namespace kvdecode {

/// The work of one step, in run order: `decoders` decoding sequences (one token each; they ride
/// in the first sub-pass, but their next token waits for the step's end whichever pass
/// publishes this one, so they count as waiting for the end), then the sequences whose prompt
/// completes this step (each samples its first token after its sub-pass), then `rest_tokens` of
/// prompt chunks that do not complete (they end the step, alone or in the last sub-pass).
struct SubPassWork {
  std::size_t decoders = 0;
  std::span<const std::size_t> prompts{};  ///< [n] tokens of each completing prompt, run order
  std::size_t rest_tokens = 0;
  /// Sequences and requests that get nothing from this step and wait for its end (prompts not
  /// completing, running sequences without a row, queued requests).
  std::size_t waiting = 0;
};

/// Chooses the sub-passes of a step that minimise the sum, over every sequence and request
/// the engine holds, of the time it waits on the step: a completing prompt until its first
/// token (the end of its sub-pass), every other one until the end of the step (the earliest its
/// next token or row can come). Sub-passes only end after a completing prompt, so a step without
/// completing prompts is one pass, and each extra pass must save the first tokens before it more
/// than its fixed cost delays everyone after it. An exact dynamic programme over the split points:
/// O(n²) for n completing prompts; allocates nothing after construction.
class SubPassPlanner {
 public:
  /// For steps with at most max_prompts completing prompts.
  explicit SubPassPlanner(std::size_t max_prompts)
      : best_(max_prompts + 2), from_(max_prompts + 2), ends_(max_prompts + 2) {}

  /// The sub-passes as ends over the step's items (the prompts, then the rest as one item when
  /// rest_tokens > 0): sub-pass g runs items [ends[g-1], ends[g]) (from 0 for g = 0), plus the
  /// decoders in sub-pass 0. One element, the item count, when one pass is best; {0} for decoders
  /// alone. The span lives until the next plan().
  std::span<const std::size_t> plan(const SubPassWork& work, const PassCost& cost) {
    const std::size_t n = work.prompts.size();
    const std::size_t items = n + (work.rest_tokens > 0 ? 1 : 0);
    if (n == 0 || items + 1 > best_.size()) {  // nothing to split (or more than planned for)
      ends_[0] = items;
      best_last_ = 0;
      return {ends_.data(), 1};
    }
    // best_[j]: the least cost of items [0, j) with a sub-pass ending at j; from_[j]: where
    // that last sub-pass starts. A sub-pass from i to j lasts cost.of(its tokens) and delays
    // everyone not yet served when it starts.
    const auto tokens_of = [&](std::size_t i) {
      return i < n ? work.prompts[i] : work.rest_tokens;
    };
    best_[0] = 0;
    for (std::size_t j = 1; j <= items; ++j) {
      best_[j] = std::numeric_limits<double>::infinity();
      std::size_t tokens = 0;
      for (std::size_t i = j; i-- > 0;) {  // sub-pass [i, j), grown backwards
        tokens += tokens_of(i);
        const std::size_t served_before = std::min(i, n);  // prompts already given a token
        const std::size_t pending = (n - served_before) + work.waiting + work.decoders;
        const double c = best_[i] + cost.of(tokens + (i == 0 ? work.decoders : 0)) *
                                        static_cast<double>(pending);
        if (c <= best_[j]) {  // ties: the larger sub-pass (fewer passes)
          best_[j] = c;
          from_[j] = i;
        }
      }
    }
    best_last_ = best_[items];
    std::size_t count = 0;
    for (std::size_t j = items; j > 0; j = from_[j]) ends_[count++] = j;
    for (std::size_t a = 0, b = count - 1; a < b; ++a, --b) std::swap(ends_[a], ends_[b]);
    return {ends_.data(), count};
  }

  /// The sum above for the latest plan (0 when it had nothing to split), in the PassCost's unit
  /// times sequences.
  double cost() const { return best_last_; }

 private:
  std::vector<double> best_;       // [max_prompts + 2] least cost of the first j items
  std::vector<std::size_t> from_;  // [max_prompts + 2] start of the last sub-pass of best_[j]
  std::vector<std::size_t> ends_;  // [max_prompts + 2] the plan returned
  double best_last_ = 0;
};

}  // namespace kvdecode
