// SequenceLedger: the bookkeeping every store keeps about the sequence it holds (committed
// length, the open append, the capacity, the token ids) and the checks of the append
// transaction, written once so each store keeps only what its memory layout adds.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"

namespace kvdecode {

/// Bytes the token ids of n positions take: every store keeps one int32 per position it
/// reserves for (saturating, as the stores' byte formulas).
constexpr std::uint64_t token_id_bytes(std::uint64_t n) {
  return detail::sat_mul({n, sizeof(std::int32_t)});
}

/// The positions a store holds, as the KvStore concept counts them: `size()` committed ones,
/// `pending()` ones of an open append, at most `capacity()` in all, and their token ids.
///
/// A store forwards begin_append / commit_append / cancel_append / truncate / reset to it and
/// does its own part (writing rows, saving what a cancel must restore) around the call. A
/// store with rules of its own checks them between `check_append(n)` and `begin_append`, or
/// between `check_truncate(n)` and `truncate`, so every check runs before anything changes.
/// Errors name the store (`store`, e.g. "ContiguousStore").
///
/// Token ids are reserved up front, so no append allocates: every one of a ledger's capacity,
/// or, for a store whose memory must not grow with the length (a window), the ids of its first
/// `head` positions and of its newest ones, head + 2 × (shown + reach) ids in all (keeping()).
/// Such a ledger shows the ids of its newest `shown` positions once it holds more than head +
/// shown, and drops those of all but its newest shown + reach committed positions past the head
/// when an append would overflow its buffer (a move of shown + reach ids every shown + reach or
/// more positions). A rollback may reach back `reach` positions from there.
class SequenceLedger {
 public:
  SequenceLedger() = default;
  /// A bounded ledger that reserves every token id up front.
  SequenceLedger(std::string_view store, std::size_t capacity)
      : SequenceLedger(store, capacity, capacity) {}
  /// A ledger for at most `capacity` positions (std::size_t(-1): no limit) that keeps the ids
  /// of positions [0, head) and at least of the newest `shown` committed ones (see the class
  /// comment); an append of more than shown + reach positions must fit its buffer as it is.
  static SequenceLedger keeping(std::string_view store, std::size_t capacity, std::size_t head,
                                std::size_t shown, std::size_t reach) {
    SequenceLedger l(store, capacity, head + 2 * (shown + reach));
    l.head_ = head;
    l.shown_ = shown;
    l.keep_ = shown + reach;
    return l;
  }

  std::size_t size() const { return size_; }
  std::size_t pending() const { return pending_; }
  std::size_t capacity() const { return capacity_; }
  /// Positions the capacity still admits.
  std::size_t room() const { return capacity_ - size_; }
  /// The token ids of the committed positions; those of the newest `shown` ones once a
  /// keeping() ledger holds more than head + shown.
  std::span<const std::int32_t> tokens() const {
    if (size_ <= head_ + shown_) return {tokens_.data(), size_};
    return {tokens_.data() + held() - shown_, shown_};
  }
  /// Ids dropped, of positions [head, head + dropped()); 0 but for a keeping() ledger.
  std::size_t dropped() const { return dropped_; }
  /// The ids held of the committed positions, those of [0, min(head, size())) then of
  /// [head + dropped(), size()): what restore() takes back.
  std::span<const std::int32_t> held_tokens() const { return {tokens_.data(), held()}; }
  /// Bytes of the token ids reserved (token_id_bytes of the reservation).
  std::size_t memory_bytes() const {
    return static_cast<std::size_t>(token_id_bytes(tokens_.capacity()));
  }
  /// The bytes memory_bytes() reports for keeping(head, shown, reach); token_id_bytes(capacity)
  /// for a ledger of every id.
  static constexpr std::uint64_t memory_bytes_for(std::uint64_t head, std::uint64_t shown,
                                                  std::uint64_t reach) {
    return token_id_bytes(
        detail::sat_add({head, detail::sat_mul({2, detail::sat_add({shown, reach})})}));
  }

  /// Throws unless an append of n positions may begin: none open, and room for n.
  void check_append(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::begin_append: ", pending_,
                   " positions are already pending");
    KVDECODE_CHECK(n <= capacity_ - size_, store_, ": appending ", n, " positions to ", size_,
                   " would exceed the capacity of ", capacity_);
  }
  /// Opens an append of tokens.size() positions holding these ids (checked first, and that a
  /// keeping() ledger's buffer takes them: at most shown + reach positions once it is full).
  void begin_append(std::span<const std::int32_t> tokens) {
    check_append(tokens.size());
    KVDECODE_CHECK(tokens.size() <= keep_ || held() + tokens.size() <= tokens_.capacity(), store_,
                   ": appending ", tokens.size(), " positions to ", size_, " overflows its ",
                   tokens_.capacity(), " token ids; at most ", keep_, " at a time");
    tokens_.resize(held());  // drops the ids of a cancelled or truncated tail
    if (held() + tokens.size() > tokens_.capacity()) {
      // Only a keeping() ledger gets here (checked above), with more than keep ids past its head.
      const std::size_t drop = held() - head_ - keep_;
      const auto from = tokens_.begin() + static_cast<std::ptrdiff_t>(head_);
      tokens_.erase(from, from + static_cast<std::ptrdiff_t>(drop));
      dropped_ += drop;
    }
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    pending_ = tokens.size();
  }
  void commit_append() {
    size_ += pending_;
    pending_ = 0;
  }
  /// The pending positions are dropped; their ids past size() are overwritten by the next one.
  void cancel_append() noexcept { pending_ = 0; }

  /// Throws unless truncate(n) may run: no append open, n ≤ size(), and for a keeping() ledger
  /// that dropped ids, n within the head or the ids of the newest `shown` of n positions held.
  void check_truncate(std::size_t n) const {
    KVDECODE_CHECK(pending_ == 0, store_, "::truncate during an append");
    KVDECODE_CHECK(n <= size_, store_, "::truncate(", n, ") beyond size ", size_);
    KVDECODE_CHECK(dropped_ == 0 || n <= head_ || n >= head_ + dropped_ + shown_, store_,
                   "::truncate(", n, "): the token ids of positions [", head_, ", ",
                   head_ + dropped_, ") were dropped; it keeps ", shown_, " of them at least");
  }
  /// Keeps the first n positions (checked first).
  void truncate(std::size_t n) {
    check_truncate(n);
    if (n <= head_) {  // the head's ids are where they always were
      tokens_.resize(std::min(tokens_.size(), n));
      dropped_ = 0;
    }
    size_ = n;
  }
  void reset() noexcept {
    size_ = 0;
    pending_ = 0;
    dropped_ = 0;
  }

  /// The ids of a restored cache become the committed sequence, with no append open: `tokens`
  /// holds those of positions [0, min(head, n)) and then, when `dropped` > 0, those of
  /// [head + dropped, n) (a keeping() ledger's layout, at least `shown` of them: the caller
  /// checked), n = tokens.size() + dropped. Copied into
  /// the reservation when they fit it, else the vector is taken over (a ledger with no limit),
  /// so this never allocates.
  void restore(std::vector<std::int32_t>& tokens, std::size_t dropped = 0) noexcept {
    if (tokens.size() <= tokens_.capacity()) {
      tokens_.assign(tokens.begin(), tokens.end());
    } else {
      tokens_.swap(tokens);
    }
    dropped_ = dropped;
    size_ = tokens_.size() + dropped;
    pending_ = 0;
  }

 private:
  /// A ledger for at most `capacity` positions whose token ids are reserved for `reserve`.
  SequenceLedger(std::string_view store, std::size_t capacity, std::size_t reserve)
      : store_(store), capacity_(capacity), shown_(capacity), keep_(capacity) {
    tokens_.reserve(reserve);
  }

  /// Ids held of the committed positions.
  std::size_t held() const { return size_ - dropped_; }

  std::string_view store_;  // the store's type name, for messages
  std::size_t capacity_ = 0;
  std::size_t size_ = 0;
  std::size_t pending_ = 0;
  std::size_t head_ = 0;     // positions [0, head) whose ids are never dropped
  std::size_t shown_ = 0;    // newest ids tokens() shows past the head
  std::size_t keep_ = 0;     // newest committed ids kept past the head when some are dropped
  std::size_t dropped_ = 0;  // ids dropped: positions [head, head + dropped)
  // [held + pending] the ids of positions [0, min(head, size)), then of [head + dropped,
  // size + pending) (every position while dropped is 0), and ids of a dropped tail past them
  std::vector<std::int32_t> tokens_;
};

}  // namespace kvdecode
