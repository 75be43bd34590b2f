// The KvStore concept: everything attention needs from a key/value cache, so the contiguous,
// paged, quantized and windowed stores all plug into the same attention with no virtual calls.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvdecode/model/model_config.hpp"

namespace kvdecode {

/// A run of cached keys and values of one (layer, kv head), as attention reads them. Rows are
/// consecutive cache indices first, first+1, ..., first+n-1; a row holds head_size elements
/// and rows are `stride` elements apart. Keys have RoPE applied already.
template <class T>
struct KvBlock {
  const T* keys = nullptr;    // [n][stride], first head_size of each row used
  const T* values = nullptr;  // [n][stride]
  std::size_t stride = 0;
  std::size_t first = 0;
  std::size_t n = 0;
};

namespace detail {
/// Stands for attention's block callback when the concept checks for_each_block.
template <class T>
struct KvBlockSinkArchetype {
  void operator()(const KvBlock<T>&) const {}
};
}  // namespace detail

/// What attention needs from a store.
///
/// Appending is a transaction: begin_append(tokens) makes room for tokens.size() pending
/// positions (throwing kvdecode::Error and changing nothing when it cannot) and tells the store
/// which token ids they hold (a prefix cache keys blocks by them, a saved cache records them);
/// write() fills pending position i of a
/// layer, for_each_block() may already read written pending rows (a prefill chunk attends to
/// itself), and commit_append() makes them part of the sequence; cancel_append() drops them,
/// leaving the store as it was before begin_append.
///
/// A cache index is a token's index in the sequence the store holds (0 = first token). The store
/// says which RoPE position a cache index is rotated by, and it may hide keys from a query
/// beyond the causal mask (a sliding window) through an optional `masks(q, k)` member.
///
/// A store describes itself once, and every consumer (MemoryPlanner, WorkCounters, the cache
/// file, the generator, the benchmarks) reads that description instead of recognising the type:
/// - `kName`, `kFileTag`: its name in reports and messages, and the fixed number a cache file
///   records for it.
/// - `Options`: what it is built from besides the config (capacity 0 = cfg.seq_len);
///   `S::memory_bytes_for(cfg, options)` is exactly the memory_bytes() of a store built so,
///   every byte it allocates (each buffer as allocated, its token ids included), saturating at
///   2^64 - 1; `options()` gives them back.
/// - `max_append()`: the most positions one begin_append accepts now (generate() feeds longer
///   inputs in pieces).
/// - `read_bytes(end)`: the bytes attention reads from the store, all layers and kv heads, to
///   attend to cache indices [0, end) once the rows up to end are written: what it really
///   streams (codes and scales of a quantized store, only the resident rows of a window).
/// - `max_exact_rollback()`: how many of the newest committed positions truncate() removes
///   leaving the store exactly as if they had never been appended.
template <class S>
concept KvStore = requires(S& s, const S& cs, std::size_t i, const typename S::Scalar* row,
                           std::span<const std::int32_t> tokens,
                           std::span<typename S::Scalar> scratch,
                           detail::KvBlockSinkArchetype<typename S::Scalar> sink,
                           const ModelConfig& cfg, const typename S::Options& options) {
  typename S::Scalar;
  typename S::Options;
  { S::kName } -> std::convertible_to<std::string_view>;
  { S::kFileTag } -> std::convertible_to<std::uint32_t>;
  { S::memory_bytes_for(cfg, options) } -> std::same_as<std::uint64_t>;
  { cs.options() } -> std::same_as<typename S::Options>;
  { cs.max_append() } -> std::same_as<std::size_t>;
  { cs.read_bytes(i) } -> std::same_as<std::uint64_t>;
  { cs.max_exact_rollback() } -> std::same_as<std::size_t>;
  { cs.size() } -> std::same_as<std::size_t>;      // committed positions
  { cs.pending() } -> std::same_as<std::size_t>;   // positions begun, not yet committed
  { cs.capacity() } -> std::same_as<std::size_t>;  // most positions it can hold
  { cs.n_layers() } -> std::same_as<std::size_t>;
  { cs.n_kv_heads() } -> std::same_as<std::size_t>;
  { cs.head_size() } -> std::same_as<std::size_t>;
  { cs.memory_bytes() } -> std::same_as<std::size_t>;
  { cs.rope_position(i) } -> std::same_as<std::size_t>;
  /// Elements of caller scratch for_each_block needs (0 when it reads in place).
  { cs.block_scratch_size() } -> std::same_as<std::size_t>;
  s.begin_append(tokens);
  // The committed token ids: all of them, or the newest ones of a store whose memory does not
  // grow with the length (a window store past S + 2R positions).
  { cs.tokens() } -> std::same_as<std::span<const std::int32_t>>;
  s.write(i, i, row, row);  // (layer, pending index, k [kv_dim], v [kv_dim])
  s.commit_append();
  { s.cancel_append() }
  noexcept;
  s.truncate(i);
  s.reset();
  // (layer, kv head, end cache index, scratch, sink): calls sink for blocks covering the
  // cache indices [0, end) that are resident, in increasing cache-index order.
  cs.for_each_block(i, i, i, scratch, sink);
};

/// A block of 8-bit rows as Int8Store keeps them: x̂ = min + code · step, code in [0, 255],
/// one f16 (min, step) per row of keys and per row of values.
struct Int8KvBlock {
  const std::uint8_t* keys = nullptr;         // [n][head_size] codes
  const std::uint8_t* values = nullptr;       // [n][head_size] codes
  const std::uint16_t* key_min = nullptr;     // [n] f16
  const std::uint16_t* key_step = nullptr;    // [n] f16
  const std::uint16_t* value_min = nullptr;   // [n] f16
  const std::uint16_t* value_step = nullptr;  // [n] f16
  std::size_t first = 0;
  std::size_t n = 0;
};

/// A block of 4- or 2-bit codes as LowBitStore keeps a full key group: 8 / bits codes a byte
/// (channel c in bits bits·(c mod 8/bits) of byte c / (8/bits)), x̂ = min + code · step with f16
/// ranges; keys with a (min, step) per channel of the group, values with one per row. With
/// `signs`, the codes are of rotated rows: the row is D H x̂ / √b (detail/rotation.hpp).
struct LowBitKvBlock {
  const std::uint8_t* keys = nullptr;         // [n][head_size · bits / 8]
  const std::uint8_t* values = nullptr;       // [n][head_size · bits / 8]
  const std::uint16_t* key_min = nullptr;     // [head_size] f16
  const std::uint16_t* key_step = nullptr;    // [head_size] f16
  const std::uint16_t* value_min = nullptr;   // [n] f16
  const std::uint16_t* value_step = nullptr;  // [n] f16
  unsigned bits = 4;
  const float* signs = nullptr;  // [head_size] the rotation's D, or null when not rotated
  std::size_t first = 0;
  std::size_t n = 0;
};

/// A store that can hand attention its rows as stored, without decoding them into scratch:
/// for_each_coded_block calls sink with blocks of its own representation (an Int8KvBlock, a
/// LowBitKvBlock) and, for rows it keeps in full precision, KvBlock<Scalar>, in increasing
/// cache-index order over the same indices for_each_block covers. What it hands decodes to
/// exactly the rows for_each_block gives (tested), so an attention kernel on codes computes
/// the same scores.
template <class S, class Sink>
concept CodedKvStore = KvStore<S> && requires(const S& cs, std::size_t i, Sink sink) {
  cs.for_each_coded_block(i, i, i, sink);
};

/// A store with an extra mask beyond causality (a sliding window): attention asks
/// masks(q, k) for every score of a query q that is not simply past all keys.
template <class S>
concept MaskingKvStore = KvStore<S> && requires(const S& cs, std::size_t i) {
  { cs.masks(i, i) } -> std::same_as<bool>;
};

}  // namespace kvdecode
