// Q4Store<T>: a 4-bit KV cache in the KIVI style (Liu et al. 2024): keys quantized per channel
// over a group of G positions, values per token, and the newest, not yet full group kept in full
// precision. Attention reads it one group at a time, dequantized into caller scratch.
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
#include "kvdecode/detail/quantize.hpp"
#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/store/kv_store.hpp"

namespace kvdecode {

/// Asymmetric 4-bit codes: x̂ = min + q·s with s = (max - min) / 15, q = round((x - min) / s) in
/// [0, 15], so |x̂ - x| ≤ s / 2. Two codes per byte, the even channel in the low nibble.
///
/// - Keys: (min, s) per (layer, kv head, group of G positions, channel). Keys have a few
///   channels of large magnitude (KIVI §3); a per-channel range keeps them from widening the
///   step of every other channel, which a per-token range would.
/// - Values: (min, s) per (layer, kv head, position), over its head_size channels. Attention
///   mixes value rows with weights summing to 1, so a per-token error stays per-token.
/// - The residual: positions of the group being filled (at most G - 1 once committed) live in
///   an f32 staging area; when the write of a group's last row arrives the group is quantized
///   (so pending rows of a long prefill are quantized group by group, and a chunk that completes
///   a group reads it quantized, as every later step will). A group is never requantized
///   except after truncate() into it (see there).
///
/// Transactions: the only committed data a pending append can overwrite are the staging rows of
/// the partial group, once the append completes that group and starts the next; begin_append
/// copies those few rows aside (at most G - 1 rows × 2 × n_layers × kv_dim) and cancel_append()
/// copies them back, so a cancel restores the store exactly. Rows must be written in order
/// within each layer (as Model does), because a group is quantized when its last row arrives.
template <class T>
class Q4Store {
 public:
  using Scalar = T;
  // Its name in messages and its tag in cache files (tags are fixed forever: docs/FORMATS.md).
  static constexpr std::string_view kName = "q4";
  static constexpr std::uint32_t kFileTag = 5;
  static constexpr std::size_t kDefaultGroup = 64;
  static constexpr float kLevels = 15.0f;

  struct Options {
    std::size_t capacity = 0;           ///< positions it holds; 0 means cfg.seq_len
    std::size_t group = kDefaultGroup;  ///< G: positions per key group, the residual length
  };

  /// Every byte a store of these options reserves: per (layer, kv head) and full group, the
  /// 4-bit codes of K and V (G × head_size bytes), an f32 (min, step) pair per key channel and
  /// one per value row; plus the fixed full-precision staging of one group and its cancel copy,
  /// 4 × n_layers × n_kv_heads × G × head_size × sizeof(T). capacity / G groups can be
  /// quantized; the rest of a capacity that is not a multiple of G stays in staging.
  static constexpr std::uint64_t memory_bytes_for(const ModelConfig& cfg, const Options& o) {
    KVDECODE_CHECK(o.group >= 2, "Q4Store: group size ", o.group, ", expected at least 2");
    const detail::KvDims d = detail::KvDims::of(cfg);
    const std::uint64_t g = o.group;
    const std::uint64_t groups = detail::capacity_or_seq_len(o.capacity, cfg) / g;
    const std::uint64_t group_bytes = detail::sat_add(
        {detail::sat_mul({g, d.head_size}), detail::sat_mul({2 * sizeof(float), d.head_size}),
         detail::sat_mul({2 * sizeof(float), g})});
    return detail::sat_add({detail::sat_mul({d.heads(), groups, group_bytes}),
                            detail::sat_mul({4, d.heads(), g, d.head_size, sizeof(T)})});
  }

  Q4Store() = default;
  Q4Store(const ModelConfig& cfg, const Options& options)
      : Q4Store(cfg, options.capacity, options.group) {}
  /// A cache for `capacity` positions (0 means cfg.seq_len) with key groups of `group`
  /// positions (the residual length); group must be ≥ 2 and head_size even.
  explicit Q4Store(const ModelConfig& cfg, std::size_t capacity = 0,
                   std::size_t group = kDefaultGroup)
      : n_layers_(static_cast<std::size_t>(cfg.n_layers)),
        n_kv_heads_(static_cast<std::size_t>(cfg.n_kv_heads)),
        head_size_(static_cast<std::size_t>(cfg.head_size())),
        capacity_(capacity == 0 ? static_cast<std::size_t>(cfg.seq_len) : capacity),
        group_(group) {
    cfg.validate();
    KVDECODE_CHECK(group_ >= 2, "Q4Store: group size ", group_, ", expected at least 2");
    // The staging buffers hold a group per (layer, kv head): its bytes must fit size_t too.
    KVDECODE_CHECK(group_ <= std::numeric_limits<std::size_t>::max() / 4 / sizeof(T) /
                                 (n_layers_ * n_kv_heads_ * head_size_),
                   "Q4Store: group size ", group_, " overflows the store's size");
    KVDECODE_CHECK(capacity_ <= std::numeric_limits<std::size_t>::max() / 4 / sizeof(float) /
                                    (n_layers_ * n_kv_heads_ * (head_size_ + group_)),
                   "Q4Store: capacity ", capacity_, " positions overflow the store's size");
    n_groups_ = capacity_ / group_;  // a trailing partial group never fills: it stays in staging
    const std::size_t heads = n_layers_ * n_kv_heads_;
    key_codes_ = AlignedBuffer<std::uint8_t>(heads * n_groups_ * group_ * head_size_ / 2);
    value_codes_ = AlignedBuffer<std::uint8_t>(key_codes_.size());
    key_min_ = AlignedBuffer<float>(heads * n_groups_ * head_size_);
    key_step_ = AlignedBuffer<float>(key_min_.size());
    value_min_ = AlignedBuffer<float>(heads * n_groups_ * group_);
    value_step_ = AlignedBuffer<float>(value_min_.size());
    stage_keys_ = AlignedBuffer<T>(heads * group_ * head_size_);
    stage_values_ = AlignedBuffer<T>(stage_keys_.size());
    saved_keys_ = AlignedBuffer<T>(stage_keys_.size());
    saved_values_ = AlignedBuffer<T>(stage_keys_.size());
    written_.assign(n_layers_, 0);
    tokens_ = AlignedBuffer<std::int32_t>(capacity_);
  }

  std::size_t size() const { return size_; }
  std::size_t pending() const { return pending_; }
  std::size_t capacity() const { return capacity_; }
  std::size_t n_layers() const { return n_layers_; }
  std::size_t n_kv_heads() const { return n_kv_heads_; }
  std::size_t head_size() const { return head_size_; }
  std::size_t group_size() const { return group_; }
  /// The fixed full-precision part: staging plus its cancel copy,
  /// 4 × n_layers × n_kv_heads × G × head_size × sizeof(T).
  std::size_t residual_bytes() const {
    return stage_keys_.bytes() + stage_values_.bytes() + saved_keys_.bytes() +
           saved_values_.bytes();
  }
  /// Every byte reserved: codes, (min, step) pairs and the residual.
  std::size_t memory_bytes() const {
    return key_codes_.bytes() + value_codes_.bytes() + key_min_.bytes() + key_step_.bytes() +
           value_min_.bytes() + value_step_.bytes() + residual_bytes();
  }
  Options options() const { return {capacity_, group_}; }
  std::size_t max_append() const { return capacity_ - size_; }
  /// The quantized groups of [0, end) as codes and (min, step) pairs, the rest of it from the
  /// staging rows in full precision (a chunk's rows are written, and full groups quantized,
  /// before attention reads them).
  std::uint64_t read_bytes(std::size_t end) const {
    const std::size_t heads = n_layers_ * n_kv_heads_;
    const std::size_t quantized = std::min(end / group_, n_groups_);
    const std::size_t group_bytes =
        group_ * head_size_ + 2 * sizeof(float) * head_size_ + 2 * sizeof(float) * group_;
    const std::size_t staged = end - quantized * group_;
    return heads * (quantized * group_bytes + 2 * staged * head_size_ * sizeof(T));
  }
  /// Rows still in staging leave no trace when dropped; truncating into a quantized group
  /// re-quantizes its kept rows later (see truncate()), which is not exact.
  std::size_t max_exact_rollback() const { return size_ % group_; }
  /// The most positions the next append may bring so that no group completes after its first
  /// row: every row then reads what a one-at-a-time decode reads (a chunk that completes a
  /// group reads it quantized), and max_exact_rollback() afterwards covers all rows but the
  /// first. What speculative verification appends at most.
  std::size_t max_exact_append() const {
    const std::size_t r = size_ % group_;
    return std::min(capacity_ - size_, r + 1 == group_ ? group_ : group_ - 1 - r);
  }
  std::size_t rope_position(std::size_t index) const { return index; }
  /// One group of keys and values: [2][G][head_size].
  std::size_t block_scratch_size() const { return 2 * group_ * head_size_; }

  void begin_append(std::span<const std::int32_t> tokens) {
    const std::size_t n = tokens.size();
    KVDECODE_CHECK(pending_ == 0, "Q4Store::begin_append: ", pending_,
                   " positions are already pending");
    KVDECODE_CHECK(n <= capacity_ - size_, "Q4Store: appending ", n, " positions to ", size_,
                   " would exceed the capacity of ", capacity_);
    const std::size_t partial = size_ % group_;  // committed rows in staging
    saved_ = partial > 0 && n > group_ - partial;
    if (saved_) {
      // Rows [0, partial) of each head's staging are overwritten once the next group starts.
      for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
        const std::size_t at = lh * group_ * head_size_;
        std::copy_n(stage_keys_.data() + at, partial * head_size_, saved_keys_.data() + at);
        std::copy_n(stage_values_.data() + at, partial * head_size_, saved_values_.data() + at);
      }
    }
    std::copy(tokens.begin(), tokens.end(), tokens_.data() + size_);
    pending_ = n;
  }

  std::span<const std::int32_t> tokens() const { return {tokens_.data(), size_}; }

  /// Stores pending position i of a layer (k, v [kv_dim]); rows arrive in order per layer. The
  /// last row of a group quantizes the group.
  void write(std::size_t layer, std::size_t i, const T* k, const T* v) {
    const std::size_t index = size_ + i;
    KVDECODE_CHECK(i < pending_ && index == written_[layer], "Q4Store::write: layer ", layer,
                   " expects pending row ", written_[layer] - size_, " of ", pending_, ", got ", i,
                   " (rows are written in order)");
    const std::size_t r = index % group_;
    for (std::size_t h = 0; h < n_kv_heads_; ++h) {
      const std::size_t at = ((layer * n_kv_heads_ + h) * group_ + r) * head_size_;
      std::copy_n(k + h * head_size_, head_size_, stage_keys_.data() + at);
      std::copy_n(v + h * head_size_, head_size_, stage_values_.data() + at);
    }
    written_[layer] = index + 1;
    if (r + 1 == group_) {
      for (std::size_t h = 0; h < n_kv_heads_; ++h) quantize_group(layer, h, index / group_);
    }
  }

  void commit_append() {
    size_ += pending_;
    pending_ = 0;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), size_);
  }

  /// Restores the committed staging rows if the append had started a new group; pending
  /// quantized groups lie past size() and are simply forgotten.
  void cancel_append() noexcept {
    if (saved_) {
      const std::size_t partial = size_ % group_;
      for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
        const std::size_t at = lh * group_ * head_size_;
        std::copy_n(saved_keys_.data() + at, partial * head_size_, stage_keys_.data() + at);
        std::copy_n(saved_values_.data() + at, partial * head_size_, stage_values_.data() + at);
      }
    }
    pending_ = 0;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), size_);
  }

  /// Rollback to the first n positions. When n falls inside a group already quantized, the
  /// kept rows of that group return to staging as their dequantized values, and the group is
  /// quantized again when it refills: those rows then carry two quantization errors, at most
  /// s₁/2 + s₂/2 (docs/QUANTIZATION.md).
  void truncate(std::size_t n) {
    KVDECODE_CHECK(pending_ == 0, "Q4Store::truncate during an append");
    KVDECODE_CHECK(n <= size_, "Q4Store::truncate(", n, ") beyond size ", size_);
    const std::size_t g = n / group_;
    if (n % group_ != 0 && g < size_ / group_) {
      for (std::size_t l = 0; l < n_layers_; ++l)
        for (std::size_t h = 0; h < n_kv_heads_; ++h) {
          const std::size_t at = (l * n_kv_heads_ + h) * group_ * head_size_;
          dequantize_group(l, h, g, n % group_, stage_keys_.data() + at, stage_values_.data() + at);
        }
    }
    size_ = n;
    std::fill(written_.begin(), written_.end(), size_);
  }
  void reset() {
    size_ = 0;
    pending_ = 0;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), 0);
  }

  /// Cache indices [0, end) of one (layer, kv head): each quantized group dequantized into
  /// scratch [2][G][head_size], then the partial group's staging rows in place.
  template <class Sink>
  void for_each_block(std::size_t layer, std::size_t kv_head, std::size_t end, std::span<T> scratch,
                      Sink&& sink) const {
    if (end == 0) return;
    KVDECODE_CHECK(scratch.size() >= block_scratch_size(), "Q4Store::for_each_block: scratch of ",
                   scratch.size(), " elements, expected at least ", block_scratch_size());
    T* const ks = scratch.data();                        // [G][head_size]
    T* const vs = scratch.data() + group_ * head_size_;  // [G][head_size]
    const std::size_t quantized = std::min(written_[layer] / group_, n_groups_);
    for (std::size_t g = 0; g * group_ < end; ++g) {
      const std::size_t r0 = g * group_;
      const std::size_t n = std::min(group_, end - r0);
      if (g < quantized) {
        dequantize_group(layer, kv_head, g, n, ks, vs);
        sink(KvBlock<T>{ks, vs, head_size_, r0, n});
      } else {
        const std::size_t at = (layer * n_kv_heads_ + kv_head) * group_ * head_size_;
        sink(KvBlock<T>{stage_keys_.data() + at, stage_values_.data() + at, head_size_, r0, n});
      }
    }
  }

  /// Cache indices [0, end) of one (layer, kv head) as stored: each quantized group as codes
  /// with its (min, step) pairs, then the open group's staging rows in full precision
  /// (CodedKvStore).
  template <class Sink>
  void for_each_coded_block(std::size_t layer, std::size_t kv_head, std::size_t end,
                            Sink&& sink) const {
    const std::size_t quantized = std::min(written_[layer] / group_, n_groups_);
    for (std::size_t g = 0; g * group_ < end; ++g) {
      const std::size_t r0 = g * group_;
      const std::size_t n = std::min(group_, end - r0);
      if (g < quantized) {
        const std::size_t gi = group_base(layer, kv_head, g);
        sink(Q4KvBlock{key_codes_.data() + gi * group_ * head_size_ / 2,
                       value_codes_.data() + gi * group_ * head_size_ / 2,
                       key_min_.data() + gi * head_size_, key_step_.data() + gi * head_size_,
                       value_min_.data() + gi * group_, value_step_.data() + gi * group_, r0, n});
      } else {
        const std::size_t at = (layer * n_kv_heads_ + kv_head) * group_ * head_size_;
        sink(KvBlock<T>{stage_keys_.data() + at, stage_values_.data() + at, head_size_, r0, n});
      }
    }
  }

  /// The (min, step) of key channel c of a quantized group, for tests of the error bound.
  float key_step(std::size_t layer, std::size_t kv_head, std::size_t g, std::size_t c) const {
    return key_step_[group_base(layer, kv_head, g) * head_size_ + c];
  }
  float value_step(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return value_step_[group_base(layer, kv_head, 0) * group_ + index];
  }

  // ---------------------------------------------------------------------------------------------
  // Cache file (io/cache_file.hpp; the payload layout is in docs/FORMATS.md). The quantized
  // groups are saved as codes and ranges and the partial group as its full-precision staging
  // rows, all exactly as stored: nothing is requantized, so a restored store reads and continues
  // bit for bit.

  /// The group size G: codes and ranges mean nothing under another G.
  static constexpr std::array<std::string_view, 1> kFileOptionNames = {"group"};
  std::array<std::uint64_t, 1> file_options() const { return {group_}; }

  /// Token ids [n], then per (layer, kv head), with q = n / G full groups and p = n mod G
  /// staged rows: key codes [q][G][head_size/2], value codes [q][G][head_size/2], key min and
  /// key step [q][head_size] each, value min and value step [q·G] each, staged keys and values
  /// [p][head_size] each.
  template <class Out>
  void save_payload(Out& out) const {
    const std::size_t q = size_ / group_, p = size_ % group_, hs = head_size_;
    out.write(tokens_.data(), size_);
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      const std::size_t g0 = lh * n_groups_;  // group_base(l, h, 0)
      out.write(key_codes_.data() + g0 * group_ * hs / 2, q * group_ * hs / 2);
      out.write(value_codes_.data() + g0 * group_ * hs / 2, q * group_ * hs / 2);
      out.write(key_min_.data() + g0 * hs, q * hs);
      out.write(key_step_.data() + g0 * hs, q * hs);
      out.write(value_min_.data() + g0 * group_, q * group_);
      out.write(value_step_.data() + g0 * group_, q * group_);
      out.write(stage_keys_.data() + lh * group_ * hs, p * hs);
      out.write(stage_values_.data() + lh * group_ * hs, p * hs);
    }
  }

  /// A payload read by read_payload(), waiting for commit_payload(); per (layer, kv head) runs
  /// of the sizes save_payload() lists, one after another.
  struct FileState {
    std::vector<std::int32_t> tokens;          // [n]
    std::vector<std::uint8_t> key_codes;       // [n_layers][n_kv_heads][q][G][head_size/2]
    std::vector<std::uint8_t> value_codes;     // [n_layers][n_kv_heads][q][G][head_size/2]
    std::vector<float> key_min, key_step;      // [n_layers][n_kv_heads][q][head_size] each
    std::vector<float> value_min, value_step;  // [n_layers][n_kv_heads][q·G] each
    std::vector<T> stage_keys, stage_values;   // [n_layers][n_kv_heads][p][head_size] each
    std::span<const std::int32_t> saved_tokens() const { return tokens; }
  };

  /// Reads the payload of in.n_tokens() positions (the caller checked they fit the capacity).
  template <class In>
  FileState read_payload(In& in) const {
    const auto n = static_cast<std::size_t>(in.n_tokens());
    const std::size_t q = n / group_, p = n % group_, hs = head_size_;
    const std::size_t heads = n_layers_ * n_kv_heads_;
    FileState s;
    s.tokens = in.tokens(n, "token ids");
    in.alloc(s.key_codes, heads * q * group_ * hs / 2, "key codes");
    in.alloc(s.value_codes, s.key_codes.size(), "value codes");
    in.alloc(s.key_min, heads * q * hs, "key minima");
    in.alloc(s.key_step, s.key_min.size(), "key steps");
    in.alloc(s.value_min, heads * q * group_, "value minima");
    in.alloc(s.value_step, s.value_min.size(), "value steps");
    in.alloc(s.stage_keys, heads * p * hs, "staged keys");
    in.alloc(s.stage_values, s.stage_keys.size(), "staged values");
    for (std::size_t lh = 0; lh < heads; ++lh) {
      in.read(s.key_codes.data() + lh * q * group_ * hs / 2, q * group_ * hs / 2, "key codes");
      in.read(s.value_codes.data() + lh * q * group_ * hs / 2, q * group_ * hs / 2, "value codes");
      in.read(s.key_min.data() + lh * q * hs, q * hs, "key minima");
      in.read(s.key_step.data() + lh * q * hs, q * hs, "key steps");
      in.read(s.value_min.data() + lh * q * group_, q * group_, "value minima");
      in.read(s.value_step.data() + lh * q * group_, q * group_, "value steps");
      in.read(s.stage_keys.data() + lh * p * hs, p * hs, "staged keys");
      in.read(s.stage_values.data() + lh * p * hs, p * hs, "staged values");
    }
    return s;
  }

  /// Replaces the contents with a read payload; cannot fail (n ≤ capacity, so q ≤ n_groups).
  void commit_payload(FileState& s) noexcept {
    const std::size_t n = s.tokens.size();
    const std::size_t q = n / group_, p = n % group_, hs = head_size_;
    std::copy_n(s.tokens.data(), n, tokens_.data());
    for (std::size_t lh = 0; lh < n_layers_ * n_kv_heads_; ++lh) {
      const std::size_t g0 = lh * n_groups_;
      const std::size_t codes = q * group_ * hs / 2;
      std::copy_n(s.key_codes.data() + lh * codes, codes, key_codes_.data() + g0 * group_ * hs / 2);
      std::copy_n(s.value_codes.data() + lh * codes, codes,
                  value_codes_.data() + g0 * group_ * hs / 2);
      std::copy_n(s.key_min.data() + lh * q * hs, q * hs, key_min_.data() + g0 * hs);
      std::copy_n(s.key_step.data() + lh * q * hs, q * hs, key_step_.data() + g0 * hs);
      std::copy_n(s.value_min.data() + lh * q * group_, q * group_,
                  value_min_.data() + g0 * group_);
      std::copy_n(s.value_step.data() + lh * q * group_, q * group_,
                  value_step_.data() + g0 * group_);
      std::copy_n(s.stage_keys.data() + lh * p * hs, p * hs, stage_keys_.data() + lh * group_ * hs);
      std::copy_n(s.stage_values.data() + lh * p * hs, p * hs,
                  stage_values_.data() + lh * group_ * hs);
    }
    size_ = n;
    pending_ = 0;
    saved_ = false;
    std::fill(written_.begin(), written_.end(), size_);
  }

 private:
  /// (layer, kv head, group) → its index among all groups.
  std::size_t group_base(std::size_t layer, std::size_t kv_head, std::size_t g) const {
    return (layer * n_kv_heads_ + kv_head) * n_groups_ + g;
  }

  /// The shared (min, step) of x [n] (elements `stride` apart) for 16 levels.
  static void range(const T* x, std::size_t n, std::size_t stride, float& mn, float& step) {
    float lo = static_cast<float>(x[0]);
    float hi = lo;
    for (std::size_t i = 1; i < n; ++i) {
      const auto xi = static_cast<float>(x[i * stride]);
      lo = std::min(lo, xi);
      hi = std::max(hi, xi);
    }
    mn = lo;
    step = (hi - lo) / kLevels;
  }
  /// A non-finite row (a NaN or an infinity in the K/V) gives code 0 instead of an undefined
  /// conversion; its (min, step) carry the NaN on to attention.
  static std::uint8_t code(T x, float mn, float inv) {
    const float r = std::nearbyint((static_cast<float>(x) - mn) * inv);
    return static_cast<std::uint8_t>(r >= 0.0f ? std::min(r, kLevels) : 0.0f);
  }

  /// Staging rows [G][head_size] of (layer, kv head) → codes and (min, step) of group g.
  void quantize_group(std::size_t layer, std::size_t kv_head, std::size_t g) {
    const std::size_t hs = head_size_;
    const T* kx = stage_keys_.data() + (layer * n_kv_heads_ + kv_head) * group_ * hs;
    const T* vx = stage_values_.data() + (layer * n_kv_heads_ + kv_head) * group_ * hs;
    const std::size_t gi = group_base(layer, kv_head, g);
    std::uint8_t* kq = key_codes_.data() + gi * group_ * hs / 2;    // [G][head_size / 2]
    std::uint8_t* vq = value_codes_.data() + gi * group_ * hs / 2;  // [G][head_size / 2]
    float* kmin = key_min_.data() + gi * hs;                        // [head_size]
    float* kstep = key_step_.data() + gi * hs;                      // [head_size]
    for (std::size_t c = 0; c < hs; ++c) range(kx + c, group_, hs, kmin[c], kstep[c]);
    for (std::size_t r = 0; r < group_; ++r) {
      for (std::size_t c = 0; c < hs; c += 2) {
        const float inv0 = kstep[c] > 0 ? 1.0f / kstep[c] : 0.0f;
        const float inv1 = kstep[c + 1] > 0 ? 1.0f / kstep[c + 1] : 0.0f;
        kq[r * hs / 2 + c / 2] =
            static_cast<std::uint8_t>(code(kx[r * hs + c], kmin[c], inv0) |
                                      (code(kx[r * hs + c + 1], kmin[c + 1], inv1) << 4));
      }
      float& vmin = value_min_[gi * group_ + r];
      float& vstep = value_step_[gi * group_ + r];
      range(vx + r * hs, hs, 1, vmin, vstep);
      const float inv = vstep > 0 ? 1.0f / vstep : 0.0f;
      for (std::size_t c = 0; c < hs; c += 2) {
        vq[r * hs / 2 + c / 2] = static_cast<std::uint8_t>(
            code(vx[r * hs + c], vmin, inv) | (code(vx[r * hs + c + 1], vmin, inv) << 4));
      }
    }
  }

  /// Rows [0, n) of quantized group g → keys, values [n][head_size].
  void dequantize_group(std::size_t layer, std::size_t kv_head, std::size_t g, std::size_t n,
                        T* keys, T* values) const {
    const std::size_t hs = head_size_;
    const std::size_t gi = group_base(layer, kv_head, g);
    const std::uint8_t* kq = key_codes_.data() + gi * group_ * hs / 2;
    const std::uint8_t* vq = value_codes_.data() + gi * group_ * hs / 2;
    const float* kmin = key_min_.data() + gi * hs;
    const float* kstep = key_step_.data() + gi * hs;
    detail::dequantize_q4(active_kernel_set(), kq, kmin, kstep, vq, value_min_.data() + gi * group_,
                          value_step_.data() + gi * group_, n, hs, keys, values);
  }

  std::size_t n_layers_ = 0;
  std::size_t n_kv_heads_ = 0;
  std::size_t head_size_ = 0;
  std::size_t capacity_ = 0;
  std::size_t group_ = kDefaultGroup;
  std::size_t n_groups_ = 0;  // capacity / G groups can be quantized
  std::size_t size_ = 0;
  std::size_t pending_ = 0;
  bool saved_ = false;  // saved_* hold the committed staging rows an open append overwrites
  AlignedBuffer<std::uint8_t> key_codes_;    // [n_layers][n_kv_heads][n_groups][G][head_size/2]
  AlignedBuffer<std::uint8_t> value_codes_;  // [n_layers][n_kv_heads][n_groups][G][head_size/2]
  AlignedBuffer<float> key_min_;      // [n_layers][n_kv_heads][n_groups][head_size] per channel
  AlignedBuffer<float> key_step_;     // [n_layers][n_kv_heads][n_groups][head_size] per channel
  AlignedBuffer<float> value_min_;    // [n_layers][n_kv_heads][n_groups × G] per position
  AlignedBuffer<float> value_step_;   // [n_layers][n_kv_heads][n_groups × G] per position
  AlignedBuffer<T> stage_keys_;       // [n_layers][n_kv_heads][G][head_size] rows of the open group
  AlignedBuffer<T> stage_values_;     // [n_layers][n_kv_heads][G][head_size]
  AlignedBuffer<T> saved_keys_;       // [n_layers][n_kv_heads][G][head_size] cancel copy
  AlignedBuffer<T> saved_values_;     // [n_layers][n_kv_heads][G][head_size]
  std::vector<std::size_t> written_;  // [n_layers] rows written per layer (committed + pending)
  AlignedBuffer<std::int32_t> tokens_;  // [capacity] token id of each position
};

static_assert(KvStore<Q4Store<float>>);
static_assert(KvStore<Q4Store<double>>);

}  // namespace kvdecode
