// PagedStore<T>: one sequence's KV cache as a table of blocks in a shared BlockPool. Blocks are
// taken on demand, shared by forks and by requests with a cached prefix, copied on write.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/prefetch.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/store/block_pool.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/sequence_ledger.hpp"

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
/// allocates nothing: the table and token list are reserved for the capacity at construction.
///
/// Move-only; the pool must outlive the sequence. Destruction releases its blocks.
template <class T>
class PagedStore {
 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md).
  static constexpr std::string_view kName = "paged";
  static constexpr std::uint32_t kFileTag = 2;

  /// What a sequence's memory depends on: the pool's block size and the sequence length.
  struct Options {
    std::size_t block_size = 16;  ///< positions per block (BlockPool's block_size)
    std::size_t capacity = 0;     ///< positions of the sequence; 0 means cfg.seq_len
  };

  /// The smallest block size (a power of two, at least 16) whose rows of one (layer, kv head),
  /// block_size × head_size × sizeof(T) bytes, fill a 4 KiB page: a sequence whose blocks are
  /// scattered then hands attention runs of at least a page, which the hardware prefetcher
  /// streams; each sequence leaves up to block_size − 1 positions of its last block unused
  /// (MemoryPlanner::padding_bytes).
  static constexpr std::size_t streaming_block_size(const ModelConfig& cfg) {
    const auto row = static_cast<std::size_t>(cfg.head_size()) * sizeof(T);
    std::size_t bs = 16;
    while (bs * row < 4096) bs *= 2;
    return bs;
  }

  /// The blocks of one sequence of `capacity` positions held alone (shared blocks only make a
  /// sequence's share smaller), ceil(capacity / block_size) × block_size positions of K and of
  /// V as its own pool allocates them, and the sequence's token ids.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    KVDECODE_CHECK(o.block_size >= 1, "PagedStore: block_size must be at least 1, got ",
                   o.block_size);
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t bs = o.block_size;
    const std::uint64_t cap = detail::capacity_or_seq_len(o.capacity, cfg);
    const std::uint64_t blocks = cap / bs + (cap % bs != 0 ? 1 : 0);
    const std::uint64_t half = detail::sat_mul({blocks, bs, d.heads(), d.head_size, sizeof(T)});
    return detail::sat_add(
        {detail::sat_mul({2, aligned_allocation_bytes(half)}), token_id_bytes(cap)});
  }

  PagedStore() = default;
  /// An empty sequence on pool.
  explicit PagedStore(BlockPool<T>& pool) { attach(pool); }
  /// An empty sequence on a pool of its own, with the blocks for options.capacity positions
  /// (0 = cfg.seq_len): a paged store built like every other store. Its forks share that pool
  /// and must not outlive it.
  PagedStore(const ModelConfig& cfg, const Options& options)
      : own_pool_(std::make_unique<BlockPool<T>>(
            cfg, blocks_for(cfg, options), options.block_size,
            BlockPoolOptions{.capacity = static_cast<std::size_t>(
                                 detail::capacity_or_seq_len(options.capacity, cfg))})) {
    attach(*own_pool_);
  }

  /// A request: a sequence already holding the longest cached prefix of whole blocks of
  /// `prompt`, at most prompt.size() - 1 tokens of it (the last token's logits are needed, so
  /// it is always computed). Prefill prompt.subspan(size()) next. Counts in pool.stats().
  static PagedStore open(BlockPool<T>& pool, std::span<const std::int32_t> prompt) {
    PagedStore s(pool);
    const std::size_t bs = pool.block_size();
    prompt = prompt.first(std::min(prompt.size(), pool.capacity()));
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
      : own_pool_(std::move(o.own_pool_)),
        pool_(std::exchange(o.pool_, nullptr)),
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
      own_pool_ = std::move(o.own_pool_);
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
  std::size_t capacity() const { return pool_ == nullptr ? 0 : pool_->capacity(); }
  std::size_t n_layers() const { return pool_ == nullptr ? 0 : pool_->n_layers(); }
  std::size_t n_kv_heads() const { return pool_ == nullptr ? 0 : pool_->n_kv_heads(); }
  std::size_t head_size() const { return pool_ == nullptr ? 0 : pool_->head_size(); }
  /// Bytes of the blocks this sequence holds (shared blocks count in full for each holder), or
  /// of its own pool's blocks when it has one (all reserved up front), and of its token ids.
  std::size_t memory_bytes() const {
    const std::size_t ids = static_cast<std::size_t>(token_id_bytes(tokens_.capacity()));
    if (own_pool_ != nullptr) return own_pool_->memory_bytes() + ids;
    return pool_ == nullptr ? 0 : table_.size() * pool_->block_bytes() + ids;
  }
  Options options() const {
    return pool_ == nullptr ? Options{} : Options{pool_->block_size(), pool_->capacity()};
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
                   size_, " would exceed the capacity of ", capacity());
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
    // Nothing below throws: the vectors were reserved for the capacity.
    // Each block asks for the one after the previous block, and says how many are still to
    // come, so the table stays one run where the pool allows (BlockPool::acquire).
    if (cow) {
      const std::size_t copy = pool_->acquire(
          table_.size() >= 2 ? table_[table_.size() - 2] : BlockPool<T>::kNone, fresh + 1);
      pool_->copy_block(copy, table_.back());
      cow_from_ = std::exchange(table_.back(), copy);
    }
    for (std::size_t i = 0; i < fresh; ++i)
      table_.push_back(
          pool_->acquire(table_.empty() ? BlockPool<T>::kNone : table_.back(), fresh - i));
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

  /// Bytes of keys and values (one layer and kv head) for_each_block requests past the next run
  /// (see there).
  static constexpr std::size_t kRunPrefetchBytes = 16384;

  /// One KvBlock per run of consecutive block ids in the table (adjacent in the pool's memory),
  /// so a table that is one run reads exactly like the contiguous store. Before handing out a
  /// run that a jump follows, it asks for the L2 lines of the blocks after the next one, up to
  /// kRunPrefetchBytes of them: the hardware prefetchers follow a run but not the jump to the
  /// next, and attention's row kernels request only the next block's first rows, so a table of
  /// short scattered runs would otherwise wait on memory at every run. The blocks are asked for
  /// again at each run while they are ahead (a request the memory system dropped while busy
  /// gets another chance), which measured faster than asking once.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T>,
                      Sink&& sink) const {
    assert(end <= size_ + pending_);
    const BlockPool<T>& pool = *pool_;
    const std::size_t bs = pool.block_size();
    const std::size_t n = (end + bs - 1) / bs;  // table entries covering [0, end)
    const std::size_t block_bytes = bs * pool.head_size() * sizeof(T);  // a block's keys
    for (std::size_t i = 0; i < n;) {
      std::size_t j = i + 1;
      while (j < n && table_[j] == table_[j - 1] + 1) ++j;
      // Half the bytes for keys, half for values, block after block (the last one in part).
      for (std::size_t a = j + 1, left = kRunPrefetchBytes / 2; a < n && left > 0; ++a) {
        const std::size_t bytes = std::min(block_bytes, left);
        detail::prefetch_bytes<detail::PrefetchTo::kL2>(pool.keys(table_[a], layer, kv_head),
                                                        bytes);
        detail::prefetch_bytes<detail::PrefetchTo::kL2>(pool.values(table_[a], layer, kv_head),
                                                        bytes);
        left -= bytes;
      }
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

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md). Sequences are
  // saved with their pool's blocks: each block once however many sequences hold it, so a restore
  // rebuilds the same sharing (reference counts) and re-enters the full blocks in the prefix
  // cache. One sequence saved through save_cache is a pool file of one sequence.

  /// Block tables count in blocks of this many positions.
  static constexpr std::array<std::string_view, 1> kFileOptionNames = {"block_size"};
  std::array<std::uint64_t, 1> file_options() const {
    return {pool_ == nullptr ? 0 : pool_->block_size()};
  }

  /// Sequences and blocks read by read_pool_payload(), waiting for commit_pool_payload().
  struct FileState {
    struct Sequence {
      std::vector<std::int32_t> tokens;  // [size]
      std::vector<std::uint64_t> table;  // [ceil(size / block_size)] index into the saved blocks
    };
    std::vector<Sequence> sequences;
    std::vector<std::uint64_t> rows;     // [n_saved] rows of each saved block in use
    std::vector<std::uint64_t> holders;  // [n_saved] table entries naming each saved block
    std::vector<std::uint64_t> first;    // [n_saved] element offset of each block's rows below
    std::vector<T> keys, values;         // per saved block [n_layers][n_kv_heads][rows][head_size]
    std::span<const std::int32_t> saved_tokens() const { return sequences.front().tokens; }
  };

  /// n_sequences, n_saved (u64 each); per sequence its size (u64), block table (u64 × ⌈size /
  /// block_size⌉, indices into the saved blocks) and token ids [size]; then per saved block, per
  /// (layer, kv head), keys and values [rows][head_size] each, rows = the most any holder uses.
  template <class Out>
  static void save_pool_payload(Out& out, const BlockPool<T>& pool,
                                std::span<const PagedStore* const> sequences) {
    const std::size_t bs = pool.block_size(), hs = pool.head_size();
    std::vector<std::size_t> index(pool.n_blocks(), kNone);  // [n_blocks] saved index or kNone
    std::vector<std::size_t> saved, rows;                    // [n_saved] pool id, rows in use
    for (const PagedStore* s : sequences)
      for (std::size_t i = 0; i < s->table_.size(); ++i) {
        const std::size_t b = s->table_[i];
        if (index[b] == kNone) {
          index[b] = saved.size();
          saved.push_back(b);
          rows.push_back(0);
        }
        rows[index[b]] = std::max(rows[index[b]], std::min(bs, s->size_ - i * bs));
      }
    out.u64(sequences.size());
    out.u64(saved.size());
    for (const PagedStore* s : sequences) {
      out.u64(s->size_);
      for (const std::size_t b : s->table_) out.u64(index[b]);
      out.write(s->tokens_.data(), s->size_);
    }
    for (std::size_t k = 0; k < saved.size(); ++k)
      for (std::size_t l = 0; l < pool.n_layers(); ++l)
        for (std::size_t h = 0; h < pool.n_kv_heads(); ++h) {
          out.write(pool.keys(saved[k], l, h), rows[k] * hs);
          out.write(pool.values(saved[k], l, h), rows[k] * hs);
        }
  }

  /// Reads a pool payload for `targets` (as many as the file holds, each on `pool`, distinct,
  /// none mid-append): checks every size, table entry and token id, and that the pool has the
  /// blocks once the targets' own are released. Changes nothing.
  template <class In>
  static FileState read_pool_payload(In& in, const BlockPool<T>& pool,
                                     std::span<const PagedStore* const> targets) {
    const std::string& ctx = in.context();
    const std::size_t bs = pool.block_size(), hs = pool.head_size();
    for (std::size_t q = 0; q < targets.size(); ++q) {
      const PagedStore* t = targets[q];
      KVDECODE_CHECK(t->pool_ == &pool, ctx, ": target sequence ", q, " is not on the pool");
      KVDECODE_CHECK(t->pending_ == 0, ctx, ": cannot restore into sequence ", t->id_, " with ",
                     t->pending_, " pending positions of an open append");
      KVDECODE_CHECK(std::find(targets.begin(), targets.begin() + static_cast<std::ptrdiff_t>(q),
                               t) == targets.begin() + static_cast<std::ptrdiff_t>(q),
                     ctx, ": target sequence ", q, " is given twice");
    }
    const std::uint64_t n_seq = in.u64("sequence count");
    KVDECODE_CHECK(n_seq == targets.size(), ctx, ": holds ", n_seq, " sequence(s), ",
                   targets.size(), " given to restore into");
    const std::uint64_t n_saved = in.u64("block count");
    in.check_count(n_saved, sizeof(std::uint64_t), "saved blocks");  // each in a table
    FileState s;
    s.rows.resize(static_cast<std::size_t>(n_saved));
    s.holders.resize(s.rows.size());
    s.first.resize(s.rows.size());
    std::vector<char> seen(s.rows.size(), 0);  // [n_saved] named by the current table
    s.sequences.resize(targets.size());        // as many as the caller passed
    std::uint64_t total = 0;
    for (std::size_t q = 0; q < targets.size(); ++q) {
      typename FileState::Sequence& seq = s.sequences[q];
      const std::uint64_t size = in.u64("sequence size");
      KVDECODE_CHECK(size <= pool.capacity(), ctx, ": sequence ", q, " holds ", size,
                     " positions, more than the pool's capacity ", pool.capacity());
      total += size;
      const std::size_t n = static_cast<std::size_t>(size);
      in.alloc(seq.table, (n + bs - 1) / bs, "block table");
      in.read(seq.table.data(), seq.table.size(), "block table");
      for (std::size_t i = 0; i < seq.table.size(); ++i) {
        const std::uint64_t k = seq.table[i];
        KVDECODE_CHECK(k < n_saved, ctx, ": sequence ", q, " table entry ", i,
                       " names saved block ", k, " of ", n_saved);
        KVDECODE_CHECK(!seen[k], ctx, ": sequence ", q, " table entry ", i, " names saved block ",
                       k, " a second time");
        seen[k] = 1;
        s.rows[k] = std::max<std::uint64_t>(s.rows[k], std::min(bs, n - i * bs));
        ++s.holders[k];
      }
      for (const std::uint64_t k : seq.table) seen[k] = 0;
      seq.tokens = in.tokens(n, "token ids");
    }
    KVDECODE_CHECK(total == in.n_tokens(), ctx, ": the sequences hold ", total,
                   " positions, the header says ", in.n_tokens());
    std::uint64_t elems = 0;
    for (std::size_t k = 0; k < n_saved; ++k) {
      KVDECODE_CHECK(s.holders[k] > 0, ctx, ": saved block ", k, " is in no sequence's table");
      s.first[k] = elems;
      elems += pool.n_layers() * pool.n_kv_heads() * s.rows[k] * hs;
    }
    in.alloc(s.keys, elems, "block keys");
    in.alloc(s.values, elems, "block values");
    for (std::size_t k = 0; k < n_saved; ++k) {
      T* kd = s.keys.data() + s.first[k];
      T* vd = s.values.data() + s.first[k];
      const std::size_t run = static_cast<std::size_t>(s.rows[k]) * hs;
      for (std::size_t lh = 0; lh < pool.n_layers() * pool.n_kv_heads(); ++lh) {
        in.read(kd + lh * run, run, "block keys");
        in.read(vd + lh * run, run, "block values");
      }
    }
    // Blocks the targets alone hold come back to the pool when they are released.
    std::vector<std::size_t> refs(pool.n_blocks(), 0);  // [n_blocks] held by the targets
    std::size_t freed = 0;
    for (const PagedStore* t : targets)
      for (const std::size_t b : t->table_)
        if (++refs[b] == pool.ref_count(b)) ++freed;
    KVDECODE_CHECK(n_saved <= pool.n_available() + freed, ctx, ": needs ", n_saved,
                   " blocks, the pool has ", pool.n_available(), " available and the sequences ",
                   "restored into free ", freed, " (of ", pool.n_blocks(), ")");
    return s;
  }

  /// Replaces the targets' contents with the read sequences, sharing blocks as saved, and
  /// enters their full blocks in the prefix cache; cannot fail (read_pool_payload checked).
  static void commit_pool_payload(BlockPool<T>& pool, std::span<PagedStore* const> targets,
                                  FileState& s) noexcept {
    for (PagedStore* t : targets) t->release();
    const std::size_t bs = pool.block_size(), hs = pool.head_size();
    std::vector<std::uint64_t>& ids = s.first;  // reused: saved index → pool block id
    for (std::size_t k = 0, prev = BlockPool<T>::kNone; k < ids.size(); ++k) {
      // The saved blocks in one run where they fit: each says how many are still to come.
      const std::size_t b = pool.acquire(prev, ids.size() - k);
      prev = b;
      for (std::uint64_t r = 1; r < s.holders[k]; ++r) pool.retain(b);
      const std::size_t run = static_cast<std::size_t>(s.rows[k]) * hs;
      const T* kd = s.keys.data() + ids[k];
      const T* vd = s.values.data() + ids[k];
      for (std::size_t l = 0, lh = 0; l < pool.n_layers(); ++l)
        for (std::size_t h = 0; h < pool.n_kv_heads(); ++h, ++lh) {
          std::copy_n(kd + lh * run, run, pool.keys(b, l, h));
          std::copy_n(vd + lh * run, run, pool.values(b, l, h));
        }
      ids[k] = b;
    }
    for (std::size_t q = 0; q < targets.size(); ++q) {
      PagedStore& t = *targets[q];
      const typename FileState::Sequence& seq = s.sequences[q];
      // Within the reservations made for the capacity at construction: no allocation.
      for (const std::uint64_t k : seq.table) t.table_.push_back(static_cast<std::size_t>(ids[k]));
      t.tokens_.assign(seq.tokens.begin(), seq.tokens.end());
      t.size_ = seq.tokens.size();
      for (std::size_t i = 0; i < t.size_ / bs; ++i) {
        const auto parent = i == 0 ? BlockPool<T>::kRootPrefix : t.prefixes_[i - 1];
        t.prefixes_.push_back(pool.register_full(
            t.table_[i], parent, std::span<const std::int32_t>(t.tokens_).subspan(i * bs, bs)));
      }
    }
  }

  /// save_cache of one sequence: a pool payload holding it alone.
  template <class Out>
  void save_payload(Out& out) const {
    const PagedStore* self = this;
    save_pool_payload(out, *pool_, std::span<const PagedStore* const>(&self, 1));
  }
  /// restore_cache into one sequence: a pool payload of one sequence, into this one's pool.
  template <class In>
  FileState read_payload(In& in) const {
    KVDECODE_CHECK(pool_ != nullptr, in.context(),
                   ": cannot restore into a sequence without a pool");
    const PagedStore* self = this;
    return read_pool_payload(in, *pool_, std::span<const PagedStore* const>(&self, 1));
  }
  void commit_payload(FileState& s) noexcept {
    PagedStore* self = this;
    commit_pool_payload(*pool_, std::span<PagedStore* const>(&self, 1), s);
  }

 private:
  static constexpr std::size_t kNone = BlockPool<T>::kNone;

  /// Blocks of a pool of one sequence of options.capacity positions (options checked).
  static std::size_t blocks_for(const ModelConfig& cfg, const Options& options) {
    (void)memory_bytes_for(cfg, options);  // throws Error for a block size of 0
    const auto cap = static_cast<std::size_t>(detail::capacity_or_seq_len(options.capacity, cfg));
    return std::max<std::size_t>(1, (cap + options.block_size - 1) / options.block_size);
  }

  void attach(BlockPool<T>& pool) {
    pool_ = &pool;
    id_ = pool.new_sequence_id();
    const std::size_t bs = pool.block_size();
    table_.reserve((pool.capacity() + bs - 1) / bs);
    prefixes_.reserve(pool.capacity() / bs);
    tokens_.reserve(pool.capacity());
  }

  std::unique_ptr<BlockPool<T>> own_pool_;  // the pool of a store built from Options, if any
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
