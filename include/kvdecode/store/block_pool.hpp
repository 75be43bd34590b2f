// BlockPool<T>: fixed-size blocks of K/V memory shared by many sequences (PagedStore), with
// reference counts, a free list, and a prefix cache that keeps full blocks keyed by the tokens of
// the whole prefix they end, evicting the least recently used when the pool runs short.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"

namespace kvdecode {

/// Settings of a BlockPool beyond its size.
struct BlockPoolOptions {
  /// The most positions one sequence on the pool may hold (each PagedStore's capacity(), as
  /// every store's Options::capacity); 0 means cfg.seq_len. The pool's n_blocks × block_size
  /// bounds what all its sequences hold together.
  std::size_t capacity = 0;
  /// Keep full blocks for reuse by later requests with the same prefix.
  bool prefix_cache = true;
  /// Bits of the prefix hash kept (1..64). Fewer bits only make collisions common, which tests
  /// use to show that a collision never matches a different prefix.
  unsigned hash_bits = 64;
  /// Keep each sequence's blocks adjacent where the free blocks allow (see BlockPool::acquire):
  /// attention then streams long runs instead of single blocks. Off: the most recently freed
  /// block first, whoever asks.
  bool keep_runs = true;
};

/// Prefix-cache counters, cumulative since construction. A request's "cacheable" blocks are
/// the full blocks of its prompt; the sequence it gets holds at most prompt.size() - 1 of its
/// tokens, so the last prompt token is always computed (its logits start decoding).
struct PrefixCacheStats {
  std::uint64_t requests = 0;      ///< match_prefix calls
  std::uint64_t hits = 0;          ///< full prompt blocks found in memory
  std::uint64_t misses = 0;        ///< full prompt blocks not in memory (computed, or from a tier)
  std::uint64_t evictions = 0;     ///< cached blocks no sequence held, reused for new data
  std::uint64_t tokens_saved = 0;  ///< prompt tokens requests did not have to prefill
};

/// K/V memory for many sequences in blocks of block_size positions.
///
/// Element order, keys and values alike: [n_layers][n_kv_heads][n_blocks][block_size][head_size].
/// Within a block each (layer, kv head) is one dense [block_size][head_size] run, which is a
/// KvBlock with stride head_size. Why (layer, head)-major rather than block-major: blocks b and
/// b+1 of one (layer, kv head) are then adjacent, so a sequence whose table holds consecutive
/// ids (each block it takes is the one after its last where free: acquire) hands attention one
/// KvBlock per run instead of one per block — the contiguous store's layout, with its 256-row
/// tiles, instead of a 16-row online-softmax step per block. The cost is that a copy-on-write
/// copies n_layers × n_kv_heads runs of a block rather than one range, once per shared block
/// written.
///
/// Every block is in exactly one state:
///   free    ref 0, not cached, on the free list;
///   cached  ref 0, cached (its tokens and prefix are known), on the LRU list, evictable;
///   held    ref > 0 (the number of sequences whose block table holds it), cached or not.
///
/// Prefix cache. A full block is keyed by a hash chained over every token from position 0 to
/// its end, so equal keys mean (up to collisions) equal prefixes. A collision cannot match a
/// different prefix: a candidate must also hold the same block_size tokens and extend the same
/// parent entry (the registration that ends the previous block), and entry ids are never reused,
/// so by induction a match compares every token of the prefix.
///
/// Tier. A second level behind the prefix cache (a PrefixTier, serving/prefix_tier.hpp, keeps
/// blocks in files) can be attached with set_tier(): every cached block the pool evicts is
/// offered to it first, and a prefix lookup that misses in memory asks it for the block, loading
/// it into a free block. Without a tier the pool behaves exactly as before.
///
/// Not thread-safe: one thread drives a pool and all its sequences (a batched decode begins the
/// appends of its sequences one after another on that thread). Everything is allocated at
/// construction; no operation allocates afterwards (an attached tier may, when it is called). The
/// pool must outlive its sequences and cannot be moved, since they point to it.
template <class T>
class BlockPool {
 public:
  using Scalar = T;
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

  /// What a tier is told about a full block: the hash of the prefix it ends, the hash of the
  /// prefix before it (kRootPrefix.hash for a first block) and its block_size token ids.
  struct TierKey {
    std::uint64_t hash = 0;
    std::uint64_t parent_hash = 0;
    std::span<const std::int32_t> tokens;
  };

  /// A level behind the prefix cache (set_tier). Called on the pool's thread, from acquire()
  /// and match_prefix(), so it must not throw: a tier that cannot store or read a block says so
  /// in its own counters.
  class Tier {
   public:
    /// Block b, cached with `key`, is about to be evicted (or spill_cached() offers it).
    virtual void spill(const BlockPool& pool, std::size_t b, const TierKey& key) noexcept = 0;
    /// Whether the tier may hold the block `key` ends (a cheap look-up before a block is taken).
    virtual bool contains(const TierKey& key) noexcept = 0;
    /// Fills block b with the keys and values of the block `key` ends; false when the tier does
    /// not hold it or its copy does not verify (the pool then frees b).
    virtual bool load(BlockPool& pool, std::size_t b, const TierKey& key) noexcept = 0;

    virtual ~Tier() = default;
  };

  /// n_blocks blocks of block_size positions for the model cfg.
  BlockPool(const ModelConfig& cfg, std::size_t n_blocks, std::size_t block_size = 16,
            BlockPoolOptions options = {})
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        n_blocks_(n_blocks),
        block_size_(block_size),
        capacity_(options.capacity),
        prefix_cache_(options.prefix_cache),
        keep_runs_(options.keep_runs) {
    cfg.validate();
    KVDECODE_CHECK(n_blocks >= 1, "BlockPool: n_blocks must be at least 1, got ", n_blocks);
    KVDECODE_CHECK(block_size >= 1, "BlockPool: block_size must be at least 1, got ", block_size);
    KVDECODE_CHECK(options.hash_bits >= 1 && options.hash_bits <= 64,
                   "BlockPool: hash_bits must lie in [1, 64], got ", options.hash_bits);
    // Every count and byte size below fits size_t: 2 × n_blocks × block_elems × sizeof(T).
    KVDECODE_CHECK(block_size <= std::numeric_limits<std::size_t>::max() / 4 / sizeof(T) /
                                     (n_layers_ * n_kv_heads_ * head_size_) &&
                       n_blocks <= std::numeric_limits<std::size_t>::max() / 4 / sizeof(T) /
                                       (n_layers_ * n_kv_heads_ * head_size_ * block_size),
                   "BlockPool: ", n_blocks, " blocks of ", block_size,
                   " positions overflow size_t");
    if (capacity_ == 0) capacity_ = static_cast<std::size_t>(cfg.seq_len);
    hash_mask_ =
        options.hash_bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << options.hash_bits) - 1;
    block_elems_ = n_layers_ * n_kv_heads_ * block_size_ * head_size_;
    keys_ = AlignedBuffer<T>(n_blocks_ * block_elems_);
    values_ = AlignedBuffer<T>(keys_.size());
    ref_.assign(n_blocks_, 0);
    cached_.assign(n_blocks_, false);
    hash_.assign(n_blocks_, 0);
    entry_.assign(n_blocks_, 0);
    parent_entry_.assign(n_blocks_, 0);
    parent_hash_.assign(n_blocks_, 0);
    chain_next_.assign(n_blocks_, kNone);
    lru_prev_.assign(n_blocks_, kNone);
    lru_next_.assign(n_blocks_, kNone);
    block_tokens_.assign(n_blocks_ * block_size_, 0);
    std::size_t buckets = 1;
    while (buckets < 2 * n_blocks_) buckets *= 2;
    buckets_.assign(buckets, kNone);
    // Without keep_runs, handed out lowest id first: a fresh sequence's blocks in address order.
    free_.reserve(n_blocks_);
    free_pos_.assign(n_blocks_, kNone);
    for (std::size_t b = n_blocks_; b-- > 0;) push_free(b);
  }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // ---------------------------------------------------------------------------------------------
  // Shape and accounting.

  std::size_t n_blocks() const { return n_blocks_; }
  std::size_t block_size() const { return block_size_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  /// The most positions one sequence may hold (BlockPoolOptions::capacity).
  std::size_t capacity() const { return capacity_; }
  bool prefix_cache_enabled() const { return prefix_cache_; }
  /// Bytes of K and V in one block: 2 × n_layers × n_kv_heads × block_size × head_size × sizeof(T).
  std::size_t block_bytes() const { return 2 * block_elems_ * sizeof(T); }
  /// Bytes of every block as allocated, reserved at construction.
  std::size_t memory_bytes() const { return keys_.allocated_bytes() + values_.allocated_bytes(); }

  /// Blocks on the free list (never written, or released and not cached).
  std::size_t n_free() const { return free_.size(); }
  /// Cached blocks no sequence holds: reusable at once by a matching prefix, else evictable.
  std::size_t n_evictable() const { return lru_size_; }
  /// Blocks an allocation can take: free ones first, then evicted cached ones.
  std::size_t n_available() const { return free_.size() + lru_size_; }
  /// Blocks some sequence holds.
  std::size_t n_held() const { return n_blocks_ - n_available(); }
  /// How many sequences hold block b.
  std::size_t ref_count(std::size_t b) const { return ref_[b]; }
  /// Whether block b is in the prefix cache.
  bool is_cached(std::size_t b) const { return cached_[b]; }
  const PrefixCacheStats& stats() const { return stats_; }
  /// Attaches a tier (nullptr detaches). The tier must stay alive while it is attached.
  void set_tier(Tier* tier) noexcept { tier_ = tier; }
  Tier* tier() const noexcept { return tier_; }
  /// Offers every cached block, held or not, to the tier (before a shutdown, say); returns how
  /// many. The blocks stay cached.
  std::size_t spill_cached() noexcept {
    std::size_t n = 0;
    if (tier_ == nullptr) return 0;
    for (std::size_t b = 0; b < n_blocks_; ++b)
      if (cached_[b]) {
        tier_->spill(*this, b, tier_key(b));
        ++n;
      }
    return n;
  }
  /// A fresh number for a sequence's error messages.
  std::uint64_t new_sequence_id() { return ++sequences_; }

  /// Throws Error naming the first broken invariant: every block in exactly one of the states
  /// above, the free list, LRU list and hash chains well formed and holding exactly the blocks
  /// they should. O(n_blocks); for tests and debugging.
  void check_invariants() const {
    std::vector<char> on_free(n_blocks_, 0), on_lru(n_blocks_, 0), on_chain(n_blocks_, 0);
    for (const std::size_t b : free_) {
      KVDECODE_CHECK(b < n_blocks_ && !on_free[b], "BlockPool: free list holds block ", b,
                     " twice or out of range");
      on_free[b] = 1;
    }
    for (std::size_t i = 0; i < free_.size(); ++i)
      KVDECODE_CHECK(free_pos_[free_[i]] == i, "BlockPool: free block ", free_[i], " is entry ", i,
                     " of the free list, its position says ", free_pos_[free_[i]]);
    for (std::size_t b = 0; b < n_blocks_; ++b)
      KVDECODE_CHECK(on_free[b] || free_pos_[b] == kNone, "BlockPool: block ", b,
                     " is not free, yet has a position in the free list");
    std::size_t lru_count = 0;
    for (std::size_t b = lru_head_, prev = kNone; b != kNone; prev = b, b = lru_next_[b]) {
      KVDECODE_CHECK(b < n_blocks_ && !on_lru[b] && lru_prev_[b] == prev,
                     "BlockPool: LRU list broken at block ", b);
      on_lru[b] = 1;
      ++lru_count;
      if (lru_next_[b] == kNone)
        KVDECODE_CHECK(lru_tail_ == b, "BlockPool: LRU tail is ", lru_tail_, ", expected ", b);
    }
    KVDECODE_CHECK(lru_count == lru_size_, "BlockPool: LRU list holds ", lru_count,
                   " blocks, its size says ", lru_size_);
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      for (std::size_t b = buckets_[k]; b != kNone; b = chain_next_[b]) {
        KVDECODE_CHECK(
            b < n_blocks_ && !on_chain[b] && cached_[b] && (hash_[b] & (buckets_.size() - 1)) == k,
            "BlockPool: hash chain ", k, " broken at block ", b);
        on_chain[b] = 1;
      }
    for (std::size_t b = 0; b < n_blocks_; ++b) {
      KVDECODE_CHECK(on_chain[b] == static_cast<char>(cached_[b]), "BlockPool: block ", b,
                     (cached_[b] ? " is cached but not in its hash chain"
                                 : " is in a hash chain but not cached"));
      const bool want_free = ref_[b] == 0 && !cached_[b];
      const bool want_lru = ref_[b] == 0 && cached_[b];
      KVDECODE_CHECK(
          on_free[b] == static_cast<char>(want_free) && on_lru[b] == static_cast<char>(want_lru),
          "BlockPool: block ", b, " (ref ", ref_[b], ", cached ", cached_[b], ") is ",
          on_free[b] ? "" : "not ", "on the free list and ", on_lru[b] ? "" : "not ",
          "on the LRU list");
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Block memory: block b, (layer, kv head) is a dense [block_size][head_size] run, and block
  // b+1's run of the same (layer, kv head) follows it directly.

  T* keys(std::size_t b, std::size_t layer, std::size_t kv_head) {
    return keys_.data() + offset(b, layer, kv_head);
  }
  T* values(std::size_t b, std::size_t layer, std::size_t kv_head) {
    return values_.data() + offset(b, layer, kv_head);
  }
  const T* keys(std::size_t b, std::size_t layer, std::size_t kv_head) const {
    return keys_.data() + offset(b, layer, kv_head);
  }
  const T* values(std::size_t b, std::size_t layer, std::size_t kv_head) const {
    return values_.data() + offset(b, layer, kv_head);
  }

  // ---------------------------------------------------------------------------------------------
  // The block-level API the sequences use. A PagedStore is the usual caller; these keep the
  // states consistent but do not check the caller's arguments beyond debug builds.

  /// Takes a block for new data: a free one, else evicts the least recently used cached block.
  /// The caller checks n_available() > 0 first. Returns it with ref 1.
  ///
  /// With keep_runs, `after` (the sequence's last block, or kNone) asks for block after + 1, so
  /// a growing sequence stays one run. When that block is not free the sequence starts a new run
  /// in the longest run of free blocks: at its start when the block before it is free of holders
  /// (the pool's start, a cached block), else with the `want` blocks the caller is about to take
  /// centred in it, so the slack splits evenly between the sequence that holds the block before
  /// (it grows into the first half) and this one (into the second). Sequences decoded in turn
  /// then grow side by side rather than interleaved block by block, and a prompt's blocks taken
  /// together stay one run while free runs hold them. The search is O(n_blocks), once per new
  /// run.
  std::size_t acquire(std::size_t after = kNone, std::size_t want = 1) noexcept {
    std::size_t b;
    if (!free_.empty()) {
      if (!keep_runs_) {
        b = free_.back();
      } else if (after != kNone && after + 1 < n_blocks_ && free_pos_[after + 1] != kNone) {
        b = after + 1;
      } else {
        b = start_of_run(want);
      }
      take_free(b);
    } else {
      b = lru_head_;
      if (tier_ != nullptr) tier_->spill(*this, b, tier_key(b));
      lru_unlink(b);
      unchain(b);
      ++stats_.evictions;
    }
    ref_[b] = 1;
    return b;
  }

  /// One more sequence holds block b (a fork, or a prefix match).
  void retain(std::size_t b) noexcept {
    if (ref_[b] == 0) lru_unlink(b);  // only cached blocks are reachable with ref 0
    ++ref_[b];
  }

  /// One sequence fewer holds block b. Unheld, a cached block becomes the most recently used
  /// evictable block; any other goes back to the free list.
  void release(std::size_t b) noexcept {
    if (--ref_[b] != 0) return;
    if (cached_[b]) {
      lru_push_back(b);
    } else {
      push_free(b);  // within the reserved n_blocks: cannot allocate
    }
  }

  /// Copies every layer's and head's rows of block src into block dst.
  void copy_block(std::size_t dst, std::size_t src) noexcept {
    const std::size_t run = block_size_ * head_size_;
    for (std::size_t l = 0; l < n_layers_; ++l)
      for (std::size_t h = 0; h < n_kv_heads_; ++h) {
        std::copy_n(keys_.data() + offset(src, l, h), run, keys_.data() + offset(dst, l, h));
        std::copy_n(values_.data() + offset(src, l, h), run, values_.data() + offset(dst, l, h));
      }
  }

  /// A registration in the prefix cache: the logical entry that ends a full block of a prefix,
  /// and that prefix's hash. Entry 0 is the empty prefix (and "not cached").
  struct PrefixKey {
    std::uint64_t entry = 0;
    std::uint64_t hash = 0;
  };
  /// The key of the empty prefix, parent of every first block.
  static constexpr PrefixKey kRootPrefix{0, 0x6a09e667f3bcc908ull};

  /// Registers the full block b, holding `tokens` (block_size ids) after the prefix `parent`.
  /// When an equal prefix is already cached (two requests computed it independently), b stays
  /// private and the existing entry is returned, so the prefix keeps one cache entry. Returns
  /// the key a following block chains to ({0, 0} with the cache disabled).
  PrefixKey register_full(std::size_t b, PrefixKey parent,
                          std::span<const std::int32_t> tokens) noexcept {
    if (!prefix_cache_) return {};
    const std::uint64_t h = chain_hash(parent.hash, tokens);
    const std::size_t existing = find(h, parent.entry, tokens);
    if (existing != kNone) return {entry_[existing], h};
    cached_[b] = true;
    hash_[b] = h;
    entry_[b] = next_entry_++;
    parent_entry_[b] = parent.entry;
    parent_hash_[b] = parent.hash;
    std::copy(tokens.begin(), tokens.end(), block_tokens_.data() + b * block_size_);
    std::size_t& head = buckets_[h & (buckets_.size() - 1)];
    chain_next_[b] = head;
    head = b;
    return {entry_[b], h};
  }

  /// Takes block b out of the prefix cache (its contents are about to change).
  void uncache(std::size_t b) noexcept {
    if (!cached_[b]) return;
    unchain(b);
    if (ref_[b] == 0) {  // it was evictable: now it is plainly free
      lru_unlink(b);
      push_free(b);
    }
  }

  /// The prefix key a cached block ends.
  PrefixKey key_of(std::size_t b) const { return {entry_[b], hash_[b]}; }

  /// Finds the longest run of cached full blocks that begins `prompt`, writes their ids to
  /// blocks_out (room for prompt.size() / block_size ids), retains them and returns how many.
  /// A block missing in memory is asked of the tier, if one is attached, and loaded into a free
  /// (or evicted) block, which joins the cache. Counts the request in stats(): hits and misses
  /// are in memory; a tier counts its own.
  std::size_t match_prefix(std::span<const std::int32_t> prompt,
                           std::span<std::size_t> blocks_out) noexcept {
    const std::size_t full = prompt.size() / block_size_;
    std::size_t matched = 0;
    if (prefix_cache_) {
      PrefixKey parent = kRootPrefix;
      std::size_t in_memory = 0;
      for (; matched < full && matched < blocks_out.size(); ++matched) {
        const auto tokens = prompt.subspan(matched * block_size_, block_size_);
        const std::uint64_t h = chain_hash(parent.hash, tokens);
        std::size_t b = find(h, parent.entry, tokens);
        if (b != kNone) {
          retain(b);  // now, so that a block taken for a tier load cannot evict it
          ++in_memory;
        } else {
          b = load_from_tier(parent, {h, parent.hash, tokens},
                             matched > 0 ? blocks_out[matched - 1] : kNone);
          if (b == kNone) break;
        }
        blocks_out[matched] = b;
        parent = key_of(b);
      }
      stats_.hits += in_memory;
      stats_.misses += full - in_memory;
    } else {
      stats_.misses += full;
    }
    ++stats_.requests;
    if (matched > 0) stats_.tokens_saved += std::min(matched * block_size_, prompt.size() - 1);
    return matched;
  }

 private:
  void push_free(std::size_t b) {
    free_pos_[b] = free_.size();
    free_.push_back(b);  // within the reserved n_blocks: cannot allocate
  }
  /// Removes free block b from the free list (the last entry takes its place).
  void take_free(std::size_t b) {
    const std::size_t i = free_pos_[b];
    free_[i] = free_.back();
    free_pos_[free_[i]] = i;
    free_.pop_back();
    free_pos_[b] = kNone;
  }
  /// Where a new run of `want` blocks goes (acquire): the longest run of free blocks, lowest
  /// first, at its start if no sequence holds the block before it, else with the new run centred
  /// in it (at its start when it is shorter than want).
  std::size_t start_of_run(std::size_t want) const {
    std::size_t best = kNone, best_len = 0;
    for (std::size_t b = 0; b < n_blocks_;) {
      if (free_pos_[b] == kNone) {
        ++b;
        continue;
      }
      std::size_t e = b + 1;
      while (e < n_blocks_ && free_pos_[e] != kNone) ++e;
      if (e - b > best_len) {
        best = b;
        best_len = e - b;
      }
      b = e;
    }
    if (best > 0 && ref_[best - 1] > 0 && best_len > want) best += (best_len - want) / 2;
    return best;
  }

  std::size_t offset(std::size_t b, std::size_t layer, std::size_t kv_head) const {
    return ((layer * n_kv_heads_ + kv_head) * n_blocks_ + b) * block_size_ * head_size_;
  }

  TierKey tier_key(std::size_t b) const {
    return {hash_[b], parent_hash_[b], {block_tokens_.data() + b * block_size_, block_size_}};
  }

  /// A block the tier holds for `key`, after `parent`: taken (after block `after`, as acquire),
  /// loaded, cached and held (ref 1); or kNone, with nothing taken.
  std::size_t load_from_tier(PrefixKey parent, const TierKey& key, std::size_t after) noexcept {
    if (tier_ == nullptr || n_available() == 0 || !tier_->contains(key)) return kNone;
    const std::size_t b = acquire(after);
    if (!tier_->load(*this, b, key)) {
      release(b);  // not cached: back to the free list
      return kNone;
    }
    register_full(b, parent, key.tokens);
    return b;
  }

  /// The hash of a prefix extended by one block of tokens: SplitMix64's finaliser over the
  /// parent hash and each id, so every token of the prefix reaches every bit.
  std::uint64_t chain_hash(std::uint64_t parent, std::span<const std::int32_t> tokens) const {
    std::uint64_t h = parent;
    for (const std::int32_t t : tokens) {
      h ^= static_cast<std::uint64_t>(static_cast<std::uint32_t>(t)) + 0x9E3779B97F4A7C15ull;
      h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
      h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
      h ^= h >> 31;
    }
    return h & hash_mask_;
  }

  /// The cached block with hash h after entry `parent` holding `tokens`, or kNone. Comparing
  /// the tokens and the parent entry, not just the hash, is what makes a collision harmless.
  std::size_t find(std::uint64_t h, std::uint64_t parent,
                   std::span<const std::int32_t> tokens) const {
    for (std::size_t b = buckets_[h & (buckets_.size() - 1)]; b != kNone; b = chain_next_[b]) {
      if (hash_[b] != h || parent_entry_[b] != parent) continue;
      if (std::equal(tokens.begin(), tokens.end(), block_tokens_.data() + b * block_size_))
        return b;
    }
    return kNone;
  }

  /// Removes cached block b from its hash chain; it is no longer cached.
  void unchain(std::size_t b) {
    std::size_t* link = &buckets_[hash_[b] & (buckets_.size() - 1)];
    while (*link != b) link = &chain_next_[*link];
    *link = chain_next_[b];
    chain_next_[b] = kNone;
    cached_[b] = false;
    entry_[b] = 0;
  }

  void lru_push_back(std::size_t b) {
    lru_prev_[b] = lru_tail_;
    lru_next_[b] = kNone;
    if (lru_tail_ != kNone) {
      lru_next_[lru_tail_] = b;
    } else {
      lru_head_ = b;
    }
    lru_tail_ = b;
    ++lru_size_;
  }
  void lru_unlink(std::size_t b) {
    if (lru_prev_[b] != kNone) {
      lru_next_[lru_prev_[b]] = lru_next_[b];
    } else {
      lru_head_ = lru_next_[b];
    }
    if (lru_next_[b] != kNone) {
      lru_prev_[lru_next_[b]] = lru_prev_[b];
    } else {
      lru_tail_ = lru_prev_[b];
    }
    lru_prev_[b] = lru_next_[b] = kNone;
    --lru_size_;
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t n_blocks_ = 0;
  std::size_t block_size_ = 0;
  std::size_t capacity_ = 0;
  std::size_t block_elems_ = 0;  // n_layers × n_kv_heads × block_size × head_size
  bool prefix_cache_ = true;
  bool keep_runs_ = true;
  std::uint64_t hash_mask_ = 0;
  std::uint64_t next_entry_ = 1;  // entry ids are never reused; 0 is the empty prefix
  std::uint64_t sequences_ = 0;   // sequences created, to name them in messages

  AlignedBuffer<T> keys_;             // [n_layers][n_kv_heads][n_blocks][block_size][head_size]
  AlignedBuffer<T> values_;           // [n_layers][n_kv_heads][n_blocks][block_size][head_size]
  std::vector<std::size_t> ref_;      // [n_blocks] sequences holding the block
  std::vector<bool> cached_;          // [n_blocks] in the prefix cache
  std::vector<std::uint64_t> hash_;   // [n_blocks] prefix hash, when cached
  std::vector<std::uint64_t> entry_;  // [n_blocks] registration id, when cached
  std::vector<std::uint64_t> parent_entry_;  // [n_blocks] entry of the previous block's prefix
  std::vector<std::uint64_t> parent_hash_;   // [n_blocks] hash of the previous block's prefix
  std::vector<std::int32_t> block_tokens_;   // [n_blocks][block_size] token ids, when cached
  std::vector<std::size_t> buckets_;     // [2^k ≥ 2 n_blocks] first cached block of each chain
  std::vector<std::size_t> chain_next_;  // [n_blocks] next cached block in the same chain
  std::vector<std::size_t> free_;        // [≤ n_blocks] free block ids, most recently freed last
  std::vector<std::size_t> free_pos_;    // [n_blocks] index of a free block in free_, else kNone
  std::vector<std::size_t> lru_prev_;    // [n_blocks] evictable list, least recent at the head
  std::vector<std::size_t> lru_next_;    // [n_blocks]
  std::size_t lru_head_ = kNone;
  std::size_t lru_tail_ = kNone;
  std::size_t lru_size_ = 0;
  PrefixCacheStats stats_;
  Tier* tier_ = nullptr;  // not owned; see set_tier
};

}  // namespace kvdecode
