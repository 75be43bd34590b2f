// LowBitStore<T, Bits>: a 4- or 2-bit KV cache in the KIVI style (Liu et al. 2024): keys
// quantized per channel over a group of G positions, values per token, the newest R positions
// kept exact, and optionally every row rotated by a fixed orthogonal transform before it is
// quantized. Attention reads it one group at a time: as codes and ranges in a decode step
// (for_each_coded_block), decoded into caller scratch for a prefill chunk (for_each_block).
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
#include "kvdecode/detail/rotation.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/sequence_ledger.hpp"

namespace kvdecode {

/// Asymmetric codes of Bits bits: x̂ = min + q·s with s = (max − min) / L, L = 2^Bits − 1,
/// q = round((x − min) / s) ∈ [0, L], so |x̂ − x| ≤ s / 2. 8 / Bits codes per byte, channel c in
/// bits Bits·(c mod 8/Bits) of byte c / (8/Bits). min and s are f16, min rounded down and s up so
/// that [min, min + L·s] still covers the range.
///
/// - Keys: (min, s) per (layer, kv head, group of G positions, channel): a few key channels are
///   large (KIVI §3), and a per-channel range keeps them from widening every other channel.
/// - Values: (min, s) per (layer, kv head, position) over its head_size channels: attention
///   mixes value rows with weights summing to 1, so a per-token error stays per-token.
/// - The residual: position p is quantized, with its group, once R newer positions exist: the
///   last R positions and the group being filled behind them (R to R + G − 1 rows) stay in T,
///   in a ring of R/G + 1 group slots per (layer, kv head). R is a multiple of G (0 allowed).
/// - Rotation (options().rotate): rows are quantized as y = H D x / √b (detail/rotation.hpp, b
///   the largest power of two dividing head_size) and rotated back when decoded, so attention
///   and the model see ordinary rows; it spreads an outlier channel over b channels.
///
/// Transactions: a pending append can overwrite committed ring rows only once it quantizes the
/// groups behind them; begin_append then copies the ring aside and cancel_append() copies it
/// back, so a cancel restores the store exactly. Rows must be written in order within each
/// layer (as Model does), because a write can complete a group's quantization.
template <class T, unsigned Bits>
class LowBitStore {
  static_assert(Bits == 4 || Bits == 2, "LowBitStore: 4 or 2 bits");

 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md).
  static constexpr std::string_view kName = Bits == 4 ? "q4" : "q2";
  static constexpr std::uint32_t kFileTag = Bits == 4 ? 6 : 7;
  static constexpr std::size_t kDefaultGroup = 64;
  static constexpr std::size_t kDefaultResidual = 128;
  static constexpr unsigned kBits = Bits;
  static constexpr float kLevels = static_cast<float>((1u << Bits) - 1);
  static constexpr std::size_t kCodesPerByte = 8 / Bits;
  /// The type's name in error messages.
  static constexpr std::string_view kTypeName = Bits == 4 ? "Q4Store" : "Q2Store";

  struct Options {
    std::size_t capacity = 0;                 ///< positions it holds; 0 means cfg.seq_len
    std::size_t group = kDefaultGroup;        ///< G: positions per key group
    std::size_t residual = kDefaultResidual;  ///< R: newest positions kept exact, a multiple of G
    bool rotate = false;                      ///< quantize rotated rows (see the class comment)
  };

  /// Every byte a store of these options owns, each buffer as allocated: per (layer, kv head)
  /// and full group, the codes of K and of V (G × head_size × Bits / 8 each), an f16 (min,
  /// step) pair per key channel and one per value row; the ring of (R/G + 1) × G rows of K and
  /// V in T and its cancel copy; the work rows (2 × G × head_size + 2 × head_size + 2 × G
  /// elements of T), the sign vector when rotating, the token ids and the per-layer counters.
  /// capacity / G groups can be quantized; a trailing partial group stays in the ring.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    check_options(o.group, o.residual);
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t g = o.group;
    const std::uint64_t cap = detail::capacity_or_seq_len(o.capacity, cfg);
    const std::uint64_t group_rows = detail::sat_mul({d.heads(), cap / g});  // groups of all heads
    const std::uint64_t codes = detail::sat_mul({group_rows, g, d.head_size}) / kCodesPerByte;
    // One f16 buffer of the mins, one of the steps: per key channel, and per value row.
    const std::uint64_t key_ranges = detail::sat_mul({group_rows, d.head_size, 2});
    const std::uint64_t value_ranges = detail::sat_mul({group_rows, g, 2});
    const std::uint64_t ring =
        detail::sat_mul({d.heads(), o.residual / g + 1, g, d.head_size, sizeof(T)});
    const std::uint64_t work =
        detail::sat_mul({detail::sat_add({detail::sat_mul({2, g, d.head_size}),
                                          detail::sat_mul({2, d.head_size}), 2 * g}),
                         sizeof(T)});
    return detail::sat_add(
        {detail::sat_mul({2, aligned_allocation_bytes(codes)}),
         detail::sat_mul({2, aligned_allocation_bytes(key_ranges)}),
         detail::sat_mul({2, aligned_allocation_bytes(value_ranges)}),
         detail::sat_mul({4, aligned_allocation_bytes(ring)}), aligned_allocation_bytes(work),
         o.rotate ? aligned_allocation_bytes(d.head_size * sizeof(float)) : 0, token_id_bytes(cap),
         detail::sat_mul({2, d.layers, sizeof(std::size_t)})});
  }

  LowBitStore() = default;
  LowBitStore(const ModelConfig& cfg, const Options& o)
      : LowBitStore(cfg, o.capacity, o.group, o.residual, o.rotate) {}
  /// A cache for `capacity` positions (0 means cfg.seq_len) with key groups of `group`
  /// positions and the newest `residual` positions exact; group ≥ 2, residual a multiple of
  /// group, head_size a multiple of 8 / Bits.
  explicit LowBitStore(const ModelConfig& cfg, std::size_t capacity = 0,
                       std::size_t group = kDefaultGroup, std::size_t residual = kDefaultResidual,
                       bool rotate = false)
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        capacity_(capacity == 0 ? static_cast<std::size_t>(cfg.seq_len) : capacity),
        group_(group),
        residual_(residual),
        rotate_(rotate) {
    cfg.validate();
    KVDECODE_CHECK(head_size_ % kCodesPerByte == 0, kTypeName, ": head_size ", head_size_,
                   ", expected a multiple of ", kCodesPerByte, " (codes per byte)");
    // The ring holds (R/G + 1) groups per (layer, kv head): its bytes must fit size_t too.
    const std::size_t heads = n_layers_ * n_kv_heads_;
    KVDECODE_CHECK(
        group_ <= std::numeric_limits<std::size_t>::max() / 8 / sizeof(T) / (heads * head_size_),
        kTypeName, ": group size ", group_, " overflows the store's size");
    check_options(group_, residual_);
    slots_ = residual_ / group_ + 1;
    KVDECODE_CHECK(slots_ <= std::numeric_limits<std::size_t>::max() / 8 / sizeof(T) /
                                 (heads * head_size_ * group_),
                   kTypeName, ": residual ", residual_, " overflows the store's size");
    KVDECODE_CHECK(capacity_ <= std::numeric_limits<std::size_t>::max() / 4 / sizeof(float) /
                                    (heads * (head_size_ + group_)),
                   kTypeName, ": capacity ", capacity_, " positions overflow the store's size");
    n_groups_ = capacity_ / group_;  // a trailing partial group never fills: it stays in the ring
    const std::size_t code_bytes = group_ * head_size_ / kCodesPerByte;  // one group's rows
    key_codes_ = AlignedBuffer<std::uint8_t>(heads * n_groups_ * code_bytes);
    value_codes_ = AlignedBuffer<std::uint8_t>(key_codes_.size());
    key_min_ = AlignedBuffer<std::uint16_t>(heads * n_groups_ * head_size_);
    key_step_ = AlignedBuffer<std::uint16_t>(key_min_.size());
    value_min_ = AlignedBuffer<std::uint16_t>(heads * n_groups_ * group_);
    value_step_ = AlignedBuffer<std::uint16_t>(value_min_.size());
    ring_keys_ = AlignedBuffer<T>(heads * slots_ * group_ * head_size_);
    ring_values_ = AlignedBuffer<T>(ring_keys_.size());
    saved_keys_ = AlignedBuffer<T>(ring_keys_.size());
    saved_values_ = AlignedBuffer<T>(ring_keys_.size());
    work_ = AlignedBuffer<T>(block_scratch_size());
    if (rotate_) {
      signs_ = AlignedBuffer<float>(head_size_);
      detail::rotation_signs(head_size_, signs_.data());
    }
    written_.assign(n_layers_, 0);
    quantized_layer_.assign(n_layers_, 0);
    ledger_ = SequenceLedger(kTypeName, capacity_);
  }

  std::size_t size() const { return ledger_.size(); }
  std::size_t pending() const { return ledger_.pending(); }
  std::size_t capacity() const { return capacity_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  std::size_t group_size() const { return group_; }
  std::size_t residual() const { return residual_; }
  bool rotates() const { return rotate_; }
  /// Groups quantized among the committed positions.
  std::size_t quantized_groups() const { return quantized_; }
  /// The fixed full-precision part: the ring and its cancel copy, four buffers of
  /// n_layers × n_kv_heads × (R/G + 1) × G × head_size × sizeof(T) bytes as allocated.
  std::size_t residual_bytes() const {
    return ring_keys_.allocated_bytes() + ring_values_.allocated_bytes() +
           saved_keys_.allocated_bytes() + saved_values_.allocated_bytes();
  }
  /// Every byte owned: codes, (min, step) pairs, the ring, work rows, signs, token ids and
  /// counters.
  std::size_t memory_bytes() const {
    return key_codes_.allocated_bytes() + value_codes_.allocated_bytes() +
           key_min_.allocated_bytes() + key_step_.allocated_bytes() + value_min_.allocated_bytes() +
           value_step_.allocated_bytes() + residual_bytes() + work_.allocated_bytes() +
           signs_.allocated_bytes() + ledger_.memory_bytes() +
           (written_.size() + quantized_layer_.size()) * sizeof(std::size_t);
  }
  Options options() const { return {capacity_, group_, residual_, rotate_}; }
  std::size_t max_append() const { return ledger_.room(); }
  /// The quantized groups of [0, end) as codes and (min, step) pairs, the rest of it from the
  /// ring in full precision.
  std::uint64_t read_bytes(std::size_t end) const {
    const std::size_t heads = n_layers_ * n_kv_heads_;
    const std::size_t quantized =
        std::min({end / group_, n_groups_, std::max(quantized_, quantized_at(end))});
    const std::size_t group_bytes =
        2 * group_ * head_size_ / kCodesPerByte + 4 * head_size_ + 4 * group_;
    const std::size_t exact = end - quantized * group_;
    return heads * (quantized * group_bytes + 2 * exact * head_size_ * sizeof(T));
  }
  /// The newest rows that can be dropped as if never appended: the store then holds what one
  /// that stopped there would, which keeps exact every position less than R old. Dropping
  /// more keeps the groups quantized that such a store would hold exact (and truncating into
  /// a quantized group returns its kept rows to the ring decoded).
  std::size_t max_exact_rollback() const {
    const std::size_t size = ledger_.size();
    return size - std::min(size, quantized_ > 0 ? quantized_ * group_ + residual_ : 0);
  }
  /// The most positions the next append may bring so that no group is quantized after its
  /// first row: every row then reads what a one-at-a-time decode reads, and
  /// max_exact_rollback() afterwards covers all rows but the first. What speculative
  /// verification appends at most.
  std::size_t max_exact_append() const {
    if (quantized_ >= n_groups_) return ledger_.room();
    const std::size_t next = (quantized_ + 1) * group_ + residual_ - ledger_.size();  // ≥ 1
    return std::min(ledger_.room(), next == 1 ? group_ : next - 1);
  }
  std::size_t rope_position(std::size_t index) const { return index; }
  /// One group of keys and values [2][G][head_size], then its ranges decoded to T
  /// [2 × head_size + 2 × G].
  std::size_t block_scratch_size() const {
    return 2 * group_ * head_size_ + 2 * head_size_ + 2 * group_;
  }

  void begin_append(std::span<const std::int32_t> tokens) {
    const std::size_t n = tokens.size(), size = ledger_.size();
    ledger_.begin_append(tokens);
    // Pending row p lands in the slot of group p / G − slots; committed rows from
    // quantized_ · G on are overwritten once p reaches quantized_ · G + slots · G.
    const std::size_t first = quantized_ * group_;
    saved_ = size > first && size + n > first + slots_ * group_;
    if (saved_) {
      std::copy_n(ring_keys_.data(), ring_keys_.size(), saved_keys_.data());
      std::copy_n(ring_values_.data(), ring_values_.size(), saved_values_.data());
    }
  }

  std::span<const std::int32_t> tokens() const { return ledger_.tokens(); }

  /// Stores pending position i of a layer (k, v [kv_dim]); rows arrive in order per layer. The
  /// write that makes a group R positions old quantizes it.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    const std::size_t index = ledger_.size() + i;
    KVDECODE_CHECK(i < ledger_.pending() && index == written_[layer], kTypeName, "::write: layer ",
                   layer, " expects pending row ", written_[layer] - ledger_.size(), " of ",
                   ledger_.pending(), ", got ", i, " (rows are written in order)");
    for (std::size_t h = 0; h < n_kv_heads_; ++h) {
      const std::size_t at = ring_row(layer, h, index) * head_size_;
      std::copy_n(k + h * head_size_, head_size_, ring_keys_.data() + at);
      std::copy_n(v + h * head_size_, head_size_, ring_values_.data() + at);
    }
    written_[layer] = index + 1;
    std::size_t& q = quantized_layer_[layer];
    while (q < n_groups_ && (q + 1) * group_ + residual_ <= index + 1) {
      for (std::size_t h = 0; h < n_kv_heads_; ++h) quantize_group(layer, h, q);
      ++q;
    }
  }

  void commit_append() {
    ledger_.commit_append();
    saved_ = false;
    quantized_ = quantized_layer_.empty() ? 0 : quantized_layer_[0];
    std::fill(written_.begin(), written_.end(), ledger_.size());
  }

  /// Restores the ring if the append could have overwritten committed rows; groups the append
  /// quantized are simply forgotten.
  void cancel_append() noexcept {
    if (saved_) {
      std::copy_n(saved_keys_.data(), saved_keys_.size(), ring_keys_.data());
      std::copy_n(saved_values_.data(), saved_values_.size(), ring_values_.data());
    }
    ledger_.cancel_append();
    saved_ = false;
    std::fill(written_.begin(), written_.end(), ledger_.size());
    std::fill(quantized_layer_.begin(), quantized_layer_.end(), quantized_);
  }

  /// Rollback to the first n positions. Rows in the ring are kept as they are (the groups
  /// already quantized stay so, and fewer than R rows stay exact until the sequence grows
  /// again). When n falls inside a quantized group, its kept rows return to the ring decoded
  /// and are quantized again when the group is: those rows then carry two quantization
  /// errors, at most s₁/2 + s₂/2 (docs/QUANTIZATION.md).
  void truncate(std::size_t n) {
    ledger_.check_truncate(n);
    if (n < quantized_ * group_) {
      const std::size_t g = n / group_;
      if (n % group_ != 0) {
        for (std::size_t l = 0; l < n_layers_; ++l)
          for (std::size_t h = 0; h < n_kv_heads_; ++h) {
            const std::size_t at = ring_row(l, h, g * group_) * head_size_;
            decode_group(l, h, g, n % group_, ring_keys_.data() + at, ring_values_.data() + at,
                         work_.data() + 2 * group_ * head_size_);
          }
      }
      quantized_ = g;
    }
    ledger_.truncate(n);
    std::fill(written_.begin(), written_.end(), ledger_.size());
    std::fill(quantized_layer_.begin(), quantized_layer_.end(), quantized_);
  }
  void reset() {
    ledger_.reset();
    quantized_ = 0;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), 0);
    std::fill(quantized_layer_.begin(), quantized_layer_.end(), 0);
  }

  /// Cache indices [0, end) of one (layer, kv head): each quantized group decoded into scratch
  /// [2][G][head_size] (its ranges in the scratch's tail), then the ring's rows in place.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T> scratch,
                      Sink&& sink) const {
    if (end == 0) return;
    KVDECODE_CHECK(scratch.size() >= block_scratch_size(), kTypeName,
                   "::for_each_block: scratch of ", scratch.size(), " elements, expected at least ",
                   block_scratch_size());
    T* const ks = scratch.data();                                // [G][head_size]
    T* const vs = scratch.data() + group_ * head_size_;          // [G][head_size]
    T* const ranges = scratch.data() + 2 * group_ * head_size_;  // [2 × head_size + 2 × G]
    const std::size_t quantized = quantized_layer_[layer];
    for (std::size_t g = 0; g * group_ < end; ++g) {
      const std::size_t r0 = g * group_;
      const std::size_t n = std::min(group_, end - r0);
      if (g < quantized) {
        decode_group(layer, kv_head, g, n, ks, vs, ranges);
        sink(KvBlock<T>{ks, vs, head_size_, r0, n});
      } else {
        const std::size_t at = ring_row(layer, kv_head, r0) * head_size_;
        sink(KvBlock<T>{ring_keys_.data() + at, ring_values_.data() + at, head_size_, r0, n});
      }
    }
  }

  /// Cache indices [0, end) of one (layer, kv head) as stored: each quantized group as codes
  /// with its f16 ranges (and the signs when rotated), then the ring's rows in full precision
  /// (CodedKvStore).
  template <class Sink>
  void for_each_coded_block(std::size_t layer, std::size_t kv_head, std::size_t end,
                            Sink&& sink) const {
    const std::size_t quantized = quantized_layer_[layer];
    const std::size_t code_bytes = group_ * head_size_ / kCodesPerByte;
    for (std::size_t g = 0; g * group_ < end; ++g) {
      const std::size_t r0 = g * group_;
      const std::size_t n = std::min(group_, end - r0);
      if (g < quantized) {
        const std::size_t gi = group_base(layer, kv_head, g);
        if (g + 1 < quantized) {  // the next group's ranges, read a few lines at a time
          const std::size_t next = group_base(layer, kv_head, g + 1);
          const std::size_t key_bytes = head_size_ * sizeof(std::uint16_t);
          const std::size_t value_bytes = group_ * sizeof(std::uint16_t);
          detail::prefetch_bytes(key_min_.data() + next * head_size_, key_bytes);
          detail::prefetch_bytes(key_step_.data() + next * head_size_, key_bytes);
          detail::prefetch_bytes(value_min_.data() + next * group_, value_bytes);
          detail::prefetch_bytes(value_step_.data() + next * group_, value_bytes);
        }
        sink(LowBitKvBlock{key_codes_.data() + gi * code_bytes,
                           value_codes_.data() + gi * code_bytes, key_min_.data() + gi * head_size_,
                           key_step_.data() + gi * head_size_, value_min_.data() + gi * group_,
                           value_step_.data() + gi * group_, Bits,
                           rotate_ ? signs_.data() : nullptr, r0, n});
      } else {
        const std::size_t at = ring_row(layer, kv_head, r0) * head_size_;
        sink(KvBlock<T>{ring_keys_.data() + at, ring_values_.data() + at, head_size_, r0, n});
      }
    }
  }

  /// The step of key channel c of a quantized group (in rotated coordinates when rotating),
  /// for tests of the error bound.
  float key_step(std::size_t layer, std::size_t kv_head, std::size_t g, std::size_t c) const {
    return detail::f16_to_float(key_step_[group_base(layer, kv_head, g) * head_size_ + c]);
  }
  float value_step(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return detail::f16_to_float(value_step_[group_base(layer, kv_head, 0) * group_ + index]);
  }

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md). The quantized
  // groups are saved as codes and ranges and the ring's rows in full precision, all exactly as
  // stored: nothing is requantized, so a restored store reads and continues bit for bit. The
  // signs are not saved: they follow from head_size.

  /// G, R and the rotation: codes and ranges mean nothing under others.
  static constexpr std::array<std::string_view, 3> kFileOptionNames = {"group", "residual",
                                                                       "rotate"};
  std::array<std::uint64_t, 3> file_options() const {
    return {group_, residual_, rotate_ ? 1u : 0u};
  }

  /// Token ids [n], the number q of quantized groups (u64), then per (layer, kv head): key
  /// codes [q][G][head_size·Bits/8], value codes the same, key min and key step [q][head_size]
  /// f16 each, value min and value step [q·G] f16 each, ring keys and values [n − q·G]
  /// [head_size] each.
  template <class Out>
  void save_payload(Out& out) const {
    const std::size_t n = ledger_.size(), q = quantized_, p = n - quantized_ * group_;
    const std::size_t hs = head_size_, code_bytes = group_ * hs / kCodesPerByte;
    out.write(ledger_.tokens().data(), n);
    out.u64(q);
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      const std::size_t g0 = lh * n_groups_;  // group_base(l, h, 0)
      out.write(key_codes_.data() + g0 * code_bytes, q * code_bytes);
      out.write(value_codes_.data() + g0 * code_bytes, q * code_bytes);
      out.write(key_min_.data() + g0 * hs, q * hs);
      out.write(key_step_.data() + g0 * hs, q * hs);
      out.write(value_min_.data() + g0 * group_, q * group_);
      out.write(value_step_.data() + g0 * group_, q * group_);
      for (std::size_t i = 0; i < p; ++i) {
        out.write(ring_keys_.data() + ring_row_of(lh, q * group_ + i) * hs, hs);
      }
      for (std::size_t i = 0; i < p; ++i) {
        out.write(ring_values_.data() + ring_row_of(lh, q * group_ + i) * hs, hs);
      }
    }
  }

  /// A payload read by read_payload(), waiting for commit_payload(); per (layer, kv head) runs
  /// of the sizes save_payload() lists, one after another.
  struct FileState {
    std::vector<std::int32_t> tokens;                  // [n]
    std::size_t quantized = 0;                         // q
    std::vector<std::uint8_t> key_codes;               // [n_layers][n_kv_heads][q][G][hs·Bits/8]
    std::vector<std::uint8_t> value_codes;             // [n_layers][n_kv_heads][q][G][hs·Bits/8]
    std::vector<std::uint16_t> key_min, key_step;      // [n_layers][n_kv_heads][q][head_size]
    std::vector<std::uint16_t> value_min, value_step;  // [n_layers][n_kv_heads][q·G]
    std::vector<T> ring_keys, ring_values;  // [n_layers][n_kv_heads][n − q·G][head_size]
    std::span<const std::int32_t> saved_tokens() const { return tokens; }
  };

  /// Reads the payload of in.n_tokens() positions (the caller checked they fit the capacity).
  template <class In>
  FileState read_payload(In& in) const {
    const auto n = static_cast<std::size_t>(in.n_tokens());
    const std::size_t hs = head_size_, heads = n_layers_ * n_kv_heads_;
    FileState s;
    s.tokens = in.tokens(n, "token ids");
    const std::uint64_t q = in.u64("quantized group count");
    // A store reaching n positions quantizes every group R positions old, and keeps the rest
    // in its ring (fewer after a truncate); more rows than the ring holds cannot be restored.
    KVDECODE_CHECK(q <= std::min(n / group_, n_groups_) &&
                       (q == n_groups_ || n < (q + 1) * group_ + residual_),
                   in.context(), ": ", q, " quantized groups of ", group_, " for ", n,
                   " positions, expected at most ", std::min(n / group_, n_groups_),
                   " and at least as many as leave fewer than R + G = ", residual_ + group_,
                   " rows in full precision");
    s.quantized = static_cast<std::size_t>(q);
    const std::size_t p = n - s.quantized * group_;
    const std::size_t codes = s.quantized * group_ * hs / kCodesPerByte;  // per (layer, head)
    in.alloc(s.key_codes, heads * codes, "key codes");
    in.alloc(s.value_codes, s.key_codes.size(), "value codes");
    in.alloc(s.key_min, heads * s.quantized * hs, "key minima");
    in.alloc(s.key_step, s.key_min.size(), "key steps");
    in.alloc(s.value_min, heads * s.quantized * group_, "value minima");
    in.alloc(s.value_step, s.value_min.size(), "value steps");
    in.alloc(s.ring_keys, heads * p * hs, "exact keys");
    in.alloc(s.ring_values, s.ring_keys.size(), "exact values");
    const std::size_t qh = s.quantized * hs, qg = s.quantized * group_;
    for (std::size_t lh = 0; lh < heads; ++lh) {
      in.read(s.key_codes.data() + lh * codes, codes, "key codes");
      in.read(s.value_codes.data() + lh * codes, codes, "value codes");
      in.read(s.key_min.data() + lh * qh, qh, "key minima");
      in.read(s.key_step.data() + lh * qh, qh, "key steps");
      in.read(s.value_min.data() + lh * qg, qg, "value minima");
      in.read(s.value_step.data() + lh * qg, qg, "value steps");
      in.read(s.ring_keys.data() + lh * p * hs, p * hs, "exact keys");
      in.read(s.ring_values.data() + lh * p * hs, p * hs, "exact values");
    }
    return s;
  }

  /// Replaces the contents with a read payload; cannot fail (checked by read_payload).
  void commit_payload(FileState& s) noexcept {
    const std::size_t n = s.tokens.size(), q = s.quantized, p = n - q * group_, hs = head_size_;
    const std::size_t codes = q * group_ * hs / kCodesPerByte;
    const std::size_t code_bytes = group_ * hs / kCodesPerByte;
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      const std::size_t g0 = lh * n_groups_;
      std::copy_n(s.key_codes.data() + lh * codes, codes, key_codes_.data() + g0 * code_bytes);
      std::copy_n(s.value_codes.data() + lh * codes, codes, value_codes_.data() + g0 * code_bytes);
      std::copy_n(s.key_min.data() + lh * q * hs, q * hs, key_min_.data() + g0 * hs);
      std::copy_n(s.key_step.data() + lh * q * hs, q * hs, key_step_.data() + g0 * hs);
      std::copy_n(s.value_min.data() + lh * q * group_, q * group_,
                  value_min_.data() + g0 * group_);
      std::copy_n(s.value_step.data() + lh * q * group_, q * group_,
                  value_step_.data() + g0 * group_);
      for (std::size_t i = 0; i < p; ++i) {
        const std::size_t at = ring_row_of(lh, q * group_ + i) * hs;
        std::copy_n(s.ring_keys.data() + (lh * p + i) * hs, hs, ring_keys_.data() + at);
        std::copy_n(s.ring_values.data() + (lh * p + i) * hs, hs, ring_values_.data() + at);
      }
    }
    ledger_.restore(s.tokens);
    quantized_ = q;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), n);
    std::fill(quantized_layer_.begin(), quantized_layer_.end(), quantized_);
  }

 private:
  static constexpr void check_options(std::size_t group, std::size_t residual) {
    KVDECODE_CHECK(group >= 2, kTypeName, ": group size ", group, ", expected at least 2");
    KVDECODE_CHECK(residual % group == 0, kTypeName, ": residual ", residual,
                   ", expected a multiple of the group size ", group);
  }

  /// The positions quantized once `end` positions are written in one go.
  std::size_t quantized_at(std::size_t end) const {
    return end < group_ + residual_ ? 0 : std::min(n_groups_, (end - residual_) / group_);
  }
  /// (layer, kv head, group) → its index among all groups.
  std::size_t group_base(std::size_t layer, std::size_t kv_head, std::size_t g) const {
    return (layer * n_kv_heads_ + kv_head) * n_groups_ + g;
  }
  /// The ring row of position `index` of head lh = layer · n_kv_heads + kv head: group slot
  /// (index / G) mod (R/G + 1), row index mod G.
  std::size_t ring_row_of(std::size_t lh, std::size_t index) const {
    return (lh * slots_ + (index / group_) % slots_) * group_ + index % group_;
  }
  std::size_t ring_row(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return ring_row_of(layer * n_kv_heads_ + kv_head, index);
  }

  /// The f16 (min, step) covering [lo, hi] and the code of x in it (detail/f16.hpp).
  static void set_range(float lo, float hi, std::uint16_t& mn, std::uint16_t& step) {
    detail::f16_range(lo, hi, kLevels, mn, step);
  }
  static std::uint8_t code(T x, float mn, float inv) {
    return detail::range_code(static_cast<float>(x), mn, inv, kLevels);
  }

  /// The ring's rows [G][head_size] of group g of (layer, kv head) → its codes and ranges.
  void quantize_group(std::size_t layer, std::size_t kv_head, std::size_t g) {
    const std::size_t hs = head_size_, cpb = kCodesPerByte;
    const T* kx = ring_keys_.data() + ring_row(layer, kv_head, g * group_) * hs;    // [G][hs]
    const T* vx = ring_values_.data() + ring_row(layer, kv_head, g * group_) * hs;  // [G][hs]
    if (rotate_) {
      T* const rk = work_.data();                // [G][head_size]
      T* const rv = work_.data() + group_ * hs;  // [G][head_size]
      std::copy_n(kx, group_ * hs, rk);
      std::copy_n(vx, group_ * hs, rv);
      detail::rotate_rows(rk, group_, hs, signs_.data(), /*inverse=*/false);
      detail::rotate_rows(rv, group_, hs, signs_.data(), /*inverse=*/false);
      kx = rk;
      vx = rv;
    }
    const std::size_t gi = group_base(layer, kv_head, g);
    std::uint8_t* kq = key_codes_.data() + gi * group_ * hs / cpb;    // [G][hs / cpb]
    std::uint8_t* vq = value_codes_.data() + gi * group_ * hs / cpb;  // [G][hs / cpb]
    std::uint16_t* kmin = key_min_.data() + gi * hs;                  // [head_size]
    std::uint16_t* kstep = key_step_.data() + gi * hs;                // [head_size]
    std::fill_n(kq, group_ * hs / cpb, std::uint8_t{0});
    std::fill_n(vq, group_ * hs / cpb, std::uint8_t{0});
    for (std::size_t c = 0; c < hs; ++c) {
      float lo = 0.0f, hi = 0.0f;
      detail::value_range(kx + c, group_, hs, lo, hi);
      set_range(lo, hi, kmin[c], kstep[c]);
      const float mn = detail::f16_to_float(kmin[c]), st = detail::f16_to_float(kstep[c]);
      const float inv = st > 0 ? 1.0f / st : 0.0f;
      const unsigned shift = Bits * static_cast<unsigned>(c % cpb);
      for (std::size_t r = 0; r < group_; ++r)
        kq[r * hs / cpb + c / cpb] |=
            static_cast<std::uint8_t>(code(kx[r * hs + c], mn, inv) << shift);
    }
    for (std::size_t r = 0; r < group_; ++r) {
      const T* x = vx + r * hs;
      float lo = 0.0f, hi = 0.0f;
      detail::value_range(x, hs, 1, lo, hi);
      std::uint16_t& vmin = value_min_[gi * group_ + r];
      std::uint16_t& vstep = value_step_[gi * group_ + r];
      set_range(lo, hi, vmin, vstep);
      const float mn = detail::f16_to_float(vmin), st = detail::f16_to_float(vstep);
      const float inv = st > 0 ? 1.0f / st : 0.0f;
      for (std::size_t c = 0; c < hs; ++c)
        vq[r * hs / cpb + c / cpb] |= static_cast<std::uint8_t>(
            code(x[c], mn, inv) << (Bits * static_cast<unsigned>(c % cpb)));
    }
  }

  /// Rows [0, n) of quantized group g → keys, values [n][head_size], rotated back;
  /// ranges [2 × head_size + 2 × G] is room for the group's ranges decoded to T.
  void decode_group(std::size_t layer, std::size_t kv_head, std::size_t g, std::size_t n, T* keys,
                    T* values, T* ranges) const {
    const std::size_t hs = head_size_;
    const std::size_t gi = group_base(layer, kv_head, g);
    T* const kmin = ranges;                // [head_size]
    T* const kstep = ranges + hs;          // [head_size]
    T* const vmin = ranges + 2 * hs;       // [n]
    T* const vstep = ranges + 2 * hs + n;  // [n]
    for (std::size_t c = 0; c < hs; ++c) {
      kmin[c] = static_cast<T>(detail::f16_to_float(key_min_[gi * hs + c]));
      kstep[c] = static_cast<T>(detail::f16_to_float(key_step_[gi * hs + c]));
    }
    for (std::size_t r = 0; r < n; ++r) {
      vmin[r] = static_cast<T>(detail::f16_to_float(value_min_[gi * group_ + r]));
      vstep[r] = static_cast<T>(detail::f16_to_float(value_step_[gi * group_ + r]));
    }
    const std::uint8_t* kq = key_codes_.data() + gi * group_ * hs / kCodesPerByte;
    const std::uint8_t* vq = value_codes_.data() + gi * group_ * hs / kCodesPerByte;
    if constexpr (Bits == 4) {
      detail::dequantize_q4(active_kernel_set(), kq, kmin, kstep, vq, vmin, vstep, n, hs, keys,
                            values);
    } else {
      detail::dequantize_q2_portable(kq, kmin, kstep, vq, vmin, vstep, n, hs, keys, values);
    }
    if (rotate_) {
      detail::rotate_rows(keys, n, hs, signs_.data(), /*inverse=*/true);
      detail::rotate_rows(values, n, hs, signs_.data(), /*inverse=*/true);
    }
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t capacity_ = 0;
  std::size_t group_ = kDefaultGroup;
  std::size_t residual_ = kDefaultResidual;
  bool rotate_ = false;
  std::size_t slots_ = 1;      // R / G + 1 group slots in the ring
  std::size_t n_groups_ = 0;   // capacity / G groups can be quantized
  SequenceLedger ledger_;      // size, pending append, token ids [capacity reserved]
  std::size_t quantized_ = 0;  // committed groups quantized: positions [0, quantized_ · G)
  bool saved_ = false;         // saved_* hold the ring an open append may overwrite
  AlignedBuffer<std::uint8_t> key_codes_;    // [n_layers][n_kv_heads][n_groups][G][hs·Bits/8]
  AlignedBuffer<std::uint8_t> value_codes_;  // [n_layers][n_kv_heads][n_groups][G][hs·Bits/8]
  AlignedBuffer<std::uint16_t> key_min_;     // [n_layers][n_kv_heads][n_groups][head_size] f16
  AlignedBuffer<std::uint16_t> key_step_;    // [n_layers][n_kv_heads][n_groups][head_size] f16
  AlignedBuffer<std::uint16_t> value_min_;   // [n_layers][n_kv_heads][n_groups × G] f16
  AlignedBuffer<std::uint16_t> value_step_;  // [n_layers][n_kv_heads][n_groups × G] f16
  AlignedBuffer<T> ring_keys_;        // [n_layers][n_kv_heads][R/G + 1][G][head_size] exact rows
  AlignedBuffer<T> ring_values_;      // [n_layers][n_kv_heads][R/G + 1][G][head_size]
  AlignedBuffer<T> saved_keys_;       // [n_layers][n_kv_heads][R/G + 1][G][head_size] cancel copy
  AlignedBuffer<T> saved_values_;     // [n_layers][n_kv_heads][R/G + 1][G][head_size]
  AlignedBuffer<T> work_;             // [block_scratch_size()] rotated rows; truncate's ranges
  AlignedBuffer<float> signs_;        // [head_size] D of the rotation (empty without it)
  std::vector<std::size_t> written_;  // [n_layers] rows written (committed + pending)
  std::vector<std::size_t> quantized_layer_;  // [n_layers] groups quantized (incl. pending)
};

/// The 4-bit store (codes two a byte) and the 2-bit one (four a byte).
template <class T>
using Q4Store = LowBitStore<T, 4>;
template <class T>
using Q2Store = LowBitStore<T, 2>;

static_assert(KvStore<Q4Store<float>>);
static_assert(KvStore<Q4Store<double>>);
static_assert(KvStore<Q2Store<float>>);

}  // namespace kvdecode
