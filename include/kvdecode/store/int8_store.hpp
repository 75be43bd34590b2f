// Int8Store<T>: a KV cache of 8-bit rows with one f16 (min, step) per (position, kv head) of
// keys and of values, ~27 % of the f32 cache for head_size 64. A decode step's attention reads its
// codes and ranges as stored (for_each_coded_block); a prefill chunk reads rows for_each_block
// dequantizes, kBlockRows at a time, into caller scratch.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/f16.hpp"
#include "kvdecode/detail/prefetch.hpp"
#include "kvdecode/detail/quantize.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/sequence_ledger.hpp"

namespace kvdecode {

/// Element order as ContiguousStore: [n_layers][n_kv_heads][capacity][head_size] codes for keys
/// and for values, plus [2][n_layers][n_kv_heads][capacity] f16 ranges (the mins, then the
/// steps) of each.
///
/// Why one range per (position, kv head) rather than per group of 32 values: a query head dots
/// exactly one such row, so the row's [min, max] is the natural range; its f16 pair costs
/// 4/head_size bytes per element (6.25 % at head_size 64, 3.1 % at 128) where a group-of-32
/// range costs 12.5 % whatever the head size and breaks the 27 % budget. Why asymmetric (min,
/// step) rather than a symmetric max|x| / 127: the same 4 bytes, and 255 steps over max − min
/// instead of over 2·max|x|, a finer step on every row that is not symmetric about 0
/// (docs/QUANTIZATION.md §3 measures it). The price of one range per row: an outlier channel
/// widens the step of its whole row (KIVI's observation about keys), which the 4-bit store
/// answers with per-channel key ranges (low_bit_store.hpp).
///
/// Quantization: min rounded down to f16, step = (max − min) / 255 rounded up to f16,
/// q = round((x − min) / step) in [0, 255], x̂ = min + q·step, so |x̂ − x| ≤ step / 2 for every
/// element (docs/QUANTIZATION.md derives what that means for scores and attention outputs).
/// Like the 4-bit store's ranges, a row beyond ±65504 has an infinite range, which attention
/// carries on like a NaN. Rows are quantized when written, so pending rows are read back
/// exactly as they will be after commit.
template <class T>
class Int8Store {
 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md;
  // tag 3 was this store with symmetric rows and f32 scales, a payload of the same size).
  static constexpr std::string_view kName = "int8";
  static constexpr std::uint32_t kFileTag = 8;
  /// Rows for_each_block dequantizes per sink call, as Q4Store's default group: 64 rows of K
  /// and V are 24 KiB of f32 scratch at head_size 48 (in a 32 KiB L1 while attention consumes
  /// them) and 64 KiB at 128 (in L2). 128 rows decoded the 15M shape at 16K context ~20 %
  /// slower (bench/store_bench.cpp).
  static constexpr std::size_t kBlockRows = 64;
  static constexpr float kLevels = 255.0f;  ///< the top code

  struct Options {
    std::size_t capacity = 0;  ///< positions it holds; 0 means cfg.seq_len
  };

  /// A byte code per element and an f16 (min, step) per row of K and of V, capacity × n_layers
  /// × n_kv_heads × head_size and capacity × n_layers × n_kv_heads × 2 × sizeof(f16) bytes per
  /// buffer as allocated, and the token ids: all reserved up front.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t cap = detail::capacity_or_seq_len(o.capacity, cfg);
    const std::uint64_t codes =
        detail::sat_mul({cap, d.heads(), d.head_size, sizeof(std::uint8_t)});
    const std::uint64_t ranges = detail::sat_mul({cap, d.heads(), 2, sizeof(std::uint16_t)});
    return detail::sat_add({detail::sat_mul({2, aligned_allocation_bytes(codes)}),
                            detail::sat_mul({2, aligned_allocation_bytes(ranges)}),
                            token_id_bytes(cap)});
  }

  Int8Store() = default;
  Int8Store(const ModelConfig& cfg, const Options& options) : Int8Store(cfg, options.capacity) {}
  /// A cache for `capacity` positions of the model `cfg`; capacity 0 means cfg.seq_len.
  explicit Int8Store(const ModelConfig& cfg, std::size_t capacity = 0)
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        capacity_(capacity == 0 ? static_cast<std::size_t>(cfg.seq_len) : capacity) {
    cfg.validate();
    KVDECODE_CHECK(
        capacity_ <= std::numeric_limits<std::size_t>::max() / 2 /
                         (n_layers_ * n_kv_heads_ * (head_size_ + 2 * sizeof(std::uint16_t))),
        "Int8Store: capacity ", capacity_, " positions overflow the store's size");
    rows_ = n_layers_ * n_kv_heads_ * capacity_;
    keys_ = AlignedBuffer<std::uint8_t>(rows_ * head_size_);
    values_ = AlignedBuffer<std::uint8_t>(keys_.size());
    key_ranges_ = AlignedBuffer<std::uint16_t>(2 * rows_);
    value_ranges_ = AlignedBuffer<std::uint16_t>(key_ranges_.size());
    ledger_ = SequenceLedger("Int8Store", capacity_);
  }

  std::size_t size() const { return ledger_.size(); }
  std::size_t pending() const { return ledger_.pending(); }
  std::size_t capacity() const { return capacity_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  std::size_t memory_bytes() const {
    return keys_.allocated_bytes() + values_.allocated_bytes() + key_ranges_.allocated_bytes() +
           value_ranges_.allocated_bytes() + ledger_.memory_bytes();
  }
  Options options() const { return {capacity_}; }
  std::size_t max_append() const { return ledger_.room(); }
  /// Codes and ranges of every row of [0, end).
  std::uint64_t read_bytes(std::size_t end) const {
    return 2 * end * n_layers_ * n_kv_heads_ *
           (head_size_ * sizeof(std::uint8_t) + 2 * sizeof(std::uint16_t));
  }
  /// Rows are quantized on their own, so dropping the newest ones changes no other row.
  std::size_t max_exact_rollback() const { return ledger_.size(); }
  std::size_t rope_position(std::size_t index) const { return index; }
  /// Keys and values of kBlockRows rows: [2][kBlockRows][head_size].
  std::size_t block_scratch_size() const { return 2 * kBlockRows * head_size_; }

  void begin_append(std::span<const std::int32_t> tokens) { ledger_.begin_append(tokens); }

  std::span<const std::int32_t> tokens() const { return ledger_.tokens(); }

  /// Quantizes pending position i of a layer; k and v are [kv_dim] rows, heads one after another.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    const std::size_t index = ledger_.size() + i;
    for (std::size_t h = 0; h < n_kv_heads_; ++h) {
      const std::size_t row = (layer * n_kv_heads_ + h) * capacity_ + index;
      quantize(k + h * head_size_, keys_.data() + row * head_size_, key_ranges_[row],
               key_ranges_[rows_ + row]);
      quantize(v + h * head_size_, values_.data() + row * head_size_, value_ranges_[row],
               value_ranges_[rows_ + row]);
    }
  }

  void commit_append() { ledger_.commit_append(); }
  /// Pending rows lie past size(), so dropping them restores the store exactly.
  void cancel_append() noexcept { ledger_.cancel_append(); }

  void truncate(std::size_t n) { ledger_.truncate(n); }
  void reset() { ledger_.reset(); }

  /// Dequantizes cache indices [0, end) of one (layer, kv head) kBlockRows rows at a time into
  /// scratch [2][kBlockRows][head_size] and hands each block to sink; the block's pointers are
  /// valid only during that call.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T> scratch,
                      Sink&& sink) const {
    if (end == 0) return;
    KVDECODE_CHECK(scratch.size() >= block_scratch_size(), "Int8Store::for_each_block: scratch of ",
                   scratch.size(), " elements, expected at least ", block_scratch_size());
    T* const ks = scratch.data();                            // [kBlockRows][head_size]
    T* const vs = scratch.data() + kBlockRows * head_size_;  // [kBlockRows][head_size]
    const std::size_t base = (layer * n_kv_heads_ + kv_head) * capacity_;
    for (std::size_t r0 = 0; r0 < end; r0 += kBlockRows) {
      const std::size_t n = std::min(kBlockRows, end - r0);
      dequantize(keys_.data() + (base + r0) * head_size_, key_ranges_.data() + base + r0, n, ks);
      dequantize(values_.data() + (base + r0) * head_size_, value_ranges_.data() + base + r0, n,
                 vs);
      sink(KvBlock<T>{ks, vs, head_size_, r0, n});
    }
  }

  /// Cache indices [0, end) of one (layer, kv head) as stored: kBlockRows rows of codes and
  /// ranges per sink call, pointers into the store (CodedKvStore).
  template <class Sink>
  void for_each_coded_block(std::size_t layer, std::size_t kv_head, std::size_t end,
                            Sink&& sink) const {
    const std::size_t base = (layer * n_kv_heads_ + kv_head) * capacity_;
    for (std::size_t r0 = 0; r0 < end; r0 += kBlockRows) {
      const std::size_t n = std::min(kBlockRows, end - r0);
      const std::size_t row = base + r0;
      if (r0 + kBlockRows < end) {  // the next block's ranges, read a few lines at a time
        const std::size_t next = std::min(kBlockRows, end - r0 - kBlockRows);
        for (const std::uint16_t* at :
             {key_ranges_.data() + row, key_ranges_.data() + rows_ + row,
              value_ranges_.data() + row, value_ranges_.data() + rows_ + row})
          detail::prefetch_bytes(at + kBlockRows, next * sizeof(std::uint16_t));
      }
      sink(Int8KvBlock{keys_.data() + row * head_size_, values_.data() + row * head_size_,
                       key_ranges_.data() + row, key_ranges_.data() + rows_ + row,
                       value_ranges_.data() + row, value_ranges_.data() + rows_ + row, r0, n});
    }
  }

  /// The stored codes and f16 (min, step) of one key row (layer, kv head, cache index), for
  /// tests and tools.
  std::span<const std::uint8_t> key_codes(std::size_t layer, std::size_t kv_head,
                                          std::size_t index) const {
    return {keys_.data() + row(layer, kv_head, index) * head_size_, head_size_};
  }
  std::uint16_t key_min(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return key_ranges_[row(layer, kv_head, index)];
  }
  std::uint16_t key_step(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return key_ranges_[rows_ + row(layer, kv_head, index)];
  }

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md). The codes and
  // scales are saved as stored, so a restored store reads and continues bit for bit.

  static constexpr std::array<std::string_view, 0> kFileOptionNames = {};
  std::array<std::uint64_t, 0> file_options() const { return {}; }

  /// Token ids [n], then per (layer, kv head) key codes [n][head_size], value codes
  /// [n][head_size], key mins [n], key steps [n], value mins [n] and value steps [n] (f16).
  template <class Out>
  void save_payload(Out& out) const {
    const std::size_t n = ledger_.size();
    out.write(ledger_.tokens().data(), n);
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      out.write(keys_.data() + lh * capacity_ * head_size_, n * head_size_);
      out.write(values_.data() + lh * capacity_ * head_size_, n * head_size_);
      out.write(key_ranges_.data() + lh * capacity_, n);
      out.write(key_ranges_.data() + rows_ + lh * capacity_, n);
      out.write(value_ranges_.data() + lh * capacity_, n);
      out.write(value_ranges_.data() + rows_ + lh * capacity_, n);
    }
  }

  /// A payload read by read_payload(), waiting for commit_payload().
  struct FileState {
    std::vector<std::int32_t> tokens;         // [n]
    std::vector<std::uint8_t> keys;           // [n_layers][n_kv_heads][n][head_size] codes
    std::vector<std::uint8_t> values;         // [n_layers][n_kv_heads][n][head_size] codes
    std::vector<std::uint16_t> key_ranges;    // [n_layers][n_kv_heads][2][n] mins, steps (f16)
    std::vector<std::uint16_t> value_ranges;  // [n_layers][n_kv_heads][2][n] mins, steps (f16)
    std::span<const std::int32_t> saved_tokens() const { return tokens; }
  };

  /// Reads the payload of in.n_tokens() positions (the caller checked they fit the capacity).
  template <class In>
  FileState read_payload(In& in) const {
    const auto n = static_cast<std::size_t>(in.n_tokens());
    const std::size_t heads = n_layers_ * n_kv_heads_;
    FileState s;
    s.tokens = in.tokens(n, "token ids");
    in.alloc(s.keys, heads * n * head_size_, "key codes");
    in.alloc(s.values, s.keys.size(), "value codes");
    in.alloc(s.key_ranges, heads * 2 * n, "key ranges");
    in.alloc(s.value_ranges, heads * 2 * n, "value ranges");
    for (std::size_t lh = 0; lh < heads; ++lh) {
      in.read(s.keys.data() + lh * n * head_size_, n * head_size_, "key codes");
      in.read(s.values.data() + lh * n * head_size_, n * head_size_, "value codes");
      in.read(s.key_ranges.data() + lh * 2 * n, 2 * n, "key ranges");
      in.read(s.value_ranges.data() + lh * 2 * n, 2 * n, "value ranges");
    }
    return s;
  }

  /// Replaces the contents with a read payload; cannot fail.
  void commit_payload(FileState& s) noexcept {
    const std::size_t n = s.tokens.size();
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      std::copy_n(s.keys.data() + lh * n * head_size_, n * head_size_,
                  keys_.data() + lh * capacity_ * head_size_);
      std::copy_n(s.values.data() + lh * n * head_size_, n * head_size_,
                  values_.data() + lh * capacity_ * head_size_);
      const std::uint16_t* kr = s.key_ranges.data() + lh * 2 * n;    // [2][n]
      const std::uint16_t* vr = s.value_ranges.data() + lh * 2 * n;  // [2][n]
      std::copy_n(kr, n, key_ranges_.data() + lh * capacity_);
      std::copy_n(kr + n, n, key_ranges_.data() + rows_ + lh * capacity_);
      std::copy_n(vr, n, value_ranges_.data() + lh * capacity_);
      std::copy_n(vr + n, n, value_ranges_.data() + rows_ + lh * capacity_);
    }
    ledger_.restore(s.tokens);
  }

 private:
  std::size_t row(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return (layer * n_kv_heads_ + kv_head) * capacity_ + index;
  }

  /// q [head_size] = round((x − min) / step) and the row's f16 (min, step): min rounded down
  /// and step up, so every code lies in [0, 255] and errs by at most step / 2. A non-finite
  /// row (or one beyond ±65504) gets a non-finite range that carries on to attention.
  void quantize(const T* x, std::uint8_t* q, std::uint16_t& mn, std::uint16_t& step) const {
    float lo = 0.0f, hi = 0.0f;
    detail::value_range(x, head_size_, 1, lo, hi);
    detail::f16_range(lo, hi, kLevels, mn, step);
    const float m = detail::f16_to_float(mn), s = detail::f16_to_float(step);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (std::size_t c = 0; c < head_size_; ++c)
      q[c] = detail::range_code(static_cast<float>(x[c]), m, inv, kLevels);
  }

  /// out [n][head_size] = min [n] + q [n][head_size] · step [n], the ranges [2][rows_] from
  /// `ranges` (mins, then steps), with the active kernel set (detail/quantize.hpp).
  void dequantize(const std::uint8_t* q, const std::uint16_t* ranges, std::size_t n, T* out) const {
    detail::dequantize_int8(active_kernel_set(), q, ranges, ranges + rows_, n, head_size_, out);
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t capacity_ = 0;
  std::size_t rows_ = 0;                       // n_layers × n_kv_heads × capacity
  SequenceLedger ledger_;                      // size, pending append, token ids [capacity]
  AlignedBuffer<std::uint8_t> keys_;           // [n_layers][n_kv_heads][capacity][head_size]
  AlignedBuffer<std::uint8_t> values_;         // [n_layers][n_kv_heads][capacity][head_size]
  AlignedBuffer<std::uint16_t> key_ranges_;    // [2][n_layers][n_kv_heads][capacity] f16
  AlignedBuffer<std::uint16_t> value_ranges_;  // [2][n_layers][n_kv_heads][capacity] f16
};

static_assert(KvStore<Int8Store<float>>);
static_assert(KvStore<Int8Store<double>>);

}  // namespace kvdecode
