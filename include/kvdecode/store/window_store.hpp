// WindowStore<T>: a sliding-window KV cache, a ring of the newest positions per layer plus S
// "sink" positions kept forever. Two policies: a model trained with a window (exactly the
// windowed causal mask), and StreamingLLM-style streaming past seq_len with bounded memory.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/rope.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/sequence_ledger.hpp"

namespace kvdecode {

enum class WindowPolicy {
  /// RoPE position = cache index; query q sees the sinks and keys q-W+1 .. q (Mistral-style
  /// models trained with a window). With 0 sinks this is forward_reference(w, tokens, W).
  kTrainedWindow,
  /// StreamingLLM (Xiao et al. 2023): a kept token's RoPE position is its slot in the cache,
  /// sinks first, then the window; the newest token sits at S+W-1 once the cache is full.
  kStreaming,
};

struct WindowOptions {
  std::size_t window = 0;  ///< W: positions a query sees besides the sinks, itself included
  std::size_t sinks = 0;   ///< S: first positions kept forever (StreamingLLM keeps 4)
  WindowPolicy policy = WindowPolicy::kTrainedWindow;
  /// The most positions one append may hold once the ring has wrapped (or would wrap during
  /// it). The ring keeps W - 1 + max_chunk positions, so the first query of such an append still
  /// finds its window whatever the Activations' max_chunk. An append to a store whose ring
  /// would not wrap may be longer (a prompt prefilled at once); max_append() says how long.
  std::size_t max_chunk = 1;
  /// capacity(): the longest sequence (cache indices) the store accepts. 0 means cfg.seq_len;
  /// kUnboundedPositions means no limit (streaming). Memory does not depend on it.
  std::size_t capacity = 0;
};

/// WindowOptions::capacity for a store with no length limit: its memory stays what it was built
/// with (WindowStore::memory_bytes_for), however long the sequence.
inline constexpr std::size_t kUnboundedPositions = static_cast<std::size_t>(-1);

/// Keys are stored after RoPE, as every other store, in their ring slot:
///   sinks [n_layers][n_kv_heads][S][head_size], ring [n_layers][n_kv_heads][R][head_size],
///   R = W - 1 + max_chunk, cache index x ≥ S in slot (x - S) mod R.
///
/// Why post-RoPE with rotation by the delta (not pre-RoPE keys rotated at every read): under
/// kTrainedWindow positions never shift, so keys are read in place like ContiguousStore's, and
/// under kStreaming nothing shifts until the cache is full. Up to then, without sinks, both
/// policies give the plain cache's logits bit for bit; with sinks attention reads the keys in
/// two blocks (sinks, then the ring) and its softmax sums round differently, within f32
/// rounding of the plain cache's. Once full, key x written at position p_w(x) = min(x, S+W-1)
/// must appear to query q at its slot position p(x | q) = x - (q - (S+W-1)); for_each_block
/// rotates it by p(x | q) - p_w(x) = -d into scratch (RoPE rotations compose: R(a)R(b) =
/// R(a+b)), where d < W, so the cos/sin of every d are a [W][head_size/2] table built once.
/// Sinks never move, so they are read in place.
///
/// Streaming appends one token at a time once the cache has filled (size + n > S + W): each
/// query of a chunk would need its own rotation of the keys, and attention asks the store for
/// the keys once per chunk. An append that wraps the ring holds at most max_chunk positions,
/// so no forward chunk of it, however the Activations split it, overwrites a key one of its
/// own queries reads. Rollback (truncate) reaches back at most max_chunk positions, as
/// older keys may already be overwritten.
template <class T>
class WindowStore {
 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md).
  static constexpr std::string_view kName = "window";
  static constexpr std::uint32_t kFileTag = 4;
  /// Keys rotated per sink call under kStreaming: [kRotateRows][head_size] of scratch.
  static constexpr std::size_t kRotateRows = 128;

  using Options = WindowOptions;

  /// Every byte a store of these options owns, each buffer as allocated: the sinks' and the
  /// ring's keys and values (n_layers × n_kv_heads × S, resp. R, × head_size × sizeof(T) bytes
  /// each), the [W][head_size/2] cos and sin tables under kStreaming, the token ids and the
  /// per-layer row counters. Independent of the length.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    KVDECODE_CHECK(o.window >= 1 && o.max_chunk >= 1, "WindowStore: window ", o.window,
                   " and max_chunk ", o.max_chunk, ", expected both at least 1");
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t ring = detail::sat_add({o.window, o.max_chunk}) - 1;
    const std::uint64_t sink_bytes = detail::sat_mul({d.heads(), o.sinks, d.head_size, sizeof(T)});
    const std::uint64_t ring_bytes = detail::sat_mul({d.heads(), ring, d.head_size, sizeof(T)});
    const std::uint64_t table = o.policy == WindowPolicy::kStreaming
                                    ? detail::sat_mul({o.window, d.head_size / 2, sizeof(T)})
                                    : 0;
    return detail::sat_add({detail::sat_mul({2, aligned_allocation_bytes(sink_bytes)}),
                            detail::sat_mul({2, aligned_allocation_bytes(ring_bytes)}),
                            detail::sat_mul({2, aligned_allocation_bytes(table)}),
                            SequenceLedger::memory_bytes_for(o.sinks, ring, o.max_chunk),
                            detail::sat_mul({d.layers, sizeof(std::size_t)})});
  }

  WindowStore() = default;
  WindowStore(const ModelConfig& cfg, const WindowOptions& options)
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        window_(options.window),
        sinks_(options.sinks),
        policy_(options.policy),
        max_chunk_(options.max_chunk),
        capacity_(options.capacity == 0 ? static_cast<std::size_t>(cfg.seq_len) : options.capacity),
        style_(cfg.rope_style) {
    cfg.validate();
    const auto seq_len = static_cast<std::size_t>(cfg.seq_len);
    // A window wider than every sequence the store holds (or, streaming, than the model's
    // positions) would only reserve rows no query reads.
    const std::size_t longest =
        policy_ == WindowPolicy::kStreaming ? seq_len : std::max(seq_len, capacity_);
    KVDECODE_CHECK(window_ >= 1 && window_ <= longest, "WindowStore: window ", window_,
                   ", expected 1 .. ", longest,
                   policy_ == WindowPolicy::kStreaming ? " (the model's seq_len)" : "");
    KVDECODE_CHECK(sinks_ <= longest - window_, "WindowStore: sinks ", sinks_, " + window ",
                   window_, " exceed ", longest,
                   policy_ == WindowPolicy::kStreaming ? " (the model's seq_len)" : "");
    KVDECODE_CHECK(max_chunk_ >= 1 && max_chunk_ <= seq_len, "WindowStore: max_chunk ", max_chunk_,
                   ", expected 1 .. seq_len ", seq_len);
    // Every row count below fits, and so do the bytes: S + R rows of 2 × kv_dim elements.
    const std::size_t row_elems = 2 * n_layers_ * n_kv_heads_ * head_size_;
    KVDECODE_CHECK(window_ - 1 + max_chunk_ + sinks_ <=
                       std::numeric_limits<std::size_t>::max() / 2 / sizeof(T) / row_elems,
                   "WindowStore: sinks ", sinks_, " + window ", window_, " + max_chunk ",
                   max_chunk_, " rows overflow the size of the store");
    ring_ = window_ - 1 + max_chunk_;
    const std::size_t heads = n_layers_ * n_kv_heads_;
    sink_keys_ = AlignedBuffer<T>(heads * sinks_ * head_size_);
    sink_values_ = AlignedBuffer<T>(sink_keys_.size());
    ring_keys_ = AlignedBuffer<T>(heads * ring_ * head_size_);
    ring_values_ = AlignedBuffer<T>(ring_keys_.size());
    if (policy_ == WindowPolicy::kStreaming) {
      // The angles of a rotation by -d for every shift d < W: rope_angles(d) with sin negated.
      const std::size_t half = head_size_ / 2;
      rot_cos_ = AlignedBuffer<T>(window_ * half);
      rot_sin_ = AlignedBuffer<T>(window_ * half);
      for (std::size_t d = 0; d < window_; ++d)
        rope_angles(d, head_size_, cfg.rope_theta, rot_cos_.data() + d * half,
                    rot_sin_.data() + d * half);
      for (std::size_t i = 0; i < rot_sin_.size(); ++i) rot_sin_[i] = -rot_sin_[i];
    }
    written_.assign(n_layers_, 0);
    // The sinks' ids and those of the newest R positions, plus max_chunk for a rollback, in
    // S + 2(R + max_chunk) ids reserved now: none allocated while decoding, whatever the length.
    ledger_ = SequenceLedger::keeping("WindowStore", capacity_, sinks_, ring_, max_chunk_);
    oldest_ = sinks_;
  }

  std::size_t size() const { return ledger_.size(); }
  std::size_t pending() const { return ledger_.pending(); }
  std::size_t capacity() const { return capacity_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  std::size_t window() const { return window_; }
  std::size_t sinks() const { return sinks_; }
  std::size_t max_chunk() const { return max_chunk_; }
  WindowPolicy policy() const { return policy_; }
  /// Every byte owned: K/V rows, rotation tables, token ids and row counters.
  std::size_t memory_bytes() const {
    return sink_keys_.allocated_bytes() + sink_values_.allocated_bytes() +
           ring_keys_.allocated_bytes() + ring_values_.allocated_bytes() +
           rot_cos_.allocated_bytes() + rot_sin_.allocated_bytes() + ledger_.memory_bytes() +
           written_.size() * sizeof(std::size_t);
  }
  Options options() const { return {window_, sinks_, policy_, max_chunk_, capacity_}; }
  /// The resident rows of [0, end) that for_each_block hands attention: the sinks and the ring
  /// rows still holding their index (only query end-1's window once a streaming cache is full).
  std::uint64_t read_bytes(std::size_t end) const {
    const std::size_t lo = ring_first(end, end);
    const std::size_t rows = std::min(sinks_, end) + (end > lo ? end - lo : 0);
    return 2 * rows * n_layers_ * n_kv_heads_ * head_size_ * sizeof(T);
  }
  /// How far truncate() reaches back: to any index while the ring has not overwritten a key,
  /// else max_chunk positions (older keys may be gone). Every key a later query sees is then
  /// as if the dropped positions had never been appended.
  std::size_t max_exact_rollback() const {
    const std::size_t size = ledger_.size();
    if (oldest_ <= sinks_) return size;
    const std::size_t first = oldest_ + window_ - 1;  // the lowest index truncate() accepts
    return first >= size ? 0 : size - first;
  }

  /// kTrainedWindow: the index. kStreaming: the slot of the token when it arrives, its index
  /// until the cache fills, then S + W - 1.
  std::size_t rope_position(std::size_t index) const {
    if (policy_ == WindowPolicy::kTrainedWindow) return index;
    return std::min(index, sinks_ + window_ - 1);
  }
  /// Hides key k from query q when k is neither a sink nor one of q's W newest positions.
  bool masks(std::size_t q, std::size_t k) const { return k >= sinks_ && k + window_ <= q; }
  std::size_t block_scratch_size() const {
    return policy_ == WindowPolicy::kStreaming ? kRotateRows * head_size_ : 0;
  }

  /// The most positions one begin_append accepts now (it refuses more, naming the rule): the
  /// room left; under kStreaming, one at a time once S + W positions are held; max_chunk, or
  /// what fits before the ring wraps if more; and once the ring holds keys a later query
  /// needs, what leaves those intact for a cancel. At least 1 while there is room. A caller
  /// with more tokens prefills this many, then continues.
  std::size_t max_append() const {
    const std::size_t size = ledger_.size();
    std::size_t n = ledger_.room();
    if (policy_ == WindowPolicy::kStreaming)
      n = std::min(n, size < sinks_ + window_ ? sinks_ + window_ - size : std::size_t{1});
    n = std::min(n, std::max(max_chunk_, before_wrap()));
    const std::size_t needed =
        std::max({sinks_, oldest_, size + 1 > window_ ? size + 1 - window_ : 0});
    if (size > needed) n = std::min(n, needed + ring_ - size);
    return n;
  }

  void begin_append(std::span<const std::int32_t> tokens) {
    const std::size_t n = tokens.size(), size = ledger_.size();
    ledger_.check_append(n);
    KVDECODE_CHECK(policy_ != WindowPolicy::kStreaming || n <= 1 || size + n <= sinks_ + window_,
                   "WindowStore (streaming): appending ", n, " positions to ", size,
                   " passes the full cache of S + W = ", sinks_ + window_,
                   " positions; past it, append one position at a time");
    KVDECODE_CHECK(
        n <= max_chunk_ || n <= before_wrap(), "WindowStore: appending ", n, " positions to ", size,
        " wraps the ring of ", ring_,
        " rows (W - 1 + max_chunk), so an append may hold at most max_chunk = ", max_chunk_,
        " positions (or ", before_wrap(), " before the ring wraps); see max_append()");
    // A cancel must find the keys the next query needs, [max(S, size-W+1), size), intact.
    const std::size_t needed =
        std::max({sinks_, oldest_, size + 1 > window_ ? size + 1 - window_ : 0});
    KVDECODE_CHECK(n == 0 || size <= needed || size + n - 1 < needed + ring_,
                   "WindowStore: appending ", n, " positions to ", size,
                   " would overwrite keys a cancel must restore; append at most max_chunk = ",
                   max_chunk_, " positions at a time to a non-empty store");
    ledger_.begin_append(tokens);
  }

  /// The committed token ids while the store holds at most S + R positions, then those of the
  /// newest R: the store's memory does not grow with the sequence.
  std::span<const std::int32_t> tokens() const { return ledger_.tokens(); }
  /// Token ids no longer held, of cache indices [S, S + dropped_tokens()).
  std::size_t dropped_tokens() const { return ledger_.dropped(); }

  /// Stores pending position i of a layer (k rotated at rope_position, v; [kv_dim] each). Rows
  /// arrive in order per layer; index x overwrites the ring slot of x - R.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    const std::size_t index = ledger_.size() + i;
    KVDECODE_CHECK(i < ledger_.pending() && index == written_[layer], "WindowStore::write: layer ",
                   layer, " expects pending row ", written_[layer] - ledger_.size(), " of ",
                   ledger_.pending(), ", got ", i, " (rows are written in order)");
    for (std::size_t h = 0; h < n_kv_heads_; ++h) {
      T* kd = nullptr;
      T* vd = nullptr;
      if (index < sinks_) {
        const std::size_t at = ((layer * n_kv_heads_ + h) * sinks_ + index) * head_size_;
        kd = sink_keys_.data() + at;
        vd = sink_values_.data() + at;
      } else {
        const std::size_t at = ring_row(layer, h, index) * head_size_;
        kd = ring_keys_.data() + at;
        vd = ring_values_.data() + at;
      }
      std::copy_n(k + h * head_size_, head_size_, kd);
      std::copy_n(v + h * head_size_, head_size_, vd);
    }
    written_[layer] = index + 1;
  }

  void commit_append() {
    ledger_.commit_append();
    if (ledger_.size() > ring_) oldest_ = std::max(oldest_, ledger_.size() - ring_);
    std::fill(written_.begin(), written_.end(), ledger_.size());
  }
  /// Drops the pending rows. Slots they overwrote held keys no later query sees (begin_append
  /// checked), which now stop being reported.
  void cancel_append() noexcept {
    const std::size_t w =
        written_.empty() ? 0 : *std::max_element(written_.begin(), written_.end());
    if (w > ring_) oldest_ = std::max(oldest_, w - ring_);
    ledger_.cancel_append();
    std::fill(written_.begin(), written_.end(), ledger_.size());
  }

  /// Rollback to n positions, possible while the keys the query at n needs are still resident.
  void truncate(std::size_t n) {
    ledger_.check_truncate(n);
    const std::size_t needed = std::max(sinks_, n + 1 > window_ ? n + 1 - window_ : 0);
    KVDECODE_CHECK(needed >= n || oldest_ <= needed, "WindowStore::truncate(", n,
                   "): the query at ", n, " needs keys from index ", needed,
                   " but the oldest resident one is ", oldest_,
                   " (at most max_chunk = ", max_chunk_, " positions can be rolled back)");
    ledger_.truncate(n);
    oldest_ = std::min(oldest_, std::max(n, sinks_));
    std::fill(written_.begin(), written_.end(), ledger_.size());
  }
  void reset() {
    ledger_.reset();
    oldest_ = sinks_;
    std::fill(written_.begin(), written_.end(), 0);
  }

  /// The resident keys and values of cache indices [0, end): the sinks, then the ring's runs
  /// (at most two, split where the ring wraps). Under kStreaming with a full cache the keys are
  /// those query end-1 sees, rotated to their slot positions in scratch kRotateRows at a time.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T> scratch,
                      Sink&& sink) const {
    const std::size_t hs = head_size_;
    const std::size_t lh = layer * n_kv_heads_ + kv_head;
    const std::size_t ns = std::min(sinks_, end);
    if (ns > 0) {
      const std::size_t at = lh * sinks_ * hs;
      sink(KvBlock<T>{sink_keys_.data() + at, sink_values_.data() + at, hs, 0, ns});
    }
    const std::size_t lo = ring_first(written_[layer], end);
    const bool rotate = policy_ == WindowPolicy::kStreaming && end > sinks_ + window_;
    if (rotate) {
      KVDECODE_CHECK(scratch.size() >= block_scratch_size(),
                     "WindowStore::for_each_block: scratch of ", scratch.size(),
                     " elements, expected at least ", block_scratch_size());
    }
    const std::size_t q = end - 1;
    const std::size_t full = sinks_ + window_ - 1;  // the newest slot position
    for (std::size_t x = lo; x < end;) {
      const std::size_t slot = (x - sinks_) % ring_;
      std::size_t run = std::min(end - x, ring_ - slot);
      const T* keys = ring_keys_.data() + (lh * ring_ + slot) * hs;
      const T* values = ring_values_.data() + (lh * ring_ + slot) * hs;
      if (rotate) {
        run = std::min(run, kRotateRows);
        for (std::size_t r = 0; r < run; ++r) {
          const std::size_t xi = x + r;
          const std::size_t d = xi >= full ? q - xi : q - full;  // < W (see the class comment)
          rotate_back(keys + r * hs, d, scratch.data() + r * hs);
        }
        keys = scratch.data();
      }
      sink(KvBlock<T>{keys, values, hs, x, run});
      x += run;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md). The resident rows
  // are saved as stored (keys rotated at their write position), with the oldest resident index,
  // so a restored store reads, continues and rolls back exactly as the saved one.

  /// The ring's geometry and the RoPE positions depend on all four; max_positions does not
  /// (it only bounds the length, checked against the target's capacity).
  static constexpr std::array<std::string_view, 4> kFileOptionNames = {"window", "sinks", "policy",
                                                                       "max_chunk"};
  /// policy: 0 kTrainedWindow, 1 kStreaming.
  std::array<std::uint64_t, 4> file_options() const {
    return {window_, sinks_, policy_ == WindowPolicy::kStreaming ? 1u : 0u, max_chunk_};
  }

  /// The number d of token ids dropped (u64) and the ids held [n - d], of cache indices
  /// [0, min(S, n)) and [S + d, n); the oldest resident non-sink index (u64), then per (layer,
  /// kv head) the sink keys and values [min(S, n)][head_size] each and the ring's keys and
  /// values of cache indices [lo, n) in index order, lo = max(S, oldest, n - R), [n - lo]
  /// [head_size] each.
  template <class Out>
  void save_payload(Out& out) const {
    const std::size_t n = ledger_.size();
    const std::size_t ns = std::min(sinks_, n), lo = resident_from(n, oldest_);
    const std::span<const std::int32_t> held = ledger_.held_tokens();
    out.u64(ledger_.dropped());
    out.write(held.data(), held.size());
    out.u64(oldest_);
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      out.write(sink_keys_.data() + lh * sinks_ * head_size_, ns * head_size_);
      out.write(sink_values_.data() + lh * sinks_ * head_size_, ns * head_size_);
      for (const AlignedBuffer<T>* ring : {&ring_keys_, &ring_values_})
        for (std::size_t x = lo; x < n; ++x)
          out.write(ring->data() + (lh * ring_ + (x - sinks_) % ring_) * head_size_, head_size_);
    }
  }

  /// A payload read by read_payload(), waiting for commit_payload().
  struct FileState {
    std::vector<std::int32_t> tokens;       // [n - dropped] of [0, min(S, n)), [S + dropped, n)
    std::size_t dropped = 0;                // ids not saved, of [S, S + dropped)
    std::size_t ring = 0;                   // the store's R
    std::size_t oldest = 0, lo = 0;         // oldest resident index; first ring index saved
    std::size_t sinks = 0, window = 0;      // the store's S and W
    std::vector<T> sink_keys, sink_values;  // [n_layers][n_kv_heads][min(S, n)][head_size]
    std::vector<T> ring_keys, ring_values;  // [n_layers][n_kv_heads][n - lo][head_size]
    /// The ids of positions [0, k) for the largest k the file holds them all of: every one
    /// unless some were dropped, else the sinks'.
    std::span<const std::int32_t> saved_tokens() const {
      return std::span<const std::int32_t>(tokens).first(dropped == 0 ? tokens.size() : sinks);
    }
    /// The positions saved, n.
    std::size_t saved_positions() const { return tokens.size() + dropped; }
    /// Whether truncate(n) would succeed once committed: the conditions truncate() checks.
    bool can_truncate(std::size_t n) const {
      const std::size_t needed = std::max(sinks, n + 1 > window ? n + 1 - window : 0);
      return n <= saved_positions() && (needed >= n || oldest <= needed) &&
             (dropped == 0 || n <= sinks || n >= sinks + dropped + ring);
    }
  };

  /// Reads the payload of in.n_tokens() positions (the caller checked they fit the capacity
  /// and that the file's options are this store's).
  template <class In>
  FileState read_payload(In& in) const {
    const auto n = static_cast<std::size_t>(in.n_tokens());
    const std::size_t heads = n_layers_ * n_kv_heads_, hs = head_size_;
    FileState s;
    // What the store's ledger holds: at most S + 2(R + max_chunk) ids; once it dropped some,
    // those of the sinks and of R newest positions at least.
    const std::uint64_t dropped = in.u64("dropped token ids");
    const std::size_t most = sinks_ + 2 * (ring_ + max_chunk_);
    KVDECODE_CHECK(n - std::min<std::uint64_t>(n, dropped) <= most &&
                       (dropped == 0 || (n >= sinks_ + ring_ && dropped <= n - sinks_ - ring_)),
                   in.context(), ": ", dropped, " dropped token ids of ", n,
                   " positions; a window store holds the ids of its ", sinks_, " sinks and of ",
                   ring_, " to ", most - sinks_, " newest positions");
    s.dropped = static_cast<std::size_t>(dropped);
    s.tokens = in.tokens(n - s.dropped, "token ids");
    const std::uint64_t oldest = in.u64("oldest resident index");
    KVDECODE_CHECK(oldest >= sinks_ && oldest <= std::max(sinks_, n), in.context(),
                   ": oldest resident index ", oldest, " lies outside [S, max(S, n)] = [", sinks_,
                   ", ", std::max(sinks_, n), "]");
    // Rollback reaches back to index oldest + W - 1, whose newest R ids must be held.
    KVDECODE_CHECK(s.dropped == 0 || sinks_ + s.dropped + max_chunk_ <= oldest, in.context(),
                   ": the ids of cache indices up to ", sinks_ + s.dropped,
                   " were dropped, within max_chunk of the oldest resident index ", oldest);
    s.oldest = static_cast<std::size_t>(oldest);
    s.lo = resident_from(n, s.oldest);
    s.sinks = sinks_;
    s.window = window_;
    s.ring = ring_;
    const std::size_t ns = std::min(sinks_, n), nr = n - std::min(n, s.lo);
    in.alloc(s.sink_keys, heads * ns * hs, "sink keys");
    in.alloc(s.sink_values, s.sink_keys.size(), "sink values");
    in.alloc(s.ring_keys, heads * nr * hs, "ring keys");
    in.alloc(s.ring_values, s.ring_keys.size(), "ring values");
    for (std::size_t lh = 0; lh < heads; ++lh) {
      in.read(s.sink_keys.data() + lh * ns * hs, ns * hs, "sink keys");
      in.read(s.sink_values.data() + lh * ns * hs, ns * hs, "sink values");
      in.read(s.ring_keys.data() + lh * nr * hs, nr * hs, "ring keys");
      in.read(s.ring_values.data() + lh * nr * hs, nr * hs, "ring values");
    }
    return s;
  }

  /// Replaces the contents with a read payload; cannot fail.
  void commit_payload(FileState& s) noexcept {
    const std::size_t n = s.saved_positions(), hs = head_size_;
    const std::size_t ns = std::min(sinks_, n), nr = n - std::min(n, s.lo);
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      std::copy_n(s.sink_keys.data() + lh * ns * hs, ns * hs, sink_keys_.data() + lh * sinks_ * hs);
      std::copy_n(s.sink_values.data() + lh * ns * hs, ns * hs,
                  sink_values_.data() + lh * sinks_ * hs);
      for (std::size_t r = 0; r < nr; ++r) {
        const std::size_t at = (lh * ring_ + (s.lo + r - sinks_) % ring_) * hs;
        std::copy_n(s.ring_keys.data() + (lh * nr + r) * hs, hs, ring_keys_.data() + at);
        std::copy_n(s.ring_values.data() + (lh * nr + r) * hs, hs, ring_values_.data() + at);
      }
    }
    ledger_.restore(s.tokens, s.dropped);
    oldest_ = s.oldest;
    std::fill(written_.begin(), written_.end(), ledger_.size());
  }

 private:
  /// The lowest ring index attention is handed for cache indices [0, end) when w rows are
  /// written: past the sinks, the oldest still resident, and under a full streaming cache only
  /// query end-1's window.
  std::size_t ring_first(std::size_t w, std::size_t end) const {
    const std::size_t lo = resident_from(w, oldest_);
    const bool rotate = policy_ == WindowPolicy::kStreaming && end > sinks_ + window_;
    return rotate ? std::max(lo, end - window_) : lo;
  }

  /// Positions an append may add before index S + R, the first to reuse a ring slot.
  std::size_t before_wrap() const {
    const std::size_t size = ledger_.size();
    return size < sinks_ + ring_ ? sinks_ + ring_ - size : std::size_t{0};
  }

  /// The first ring index still resident in a store of n positions: what for_each_block reads.
  std::size_t resident_from(std::size_t n, std::size_t oldest) const {
    return std::max({sinks_, oldest, n > ring_ ? n - ring_ : 0});
  }

  std::size_t ring_row(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return (layer * n_kv_heads_ + kv_head) * ring_ + (index - sinks_) % ring_;
  }

  /// out [head_size] = key rotated by -d positions, the inverse of apply_rope's rotation by d.
  void rotate_back(const T* key, std::size_t d, T* out) const {
    const std::size_t half = head_size_ / 2;
    std::copy_n(key, head_size_, out);
    apply_rope(out, 1, head_size_, style_, rot_cos_.data() + d * half, rot_sin_.data() + d * half);
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t window_ = 1;
  std::size_t sinks_ = 0;
  WindowPolicy policy_ = WindowPolicy::kTrainedWindow;
  std::size_t max_chunk_ = 1;
  std::size_t capacity_ = 0;
  RopeStyle style_ = RopeStyle::kAdjacentPairs;
  std::size_t ring_ = 0;              // R = W - 1 + max_chunk slots per (layer, kv head)
  SequenceLedger ledger_;             // size, pending append, token ids [S + 2(R + max_chunk)]
  std::size_t oldest_ = 0;            // lowest non-sink index whose slot still holds it (≥ S)
  AlignedBuffer<T> sink_keys_;        // [n_layers][n_kv_heads][S][head_size] after RoPE
  AlignedBuffer<T> sink_values_;      // [n_layers][n_kv_heads][S][head_size]
  AlignedBuffer<T> ring_keys_;        // [n_layers][n_kv_heads][R][head_size] after RoPE at p_w(x)
  AlignedBuffer<T> ring_values_;      // [n_layers][n_kv_heads][R][head_size]
  AlignedBuffer<T> rot_cos_;          // [W][head_size/2] cos(-d θ_j), kStreaming only
  AlignedBuffer<T> rot_sin_;          // [W][head_size/2] sin(-d θ_j), kStreaming only
  std::vector<std::size_t> written_;  // [n_layers] rows written per layer (committed + pending)
};

static_assert(KvStore<WindowStore<float>>);
static_assert(MaskingKvStore<WindowStore<float>>);
static_assert(KvStore<WindowStore<double>>);

}  // namespace kvdecode
