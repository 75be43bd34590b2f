// ContiguousStore<T>: the plain KV cache. Per layer one preallocated block of keys and one of
// values, head-major, so attention streams each kv head's history as one dense matrix.
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
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/sequence_ledger.hpp"

namespace kvdecode {

/// Element order [n_layers][n_kv_heads][capacity][head_size] for keys and for values.
///
/// Why head-major rather than run.c's [layer][pos][kv_dim]: attention for one kv head reads all
/// of that head's positions, so its keys form one contiguous [T][head_size] matrix (a unit-stride
/// GEMV/GEMM operand, prefetcher-friendly, no strided gather), and the kv_mul query heads that
/// share it reuse it from cache. Appending a token writes n_kv_heads short rows instead of one
/// long one, which is negligible next to reading T rows. Keys are stored after RoPE, so they are
/// computed once and never touched again.
template <class T>
class ContiguousStore {
 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md).
  static constexpr std::string_view kName = "contiguous";
  static constexpr std::uint32_t kFileTag = 1;

  struct Options {
    std::size_t capacity = 0;  ///< positions it holds; 0 means cfg.seq_len
  };

  /// Keys and values, n_layers × n_kv_heads × capacity × head_size × sizeof(T) bytes each as
  /// allocated, and the token ids: all of it reserved up front.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t cap = detail::capacity_or_seq_len(o.capacity, cfg);
    const std::uint64_t half = detail::sat_mul({cap, d.heads(), d.head_size, sizeof(T)});
    return detail::sat_add(
        {detail::sat_mul({2, aligned_allocation_bytes(half)}), token_id_bytes(cap)});
  }

  ContiguousStore() = default;
  ContiguousStore(const ModelConfig& cfg, const Options& options)
      : ContiguousStore(cfg, options.capacity) {}
  /// A cache for `capacity` positions of the model `cfg`; capacity 0 means cfg.seq_len.
  explicit ContiguousStore(const ModelConfig& cfg, std::size_t capacity = 0)
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        capacity_(capacity == 0 ? static_cast<std::size_t>(cfg.seq_len) : capacity) {
    cfg.validate();
    // The byte counts below fit size_t (a capacity past seq_len is allowed: positions beyond
    // the model's training length).
    KVDECODE_CHECK(capacity_ <= std::numeric_limits<std::size_t>::max() / 2 / sizeof(T) /
                                    (n_layers_ * n_kv_heads_ * head_size_),
                   "ContiguousStore: capacity ", capacity_, " positions overflow the store's size");
    keys_ = AlignedBuffer<T>(n_layers_ * n_kv_heads_ * capacity_ * head_size_);
    values_ = AlignedBuffer<T>(keys_.size());
    ledger_ = SequenceLedger("ContiguousStore", capacity_);
  }

  std::size_t size() const { return ledger_.size(); }
  std::size_t pending() const { return ledger_.pending(); }
  std::size_t capacity() const { return capacity_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  std::size_t memory_bytes() const {
    return keys_.allocated_bytes() + values_.allocated_bytes() + ledger_.memory_bytes();
  }
  Options options() const { return {capacity_}; }
  std::size_t max_append() const { return ledger_.room(); }
  /// Every row of [0, end), read in place.
  std::uint64_t read_bytes(std::size_t end) const {
    return 2 * end * n_layers_ * n_kv_heads_ * head_size_ * sizeof(T);
  }
  /// Dropped rows are only overwritten by later appends, so any rollback is exact.
  std::size_t max_exact_rollback() const { return ledger_.size(); }
  std::size_t rope_position(std::size_t index) const { return index; }
  std::size_t block_scratch_size() const { return 0; }

  void begin_append(std::span<const std::int32_t> tokens) { ledger_.begin_append(tokens); }

  /// The token ids of the committed positions.
  std::span<const std::int32_t> tokens() const { return ledger_.tokens(); }

  /// Stores pending position i of a layer; k and v are [kv_dim] rows, heads one after another.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    const std::size_t index = ledger_.size() + i;
    for (std::size_t h = 0; h < n_kv_heads_; ++h) {
      const std::size_t at = offset(layer, h, index);
      std::copy_n(k + h * head_size_, head_size_, keys_.data() + at);
      std::copy_n(v + h * head_size_, head_size_, values_.data() + at);
    }
  }

  void commit_append() { ledger_.commit_append(); }
  void cancel_append() noexcept { ledger_.cancel_append(); }

  /// Rollback: keeps the first n positions. The dropped rows are simply overwritten later.
  void truncate(std::size_t n) { ledger_.truncate(n); }
  void reset() { ledger_.reset(); }

  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T>,
                      Sink&& sink) const {
    if (end == 0) return;
    const std::size_t at = offset(layer, kv_head, 0);
    sink(KvBlock<T>{keys_.data() + at, values_.data() + at, head_size_, 0, end});
  }

  /// The cached key / value of one (layer, kv head, cache index): head_size elements.
  std::span<const T> key(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return {keys_.data() + offset(layer, kv_head, index), head_size_};
  }
  std::span<const T> value(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return {values_.data() + offset(layer, kv_head, index), head_size_};
  }

  /// Makes this store an exact copy of other (same shape); the cost is a full memcpy, so it has
  /// a name instead of a copy constructor.
  void copy_from(const ContiguousStore& other) {
    KVDECODE_CHECK(other.keys_.size() == keys_.size(), "ContiguousStore::copy_from: shapes differ");
    keys_.copy_from(other.keys_);
    values_.copy_from(other.values_);
    ledger_ = other.ledger_;  // within the reservation of the same capacity: no allocation
  }

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md).

  /// No option beyond the shape: a file restores into any capacity that holds its tokens.
  static constexpr std::array<std::string_view, 0> kFileOptionNames = {};
  std::array<std::uint64_t, 0> file_options() const { return {}; }

  /// The committed positions: token ids [n], then per (layer, kv head) keys [n][head_size] and
  /// values [n][head_size], each one copy out of the head-major buffers.
  template <class Out>
  void save_payload(Out& out) const {
    const std::size_t n = ledger_.size();
    out.write(ledger_.tokens().data(), n);
    for (std::size_t l = 0; l < n_layers_; ++l)
      for (std::size_t h = 0; h < n_kv_heads_; ++h) {
        out.write(keys_.data() + offset(l, h, 0), n * head_size_);
        out.write(values_.data() + offset(l, h, 0), n * head_size_);
      }
  }

  /// A payload read by read_payload(), waiting for commit_payload().
  struct FileState {
    std::vector<std::int32_t> tokens;  // [n]
    std::vector<T> keys;               // [n_layers][n_kv_heads][n][head_size]
    std::vector<T> values;             // [n_layers][n_kv_heads][n][head_size]
    std::span<const std::int32_t> saved_tokens() const { return tokens; }
  };

  /// Reads the payload of in.n_tokens() positions (the caller checked they fit the capacity).
  template <class In>
  FileState read_payload(In& in) const {
    const auto n = static_cast<std::size_t>(in.n_tokens());
    FileState s;
    s.tokens = in.tokens(n, "token ids");
    const std::size_t run = n * head_size_;
    in.alloc(s.keys, n_layers_ * n_kv_heads_ * run, "keys");
    in.alloc(s.values, s.keys.size(), "values");
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      in.read(s.keys.data() + lh * run, run, "keys");
      in.read(s.values.data() + lh * run, run, "values");
    }
    return s;
  }

  /// Replaces the contents with a read payload; cannot fail.
  void commit_payload(FileState& s) noexcept {
    const std::size_t n = s.tokens.size();
    const std::size_t run = n * head_size_;
    for (std::size_t l = 0; l < n_layers_; ++l)
      for (std::size_t h = 0; h < n_kv_heads_; ++h) {
        const std::size_t lh = l * n_kv_heads_ + h;
        std::copy_n(s.keys.data() + lh * run, run, keys_.data() + offset(l, h, 0));
        std::copy_n(s.values.data() + lh * run, run, values_.data() + offset(l, h, 0));
      }
    ledger_.restore(s.tokens);
  }

 private:
  std::size_t offset(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return ((layer * n_kv_heads_ + kv_head) * capacity_ + index) * head_size_;
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t capacity_ = 0;
  SequenceLedger ledger_;    // size, pending append, token ids [capacity reserved]
  AlignedBuffer<T> keys_;    // [n_layers][n_kv_heads][capacity][head_size]
  AlignedBuffer<T> values_;  // [n_layers][n_kv_heads][capacity][head_size]
};

static_assert(KvStore<ContiguousStore<float>>);
static_assert(KvStore<ContiguousStore<double>>);

}  // namespace kvdecode
