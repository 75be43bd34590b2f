// AppendLedger: the bookkeeping every single-sequence store shares — committed and pending
// positions, their token ids, the capacity — and the checks of an append transaction, so each
// store keeps only what is its own (its rows and how it reads them).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/error.hpp"

namespace kvdecode::detail {

class AppendLedger {
 public:
  AppendLedger() = default;
  /// `store` names the store in error messages ("ContiguousStore").
  AppendLedger(const char* store, std::size_t capacity)
      : store_(store), capacity_(capacity), tokens_(capacity) {}

  std::size_t size() const { return size_; }
  std::size_t pending() const { return pending_; }
  std::size_t capacity() const { return capacity_; }
  /// Positions an append may still bring before the capacity.
  std::size_t room() const { return capacity_ - size_; }
  /// The token ids of the committed positions.
  std::span<const std::int32_t> tokens() const { return {tokens_.data(), size_}; }

  /// Throws Error, changing nothing, unless an append of n positions can begin: none is open
  /// and the positions fit the capacity.
  void check_begin(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::begin_append: ", pending_,
                   " positions are already pending");
    KVDECODE_CHECK(n <= capacity_ - size_, store_, ": appending ", n, " positions to ", size_,
                   " would exceed the capacity of ", capacity_);
  }
  /// check_begin, then records the ids of the pending positions.
  void begin(std::span<const std::int32_t> tokens) {
    check_begin(tokens.size());
    std::copy(tokens.begin(), tokens.end(), tokens_.data() + size_);
    pending_ = tokens.size();
  }
  void commit() {
    size_ += pending_;
    pending_ = 0;
  }
  void cancel() noexcept { pending_ = 0; }

  /// Throws Error unless the sequence can be cut to its first n positions: no open append,
  /// n ≤ size().
  void check_truncate(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::truncate during an append");
    KVDECODE_CHECK(n <= size_, store_, "::truncate(", n, ") beyond size ", size_);
  }
  void truncate(std::size_t n) {
    check_truncate(n);
    size_ = n;
  }
  void reset() {
    size_ = 0;
    pending_ = 0;
  }

  /// Makes this ledger equal to other (same capacity).
  void copy_from(const AppendLedger& other) {
    tokens_.copy_from(other.tokens_);
    size_ = other.size_;
    pending_ = other.pending_;
  }

 private:
  const char* store_ = "store";
  std::size_t capacity_ = 0;
  std::size_t size_ = 0;
  std::size_t pending_ = 0;
  AlignedBuffer<std::int32_t> tokens_;  // [capacity] token id of each position
};

}  // namespace kvdecode::detail
