// SequenceLedger: the bookkeeping every store keeps about the sequence it holds (committed
// length, the open append, the capacity, the token ids) and the checks of the append
// transaction, written once so each store keeps only what its memory layout adds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvdecode/error.hpp"

namespace kvdecode {

/// The positions a store holds, as the KvStore concept counts them: `size()` committed ones,
/// `pending()` ones of an open append, at most `capacity()` in all, and their token ids.
///
/// A store forwards begin_append / commit_append / cancel_append / truncate / reset to it and
/// does its own part (writing rows, saving what a cancel must restore) around the call. A
/// store with rules of its own checks them between `check_append(n)` and `begin_append`, or
/// between `check_truncate(n)` and `truncate`, so every check runs before anything changes.
/// Errors name the store (`store`, e.g. "ContiguousStore").
class SequenceLedger {
 public:
  SequenceLedger() = default;
  /// A ledger for at most `capacity` positions (std::size_t(-1): no limit) whose token ids are
  /// reserved for `reserve` positions now, so appends within them never allocate.
  SequenceLedger(std::string_view store, std::size_t capacity, std::size_t reserve)
      : store_(store), capacity_(capacity) {
    tokens_.reserve(reserve);
  }
  /// A bounded ledger that reserves every token id up front.
  SequenceLedger(std::string_view store, std::size_t capacity)
      : SequenceLedger(store, capacity, capacity) {}

  std::size_t size() const { return size_; }
  std::size_t pending() const { return pending_; }
  std::size_t capacity() const { return capacity_; }
  /// Positions the capacity still admits.
  std::size_t room() const { return capacity_ - size_; }
  /// The token ids of the committed positions.
  std::span<const std::int32_t> tokens() const { return {tokens_.data(), size_}; }

  /// Throws unless an append of n positions may begin: none open, and room for n.
  void check_append(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::begin_append: ", pending_,
                   " positions are already pending");
    KVDECODE_CHECK(n <= capacity_ - size_, store_, ": appending ", n, " positions to ", size_,
                   " would exceed the capacity of ", capacity_);
  }
  /// Opens an append of tokens.size() positions holding these ids (checked first).
  void begin_append(std::span<const std::int32_t> tokens) {
    check_append(tokens.size());
    tokens_.resize(size_);  // drops the ids of a cancelled or truncated tail
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    pending_ = tokens.size();
  }
  void commit_append() {
    size_ += pending_;
    pending_ = 0;
  }
  /// The pending positions are dropped; their ids past size() are overwritten by the next one.
  void cancel_append() noexcept { pending_ = 0; }

  /// Throws unless truncate(n) may run: no append open, and n ≤ size().
  void check_truncate(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::truncate during an append");
    KVDECODE_CHECK(n <= size_, store_, "::truncate(", n, ") beyond size ", size_);
  }
  /// Keeps the first n positions (checked first).
  void truncate(std::size_t n) {
    check_truncate(n);
    size_ = n;
  }
  void reset() noexcept {
    size_ = 0;
    pending_ = 0;
  }

  /// The ids of a restored cache become the committed sequence, with no append open. Copied
  /// into the reservation when they fit it, else the vector is taken over (a ledger with no
  /// limit), so this never allocates.
  void restore(std::vector<std::int32_t>& tokens) noexcept {
    if (tokens.size() <= tokens_.capacity()) {
      tokens_.assign(tokens.begin(), tokens.end());
    } else {
      tokens_.swap(tokens);
    }
    size_ = tokens_.size();
    pending_ = 0;
  }

 private:
  std::string_view store_;  // the store's type name, for messages
  std::size_t capacity_ = 0;
  std::size_t size_ = 0;
  std::size_t pending_ = 0;
  // [size + pending] token id of each position, and ids of a dropped tail past them
  std::vector<std::int32_t> tokens_;
};

}  // namespace kvdecode
