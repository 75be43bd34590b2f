// PagedStore<T>: one sequence's KV cache as a table of blocks in a shared BlockPool. Blocks are
// taken on demand, shared by forks and by requests with a cached prefix, copied on write.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvdecode/block_pool.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"

namespace kvdecode {

/// One sequence on a BlockPool; a KvStore, so Model::prefill / decode run on it unchanged.
/// Cache index p lives in row p % block_size of block table()[p / block_size]; attention gets
/// one KvBlock per run of consecutive block ids (one per block at worst).
///
/// Sequence operations: fork() (the child shares every block), truncate() (rollback),
/// release() (every block back to the pool), and continuation (append the next turn's tokens
/// with Model::prefill: only they are computed). open(pool, prompt) starts a request holding the
/// longest cached prefix of its prompt; prefill the rest, tokens after size().
///
/// Appends are transactional: begin_append takes every block the append needs up front (and
/// copies a shared partially filled last block, copy-on-write), or throws Error, naming the
/// blocks needed and available, with the pool and every sequence unchanged. Blocks that become
/// full are entered in the prefix cache at commit_append. A decode step that needs no new block
/// allocates nothing: the table and token list are reserved for max_seq_len at construction.
///
/// Move-only; the pool must outlive the sequence. Destruction releases its blocks.
template <class T>
class PagedStore {
 public:
  using Scalar = T;

  /// What a sequence's memory depends on: the pool's block size and the sequence length.
  struct Options {
    std::size_t block_size = 16;  ///< positions per block (BlockPool's block_size)
    std::size_t capacity = 0;     ///< positions of the sequence; 0 means cfg.seq_len
  };

  /// The blocks of one sequence of `capacity` positions held alone (shared blocks only make a
  /// sequence's share smaller): ceil(capacity / block_size) × block_size positions of K and V.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    KVDECODE_CHECK(o.block_size >= 1, "PagedStore: block_size must be at least 1, got ",
                   o.block_size);
    const std::uint64_t bs = o.block_size;
    const std::uint64_t cap = detail::capacity_or_seq_len(o.capacity, cfg);
    const std::uint64_t blocks = cap / bs + (cap % bs != 0 ? 1 : 0);
    return detail::sat_mul({blocks, bs, detail::KvDims::of(cfg).row_bytes(sizeof(T))});
  }

  PagedStore() = default;
  /// An empty sequence on pool.
  explicit PagedStore(BlockPool<T>& pool) : pool_(&pool), id_(pool.new_sequence_id()) {
    const std::size_t bs = pool.block_size();
    table_.reserve((pool.max_seq_len() + bs - 1) / bs);
    prefixes_.reserve(pool.max_seq_len() / bs);
    tokens_.reserve(pool.max_seq_len());
  }

  /// A request: a sequence already holding the longest cached prefix of whole blocks of
  /// `prompt`, at most prompt.size() - 1 tokens of it (the last token's logits are needed, so
  /// it is always computed). Prefill prompt.subspan(size()) next. Counts in pool.stats().
  static PagedStore open(BlockPool<T>& pool, std::span<const std::int32_t> prompt) {
    PagedStore s(pool);
    const std::size_t bs = pool.block_size();
    prompt = prompt.first(std::min(prompt.size(), pool.max_seq_len()));
    s.table_.resize(prompt.size() / bs);
    s.table_.resize(pool.match_prefix(prompt, s.table_));
    s.size_ = std::min(s.table_.size() * bs, prompt.size() == 0 ? 0 : prompt.size() - 1);
    // A match of the whole prompt leaves its last block partly used: still shared and
    // cached, so the first append copies it (the copy is cheaper than recomputing the block).
    for (std::size_t i = 0; i < s.size_ / bs; ++i) s.prefixes_.push_back(pool.key_of(s.table_[i]));
    s.tokens_.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(s.size_));
    return s;
  }

  PagedStore(PagedStore&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)),
        id_(o.id_),
        table_(std::move(o.table_)),
        prefixes_(std::move(o.prefixes_)),
        tokens_(std::move(o.tokens_)),
        size_(std::exchange(o.size_, 0)),
        pending_(std::exchange(o.pending_, 0)),
        new_blocks_(std::exchange(o.new_blocks_, 0)),
        cow_from_(std::exchange(o.cow_from_, kNone)) {}
  PagedStore& operator=(PagedStore&& o) noexcept {
    if (this != &o) {
      cancel_append();
      release();
      pool_ = std::exchange(o.pool_, nullptr);
      id_ = o.id_;
      table_ = std::move(o.table_);
      prefixes_ = std::move(o.prefixes_);
      tokens_ = std::move(o.tokens_);
      size_ = std::exchange(o.size_, 0);
      pending_ = std::exchange(o.pending_, 0);
      new_blocks_ = std::exchange(o.new_blocks_, 0);
      cow_from_ = std::exchange(o.cow_from_, kNone);
    }
    return *this;
  }
  PagedStore(const PagedStore&) = delete;
  PagedStore& operator=(const PagedStore&) = delete;
  ~PagedStore() {
    cancel_append();
    release();
  }

  // ---------------------------------------------------------------------------------------------
  // The KvStore concept.

  std::size_t size() const { return size_; }
  std::size_t pending() const { return pending_; }
  std::size_t capacity() const { return pool_ == nullptr ? 0 : pool_->max_seq_len(); }
  std::size_t n_layers() const { return pool_ == nullptr ? 0 : pool_->n_layers(); }
  std::size_t n_kv_heads() const { return pool_ == nullptr ? 0 : pool_->n_kv_heads(); }
  std::size_t head_size() const { return pool_ == nullptr ? 0 : pool_->head_size(); }
  /// Bytes of the blocks this sequence holds (shared blocks count in full for each holder).
  std::size_t memory_bytes() const {
    return pool_ == nullptr ? 0 : table_.size() * pool_->block_bytes();
  }
  Options options() const {
    return pool_ == nullptr ? Options{} : Options{pool_->block_size(), pool_->max_seq_len()};
  }
  /// The room left in the sequence and in the pool now: the free rows of the last block (after
  /// its copy-on-write, if shared) and whole blocks the pool can hand out.
  std::size_t max_append() const {
    if (pool_ == nullptr || pending_ != 0) return 0;
    const std::size_t bs = pool_->block_size();
    const std::size_t partial = size_ % bs;
    const bool cow =
        partial != 0 && (pool_->ref_count(table_.back()) > 1 || pool_->is_cached(table_.back()));
    const std::size_t blocks = pool_->n_available();
    if (cow && blocks == 0) return 0;
    const std::size_t rows = (partial != 0 ? bs - partial : 0) + (blocks - (cow ? 1 : 0)) * bs;
    return std::min(capacity() - size_, rows);
  }
  /// Every row of [0, end), read in place from its blocks.
  std::uint64_t read_bytes(std::size_t end) const {
    return pool_ == nullptr ? 0 : 2 * end * n_layers() * n_kv_heads() * head_size() * sizeof(T);
  }
  /// Truncation returns whole blocks and keeps shared ones untouched: any rollback is exact.
  std::size_t max_exact_rollback() const { return size_; }
  std::size_t rope_position(std::size_t index) const { return index; }
  std::size_t block_scratch_size() const { return 0; }

  void begin_append(std::span<const std::int32_t> tokens) {
    KVDECODE_CHECK(pool_ != nullptr, "PagedStore::begin_append on a sequence without a pool");
    const std::size_t n = tokens.size();
    KVDECODE_CHECK(pending_ == 0, "PagedStore ", id_, ": begin_append while ", pending_,
                   " positions are already pending");
    KVDECODE_CHECK(n <= capacity() - size_, "PagedStore ", id_, ": appending ", n, " positions to ",
                   size_, " would exceed max_seq_len ", capacity());
    if (n == 0) return;
    const std::size_t bs = pool_->block_size();
    const std::size_t fresh = (size_ + n + bs - 1) / bs - table_.size();
    // A partly filled last block another sequence or the prefix cache also reads must not be
    // written in place: this sequence takes a copy.
    const bool cow =
        size_ % bs != 0 && (pool_->ref_count(table_.back()) > 1 || pool_->is_cached(table_.back()));
    const std::size_t needed = fresh + (cow ? 1 : 0);
    KVDECODE_CHECK(needed <= pool_->n_available(), "PagedStore ", id_, ": appending ", n,
                   " tokens at position ", size_, " needs ", needed, " blocks",
                   (cow ? " (one a copy-on-write)" : ""), " but the pool has ",
                   pool_->n_available(), " available (", pool_->n_free(), " free, ",
                   pool_->n_evictable(), " cached evictable) of ", pool_->n_blocks());
    // Nothing below throws: the vectors were reserved for max_seq_len.
    if (cow) {
      const std::size_t copy = pool_->acquire();
      pool_->copy_block(copy, table_.back());
      cow_from_ = std::exchange(table_.back(), copy);
    }
    for (std::size_t i = 0; i < fresh; ++i) table_.push_back(pool_->acquire());
    new_blocks_ = fresh;
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    pending_ = n;
  }

  /// The token ids of the committed positions.
  std::span<const std::int32_t> tokens() const { return {tokens_.data(), size_}; }

  /// Stores pending position i of a layer; k and v are [kv_dim] rows, heads one after another.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    assert(i < pending_ && layer < n_layers());
    const std::size_t index = size_ + i;
    const std::size_t bs = pool_->block_size();
    const std::size_t b = table_[index / bs];
    const std::size_t row = (index % bs) * pool_->head_size();
    const std::size_t hs = pool_->head_size();
    for (std::size_t h = 0; h < pool_->n_kv_heads(); ++h) {
      std::copy_n(k + h * hs, hs, pool_->keys(b, layer, h) + row);
      std::copy_n(v + h * hs, hs, pool_->values(b, layer, h) + row);
    }
  }

  void commit_append() {
    if (pending_ == 0) return;
    if (cow_from_ != kNone) pool_->release(std::exchange(cow_from_, kNone));
    size_ += pending_;
    pending_ = 0;
    new_blocks_ = 0;
    // Blocks that became full join the prefix cache, each chained to the prefix before it.
    const std::size_t bs = pool_->block_size();
    for (std::size_t i = prefixes_.size(); i < size_ / bs; ++i) {
      const auto parent = i == 0 ? BlockPool<T>::kRootPrefix : prefixes_[i - 1];
      prefixes_.push_back(pool_->register_full(
          table_[i], parent, std::span<const std::int32_t>(tokens_).subspan(i * bs, bs)));
    }
  }

  void cancel_append() noexcept {
    if (pending_ == 0) return;
    for (; new_blocks_ > 0; --new_blocks_) {
      pool_->release(table_.back());
      table_.pop_back();
    }
    if (cow_from_ != kNone) {
      pool_->release(table_.back());
      table_.back() = std::exchange(cow_from_, kNone);
    }
    tokens_.resize(size_);
    pending_ = 0;
  }

  /// Rollback (speculative decoding): keeps the first n positions and returns the blocks past
  /// them. A kept partial last block that only this sequence holds leaves the prefix cache, so
  /// the next append writes it in place rather than copying it.
  void truncate(std::size_t n) {
    KVDECODE_CHECK(pending_ == 0, "PagedStore ", id_, "::truncate(", n, ") during an append of ",
                   pending_, " positions");
    KVDECODE_CHECK(n <= size_, "PagedStore ", id_, "::truncate(", n, ") beyond size ", size_);
    if (n == size_) return;
    const std::size_t bs = pool_->block_size();
    const std::size_t keep = (n + bs - 1) / bs;
    while (table_.size() > keep) {
      pool_->release(table_.back());
      table_.pop_back();
    }
    prefixes_.resize(std::min(prefixes_.size(), n / bs));
    tokens_.resize(n);
    size_ = n;
    if (n % bs != 0 && pool_->ref_count(table_.back()) == 1) pool_->uncache(table_.back());
  }

  /// Empties the sequence, every block back to the pool; it stays usable.
  void reset() { release(); }

  /// Returns every block to the pool, last block first, so that a prefix's later blocks are
  /// evicted before its earlier ones (which more requests share). The sequence stays usable.
  void release() noexcept {
    if (pool_ == nullptr) return;
    cancel_append();
    while (!table_.empty()) {
      pool_->release(table_.back());
      table_.pop_back();
    }
    prefixes_.clear();
    tokens_.clear();
    size_ = 0;
  }

  /// A child sequence sharing every block of this one (parallel sampling, beam search). The
  /// first write to a shared partly filled block copies it; full blocks are never copied.
  PagedStore fork() const {
    KVDECODE_CHECK(pool_ != nullptr, "PagedStore::fork of a sequence without a pool");
    KVDECODE_CHECK(pending_ == 0, "PagedStore ", id_, "::fork during an append of ", pending_,
                   " positions");
    PagedStore child(*pool_);
    for (const std::size_t b : table_) {
      pool_->retain(b);
      child.table_.push_back(b);
    }
    child.prefixes_ = prefixes_;
    child.tokens_ = tokens_;
    child.size_ = size_;
    return child;
  }

  /// One KvBlock per run of consecutive block ids in the table (adjacent in the pool's memory),
  /// so a table that is one run reads exactly like the contiguous store.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T>,
                      Sink&& sink) const {
    assert(end <= size_ + pending_);
    const BlockPool<T>& pool = *pool_;
    const std::size_t bs = pool.block_size();
    const std::size_t n = (end + bs - 1) / bs;  // table entries covering [0, end)
    for (std::size_t i = 0; i < n;) {
      std::size_t j = i + 1;
      while (j < n && table_[j] == table_[j - 1] + 1) ++j;
      const std::size_t first = i * bs;
      sink(KvBlock<T>{pool.keys(table_[i], layer, kv_head), pool.values(table_[i], layer, kv_head),
                      pool.head_size(), first, std::min(j * bs, end) - first});
      i = j;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Inspection.

  /// Block ids of positions [i·block_size, (i+1)·block_size), including pending ones.
  std::span<const std::size_t> block_table() const { return table_; }
  /// The pool this sequence lives on (nullptr for a default-constructed store).
  const BlockPool<T>* pool() const { return pool_; }
  /// A number naming this sequence in error messages (unique within its pool).
  std::uint64_t id() const { return id_; }

 private:
  static constexpr std::size_t kNone = BlockPool<T>::kNone;

  BlockPool<T>* pool_ = nullptr;
  std::uint64_t id_ = 0;
  std::vector<std::size_t> table_;  // [ceil((size + pending) / block_size)] block of each page
  // [size / block_size] the prefix-cache key ending each full block: what the next block chains to
  std::vector<typename BlockPool<T>::PrefixKey> prefixes_;
  std::vector<std::int32_t> tokens_;  // [size + pending] token id of each position
  std::size_t size_ = 0;
  std::size_t pending_ = 0;
  std::size_t new_blocks_ = 0;    // blocks begin_append added at the end of table_
  std::size_t cow_from_ = kNone;  // the shared block a pending copy-on-write replaced
};

static_assert(KvStore<PagedStore<float>>);
static_assert(KvStore<PagedStore<double>>);

}  // namespace kvdecode
