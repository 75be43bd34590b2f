// Q4Store<T>: a 4-bit KV cache in the KIVI style (Liu et al. 2024): keys quantized per channel
// over a group of G positions, values per token, and the newest, not yet full group kept in full
// precision. Attention reads it one group at a time, dequantized into caller scratch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model_config.hpp"

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
  static constexpr std::size_t kDefaultGroup = 64;
  static constexpr float kLevels = 15.0f;

  /// Bytes per position in every layer and kv head, metadata amortised over a key group:
  /// 2 × n_layers × n_kv_heads × (head_size / 2 + 8 · head_size / G + 8): 4-bit codes of K and
  /// V, an f32 (min, step) pair per key channel per G positions, one per value row. Excludes the
  /// fixed staging area (residual_bytes()).
  static double bytes_per_token(const ModelConfig& cfg, std::size_t group = kDefaultGroup) {
    const auto hs = static_cast<double>(cfg.head_size());
    const double per_head = hs / 2 + 8.0 * hs / static_cast<double>(group) + hs / 2 + 8.0;
    return static_cast<double>(cfg.n_layers) * static_cast<double>(cfg.n_kv_heads) * per_head;
  }

  Q4Store() = default;
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

  /// The (min, step) of key channel c of a quantized group, for tests of the error bound.
  float key_step(std::size_t layer, std::size_t kv_head, std::size_t g, std::size_t c) const {
    return key_step_[group_base(layer, kv_head, g) * head_size_ + c];
  }
  float value_step(std::size_t layer, std::size_t kv_head, std::size_t index) const {
    return value_step_[group_base(layer, kv_head, 0) * group_ + index];
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
  static std::uint8_t code(T x, float mn, float inv) {
    const float r = std::nearbyint((static_cast<float>(x) - mn) * inv);
    return static_cast<std::uint8_t>(std::clamp(r, 0.0f, kLevels));
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
    for (std::size_t r = 0; r < n; ++r) {
      const std::uint8_t* kr = kq + r * hs / 2;
      T* ko = keys + r * hs;
      const float vmin = value_min_[gi * group_ + r];
      const float vstep = value_step_[gi * group_ + r];
      const std::uint8_t* vr = vq + r * hs / 2;
      T* vo = values + r * hs;
      std::size_t c = 0;
#if defined(__AVX512F__)
      // Attention dequantizes the whole cache every step; the plain loop below stays scalar
      // (nibble pairs defeat GCC 12's vectorizer) and made the 4-bit store slower than the f32
      // one. 16 channels at a time: 8 bytes widened to 16-bit lanes b, each made the byte pair
      // (b & 15, b >> 4), which is the channels' order, then widened to 16 floats.
      if constexpr (std::is_same_v<T, float>) {
        const __m128i low = _mm_set1_epi16(0x0F);
        const auto unpack = [&](const std::uint8_t* codes) {
          const __m128i b =
              _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
          const __m128i pairs =
              _mm_or_si128(_mm_and_si128(b, low), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
          return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pairs));
        };
        const __m512 vmin16 = _mm512_set1_ps(vmin);
        const __m512 vstep16 = _mm512_set1_ps(vstep);
        for (; c + 16 <= hs; c += 16) {
          _mm512_storeu_ps(
              ko + c, _mm512_add_ps(_mm512_loadu_ps(kmin + c),
                                    _mm512_mul_ps(unpack(kr + c / 2), _mm512_loadu_ps(kstep + c))));
          _mm512_storeu_ps(vo + c,
                           _mm512_add_ps(vmin16, _mm512_mul_ps(unpack(vr + c / 2), vstep16)));
        }
      }
#endif
      for (; c < hs; c += 2) {
        ko[c] = static_cast<T>(kmin[c] + static_cast<float>(kr[c / 2] & 0xF) * kstep[c]);
        ko[c + 1] = static_cast<T>(kmin[c + 1] + static_cast<float>(kr[c / 2] >> 4) * kstep[c + 1]);
        vo[c] = static_cast<T>(vmin + static_cast<float>(vr[c / 2] & 0xF) * vstep);
        vo[c + 1] = static_cast<T>(vmin + static_cast<float>(vr[c / 2] >> 4) * vstep);
      }
    }
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
