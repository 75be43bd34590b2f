// Saving KV caches to a file and restoring them, for every store kind: a versioned, checksummed
// format that records which model (config + weights hash) and which store (tag + options) wrote
// it, so a long prompt is prefilled once. Writes are atomic (temporary file, flush, fsync,
// rename); restores validate everything before touching the target. docs/FORMATS.md §1 has the
// format.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // fsync, getpid
#define KVDECODE_CACHE_FILE_HAS_FSYNC 1
#endif

// Debian's libxxhash-dev, header-only: XXH_INLINE_ALL gives every function internal linkage, so
// nothing is linked and a program that also links libxxhash sees no clash.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
// GCC 12 warns (-Wmaybe-uninitialized, inside its own AVX-512 intrinsics) on xxHash 0.8.1's
// AVX-512 loop, which no pragma here silences; its AVX2 loop (XXH_VECTOR 2 = XXH_AVX2) is clean.
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__) && !defined(XXH_VECTOR)
#define XXH_VECTOR 2
#endif
#include <xxhash.h>

#include "kvdecode/error.hpp"
#include "kvdecode/model/model.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"
#include "kvdecode/store/all_stores.hpp"
#include "kvdecode/store/block_pool.hpp"
#include "kvdecode/store/contiguous_store.hpp"
#include "kvdecode/store/int8_store.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/paged_store.hpp"
#include "kvdecode/store/q4_store.hpp"
#include "kvdecode/store/window_store.hpp"

namespace kvdecode {

// ---------------------------------------------------------------------------------------------
// The checksum: XXH3-64 (xxHash 0.8), which hashes the weights for the model fingerprint and the
// payload for its checksum faster than XXH64 on this machine class (docs/RESULTS.md).

/// A streaming XXH3-64: update() any number of times, then digest(). Same result as
/// XXH3_64bits_withSeed over the concatenated bytes.
class Checksum {
 public:
  explicit Checksum(std::uint64_t seed = 0) {
    XXH3_INITSTATE(&state_);  // xxhash.h asks this of a state not from XXH3_createState()
    XXH3_64bits_reset_withSeed(&state_, seed);
  }
  void update(const void* data, std::size_t size) {
    if (size > 0) XXH3_64bits_update(&state_, data, size);  // data may be null when size is 0
  }
  std::uint64_t digest() const { return XXH3_64bits_digest(&state_); }
  /// One-shot hash of a byte range.
  static std::uint64_t hash(const void* data, std::size_t size) {
    return size == 0 ? XXH3_64bits(nullptr, 0) : XXH3_64bits(data, size);
  }

 private:
  XXH3_state_t state_;
};

// ---------------------------------------------------------------------------------------------
// The model fingerprint.

/// What a cache file records about the model that wrote it. A cache is only meaningful for the
/// exact weights that computed it, so restore compares all of it.
struct ModelFingerprint {
  ModelConfig config;
  std::uint32_t weight_bytes = 0;  ///< sizeof the weight element: 4 f32, 8 f64, 2 bf16, or a
                                   ///< block of 32: 34 q8_0, 18 q4_0
  std::uint64_t weights_hash = 0;  ///< XXH3-64 over (element count, XXH3-64 of bytes) per tensor

  friend bool operator==(const ModelFingerprint&, const ModelFingerprint&) = default;
};

/// The fingerprint of a set of weights: one pass over every tensor byte. The generator computes
/// it once and passes it to save_cache / restore_cache.
template <class W>
ModelFingerprint model_fingerprint(const Weights<W>& weights) {
  ModelFingerprint f;
  f.config = weights.config;
  f.weight_bytes = static_cast<std::uint32_t>(sizeof(W));
  Checksum combined(sizeof(W));
  weights.for_each_tensor([&](const char*, std::int64_t, const auto& b) {  // gains and matrices
    const std::array<std::uint64_t, 2> entry = {b.size(), Checksum::hash(b.data(), b.bytes())};
    combined.update(entry.data(), sizeof(entry));
  });
  f.weights_hash = combined.digest();
  return f;
}

template <class T, class W>
ModelFingerprint model_fingerprint(const Model<T, W>& model) {
  return model_fingerprint(model.weights());
}

// ---------------------------------------------------------------------------------------------
// What a store provides to be saved (each store header's "Cache file" section).

/// A store a cache file can hold (its name and tag are part of every store's description): the
/// options a file must match (named), a payload writer, and a two-step restore (read_payload
/// checks and reads into a FileState without touching the store; commit_payload installs it and
/// cannot fail). A FileState's saved_tokens() are the ids of its first positions; one that holds
/// more positions than that (a window store that dropped the ids of old ones) says how many
/// through saved_positions().
template <class S>
concept SavableKvStore = KvStore<S> && requires(const S& cs, S& s, typename S::FileState& state) {
  S::kFileOptionNames.size();
  {cs.file_options()};
  { s.commit_payload(state) }
  noexcept;
  { std::as_const(state).saved_tokens() } -> std::same_as<std::span<const std::int32_t>>;
};

static_assert(SavableKvStore<ContiguousStore<float>> && SavableKvStore<Int8Store<float>> &&
              SavableKvStore<Q4Store<float>> && SavableKvStore<Q2Store<float>> &&
              SavableKvStore<WindowStore<float>> && SavableKvStore<PagedStore<float>>);

namespace detail::cache_file {

inline constexpr std::array<char, 8> kMagic = {'K', 'V', 'D', 'C', 'A', 'C', 'H', 'E'};
inline constexpr std::uint32_t kVersion = 3;
inline constexpr std::size_t kHeaderBytes = 232;
inline constexpr std::size_t kMaxOptions = 6;
inline constexpr std::uint32_t kLittleEndian = 1;
inline constexpr std::uint32_t kBigEndian = 2;

/// A store kind's file tag and name, to name a file's tag in messages.
struct StoreKind {
  std::uint32_t tag;
  std::string_view name;
};
template <template <class> class... Stores>
constexpr std::array<StoreKind, sizeof...(Stores)> store_kinds(StoreList<Stores...>) {
  return {{{Stores<float>::kFileTag, Stores<float>::kName}...}};
}
/// Every kind of AllStores (store/all_stores.hpp), whose files this header reads.
inline constexpr auto kStoreKinds = store_kinds(AllStores{});

inline std::string_view kind_name(std::uint32_t tag) {
  for (const StoreKind& k : kStoreKinds)
    if (k.tag == tag) return k.name;
  return "unknown";
}

inline std::uint32_t native_endian_tag() {
  return std::endian::native == std::endian::little ? kLittleEndian : kBigEndian;
}

/// Fixed-layout little-endian header fields, written and read in one order.
class HeaderBytes {
 public:
  std::array<unsigned char, kHeaderBytes> bytes{};

  void put_u32(std::size_t at, std::uint32_t v) {
    for (std::size_t i = 0; i < 4; ++i) bytes[at + i] = static_cast<unsigned char>(v >> (8 * i));
  }
  void put_u64(std::size_t at, std::uint64_t v) {
    for (std::size_t i = 0; i < 8; ++i) bytes[at + i] = static_cast<unsigned char>(v >> (8 * i));
  }
  std::uint32_t u32(std::size_t at) const {
    std::uint32_t v = 0;
    for (std::size_t i = 4; i-- > 0;) v = (v << 8) | bytes[at + i];
    return v;
  }
  std::uint64_t u64(std::size_t at) const {
    std::uint64_t v = 0;
    for (std::size_t i = 8; i-- > 0;) v = (v << 8) | bytes[at + i];
    return v;
  }
};

// Byte offsets of the v2 header fields (docs/FORMATS.md §1 has the table).
enum Offset : std::size_t {
  kOffMagic = 0,           // char[8] "KVDCACHE"
  kOffVersion = 8,         // u32
  kOffHeaderBytes = 12,    // u32 = 232
  kOffStoreTag = 16,       // u32 S::kFileTag
  kOffScalarBytes = 20,    // u32 sizeof(store Scalar)
  kOffEndian = 24,         // u32 1 little, 2 big: the payload's byte order
  kOffWeightBytes = 28,    // u32 sizeof(weight element)
  kOffConfig = 32,         // i64 × 7: dim hidden_dim n_layers n_heads n_kv_heads vocab seq_len
  kOffRopeTheta = 88,      // f64 bits
  kOffNormEps = 96,        // f64 bits
  kOffRopeStyle = 104,     // u32 0 adjacent pairs, 1 half split
  kOffShared = 108,        // u32 shared_classifier
  kOffWeightsHash = 112,   // u64
  kOffLayers = 120,        // u64 store n_layers
  kOffKvHeads = 128,       // u64 store n_kv_heads
  kOffHeadSize = 136,      // u64 store head_size
  kOffCapacity = 144,      // u64 capacity of the store that was saved (informational)
  kOffTokens = 152,        // u64 positions saved (all sequences of a pool file)
  kOffOptions = 160,       // u64 × 6 the store's file_options(), unused ones 0
  kOffPayloadBytes = 208,  // u64
  kOffPayloadHash = 216,   // u64 XXH3-64 of the payload
  kOffHeaderHash = 224,    // u64 XXH3-64 of header bytes [0, 224)
};

inline constexpr std::array<const char*, 7> kConfigNames = {
    "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};

inline std::array<std::int64_t, 7> config_fields(const ModelConfig& c) {
  return {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len};
}

inline std::string context(const std::filesystem::path& file) {
  return concat("cache file '", file.string(), "'");
}

inline std::string hex(std::uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
/// Closes on scope exit; fclose's result is checked separately on the success path.
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace detail::cache_file

/// What a cache file's header says, after the checks read_cache_file_header() makes.
struct CacheFileInfo {
  std::uint32_t version = 0;
  std::uint32_t store_tag = 0;     ///< S::kFileTag of the store(s) saved
  std::string_view store_name;     ///< its S::kName, or "unknown" for a tag this build lacks
  std::uint32_t scalar_bytes = 0;  ///< sizeof the store's Scalar
  ModelFingerprint model;
  std::uint64_t n_layers = 0, n_kv_heads = 0, head_size = 0;  ///< the store's shape
  std::uint64_t capacity = 0;  ///< the saved store's capacity (a pool's capacity)
  std::uint64_t n_tokens = 0;  ///< positions saved, over all sequences of a pool file
  std::array<std::uint64_t, detail::cache_file::kMaxOptions> options{};  ///< file_options()
  std::uint64_t payload_bytes = 0;
  std::uint64_t payload_hash = 0;
};

namespace detail::cache_file {

/// Reads and checks the header: file size, magic, version, header checksum, and that the file
/// is exactly header + payload bytes long. Leaves `f` positioned at the payload.
inline CacheFileInfo read_header(std::FILE* f, std::uint64_t file_size, const std::string& ctx) {
  KVDECODE_CHECK(file_size >= kMagic.size(), ctx, ": file is ", file_size,
                 " bytes, too short to be a kvdecode cache file (the header is ", kHeaderBytes,
                 " bytes)");
  HeaderBytes h;
  const std::size_t want =
      static_cast<std::size_t>(std::min<std::uint64_t>(file_size, kHeaderBytes));
  const std::size_t got = std::fread(h.bytes.data(), 1, want, f);
  KVDECODE_CHECK(got == want, ctx, ": read ", got, " of the first ", want, " bytes");
  KVDECODE_CHECK(std::memcmp(h.bytes.data(), kMagic.data(), kMagic.size()) == 0, ctx,
                 ": not a kvdecode cache file: the first 8 bytes are not \"KVDCACHE\"");
  KVDECODE_CHECK(file_size >= kOffVersion + 4, ctx, ": file is ", file_size,
                 " bytes, truncated inside the header (", kHeaderBytes, " bytes)");
  CacheFileInfo info;
  info.version = h.u32(kOffVersion);
  KVDECODE_CHECK(info.version == kVersion, ctx, ": format version ", info.version,
                 ", this build reads version ", kVersion);
  KVDECODE_CHECK(file_size >= kHeaderBytes, ctx, ": file is ", file_size,
                 " bytes, truncated inside the ", kHeaderBytes, "-byte header");
  const std::uint64_t header_hash = Checksum::hash(h.bytes.data(), kOffHeaderHash);
  KVDECODE_CHECK(header_hash == h.u64(kOffHeaderHash), ctx, ": header checksum ", hex(header_hash),
                 " differs from the stored ", hex(h.u64(kOffHeaderHash)),
                 ": the header is corrupted");
  // From here the header is as written by a save (or forged with a valid checksum, which the
  // checks below and the payload reader still keep from doing harm).
  KVDECODE_CHECK(h.u32(kOffHeaderBytes) == kHeaderBytes, ctx, ": header size field is ",
                 h.u32(kOffHeaderBytes), ", expected ", kHeaderBytes, " for version ", kVersion);
  const std::uint32_t endian = h.u32(kOffEndian);
  KVDECODE_CHECK(endian == native_endian_tag(), ctx, ": payload byte order ",
                 endian == kLittleEndian ? "little"
                 : endian == kBigEndian  ? "big"
                                         : "unknown",
                 "-endian (tag ", endian, ") differs from this machine's");
  info.store_tag = h.u32(kOffStoreTag);
  info.store_name = kind_name(info.store_tag);
  info.scalar_bytes = h.u32(kOffScalarBytes);
  info.model.weight_bytes = h.u32(kOffWeightBytes);
  ModelConfig& c = info.model.config;
  std::array<std::int64_t*, 7> fields = {&c.dim,        &c.hidden_dim, &c.n_layers, &c.n_heads,
                                         &c.n_kv_heads, &c.vocab_size, &c.seq_len};
  for (std::size_t i = 0; i < fields.size(); ++i)
    *fields[i] = static_cast<std::int64_t>(h.u64(kOffConfig + 8 * i));
  c.rope_theta = std::bit_cast<double>(h.u64(kOffRopeTheta));
  c.norm_eps = std::bit_cast<double>(h.u64(kOffNormEps));
  const std::uint32_t style = h.u32(kOffRopeStyle);
  KVDECODE_CHECK(style <= 1, ctx, ": rope_style tag ", style, " is neither 0 nor 1");
  c.rope_style = style == 0 ? RopeStyle::kAdjacentPairs : RopeStyle::kHalfSplit;
  c.shared_classifier = h.u32(kOffShared) != 0;
  info.model.weights_hash = h.u64(kOffWeightsHash);
  info.n_layers = h.u64(kOffLayers);
  info.n_kv_heads = h.u64(kOffKvHeads);
  info.head_size = h.u64(kOffHeadSize);
  info.capacity = h.u64(kOffCapacity);
  info.n_tokens = h.u64(kOffTokens);
  for (std::size_t i = 0; i < kMaxOptions; ++i) info.options[i] = h.u64(kOffOptions + 8 * i);
  info.payload_bytes = h.u64(kOffPayloadBytes);
  info.payload_hash = h.u64(kOffPayloadHash);

  // The payload's own layout is checked as it is read, against the bytes it really has.
  const std::uint64_t total = kHeaderBytes + info.payload_bytes;
  KVDECODE_CHECK(total >= info.payload_bytes && file_size >= total, ctx,
                 ": file is truncated: the header describes ", total, " bytes, the file has ",
                 file_size, " (", total - file_size, " missing)");
  KVDECODE_CHECK(file_size == total, ctx, ": file has ", file_size - total,
                 " trailing byte(s) after the payload: the header describes ", total,
                 " bytes, the file has ", file_size);
  return info;
}

inline std::uint64_t checked_file_size(const std::filesystem::path& file, const std::string& ctx) {
  std::error_code ec;
  const auto status = std::filesystem::status(file, ec);
  KVDECODE_CHECK(status.type() != std::filesystem::file_type::not_found, ctx,
                 ": file does not exist");
  KVDECODE_CHECK(!ec, ctx, ": cannot stat the file: ", ec.message());
  KVDECODE_CHECK(status.type() == std::filesystem::file_type::regular, ctx,
                 ": is not a regular file");
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  KVDECODE_CHECK(!ec, ctx, ": cannot read the file size: ", ec.message());
  return size;
}

inline File open_for_reading(const std::filesystem::path& file, const std::string& ctx) {
  errno = 0;
  File f(std::fopen(file.string().c_str(), "rb"));
  KVDECODE_CHECK(f != nullptr, ctx,
                 ": cannot open for reading: ", std::generic_category().message(errno));
  return f;
}

/// The weight format a fingerprint's element size stands for (sizeof(W) of the Model's W).
inline std::string describe_weight_bytes(std::uint32_t bytes) {
  switch (bytes) {
    case 2:
      return "bf16 weights";
    case 4:
      return "f32 weights";
    case 8:
      return "f64 weights";
    case sizeof(Q4_0):
      return concat("q4_0 weights (", bytes, "-byte blocks of ", kWeightBlock, ")");
    case sizeof(Q8_0):
      return concat("q8_0 weights (", bytes, "-byte blocks of ", kWeightBlock, ")");
    default:
      return concat(bytes, "-byte weights");
  }
}

/// The first difference between the file's model and the target's, or "" when they agree.
inline std::string fingerprint_difference(const ModelFingerprint& file,
                                          const ModelFingerprint& model) {
  const auto a = config_fields(file.config);
  const auto b = config_fields(model.config);
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return concat(kConfigNames[i], " ", a[i], " vs the model's ", b[i]);
  }
  if (file.config.rope_theta != model.config.rope_theta)
    return concat("rope_theta ", file.config.rope_theta, " vs the model's ",
                  model.config.rope_theta);
  if (file.config.norm_eps != model.config.norm_eps)
    return concat("norm_eps ", file.config.norm_eps, " vs the model's ", model.config.norm_eps);
  if (file.config.rope_style != model.config.rope_style) return "rope_style differs";
  if (file.config.shared_classifier != model.config.shared_classifier)
    return concat("shared_classifier ", file.config.shared_classifier, " vs the model's ",
                  model.config.shared_classifier);
  if (file.weight_bytes != model.weight_bytes)
    return concat(describe_weight_bytes(file.weight_bytes), " vs the model's ",
                  describe_weight_bytes(model.weight_bytes));
  if (file.weights_hash != model.weights_hash)
    return concat("weights hash ", hex(file.weights_hash), " vs the model's ",
                  hex(model.weights_hash), " (same shape, different weights)");
  return {};
}

/// What a file must say about the store to restore into the target: its kind, element size,
/// shape and options.
struct StoreDescription {
  std::uint32_t tag = 0;
  std::string_view name;
  std::uint32_t scalar_bytes = 0;
  std::uint64_t n_layers = 0, n_kv_heads = 0, head_size = 0, capacity = 0, n_tokens = 0;
  std::array<std::uint64_t, kMaxOptions> options{};
  std::array<std::string_view, kMaxOptions> option_names{};
};

template <SavableKvStore S>
StoreDescription describe(const S& store) {
  static_assert(S::kFileOptionNames.size() <= kMaxOptions, "the header has kMaxOptions slots");
  StoreDescription d;
  d.tag = S::kFileTag;
  d.name = S::kName;
  d.scalar_bytes = static_cast<std::uint32_t>(sizeof(typename S::Scalar));
  d.n_layers = store.n_layers();
  d.n_kv_heads = store.n_kv_heads();
  d.head_size = store.head_size();
  d.capacity = store.capacity();
  d.n_tokens = store.size();
  const auto options = store.file_options();
  std::copy(options.begin(), options.end(), d.options.begin());
  std::copy(S::kFileOptionNames.begin(), S::kFileOptionNames.end(), d.option_names.begin());
  return d;
}

/// Sink of save_payload(): writes each section in this machine's byte order and checksums it.
class PayloadWriter {
 public:
  explicit PayloadWriter(std::FILE* f) : f_(f) {}
  template <class U>
  void write(const U* data, std::size_t count) {
    const std::size_t bytes = count * sizeof(U);
    hash_.update(data, bytes);
    ok_ = ok_ && (bytes == 0 || std::fwrite(data, 1, bytes, f_) == bytes);
    bytes_ += bytes;
  }
  void u64(std::uint64_t v) { write(&v, 1); }
  bool ok() const { return ok_; }
  std::uint64_t bytes() const { return bytes_; }
  std::uint64_t digest() const { return hash_.digest(); }

 private:
  std::FILE* f_;
  Checksum hash_;
  bool ok_ = true;
  std::uint64_t bytes_ = 0;
};

/// Source of read_payload(): reads sections, checksumming them again (the file could change
/// after the first pass), and bounds every allocation: alloc() hands out at most the payload's
/// size in total, so a forged count cannot make a restore allocate more than the file holds.
class PayloadReader {
 public:
  PayloadReader(std::FILE* f, const CacheFileInfo& info, std::string ctx, std::int64_t vocab)
      : f_(f),
        remaining_(info.payload_bytes),
        budget_(info.payload_bytes),
        n_tokens_(info.n_tokens),
        vocab_(vocab),
        ctx_(std::move(ctx)) {}

  const std::string& context() const { return ctx_; }
  /// The header's position count.
  std::uint64_t n_tokens() const { return n_tokens_; }

  /// Sizes v to count elements, within what the payload could fill.
  template <class U>
  void alloc(std::vector<U>& v, std::uint64_t count, std::string_view what) {
    KVDECODE_CHECK(count <= budget_ / sizeof(U), ctx_, ": the ", what, " need ", count, " × ",
                   sizeof(U), " bytes, more than the ", budget_,
                   " payload bytes left for them: the payload is shorter than its sizes say");
    budget_ -= count * sizeof(U);
    v.resize(static_cast<std::size_t>(count));
  }
  /// Checks that count items of at least `bytes_each` payload bytes each could still follow, to
  /// bound bookkeeping sized by a count (a small multiple of the payload at most).
  void check_count(std::uint64_t count, std::size_t bytes_each, std::string_view what) const {
    KVDECODE_CHECK(count <= remaining_ / bytes_each, ctx_, ": ", count, " ", what,
                   " need at least ", bytes_each, " bytes each, ", remaining_,
                   " payload bytes remain");
  }
  /// Reads count elements into dst.
  template <class U>
  void read(U* dst, std::size_t count, std::string_view what) {
    KVDECODE_CHECK(count <= remaining_ / sizeof(U), ctx_, ": the payload ends inside the ", what,
                   ": they need ", count, " × ", sizeof(U), " bytes, ", remaining_, " remain");
    const std::size_t bytes = count * sizeof(U);
    const std::size_t got = bytes == 0 ? 0 : std::fread(dst, 1, bytes, f_);
    KVDECODE_CHECK(got == bytes, ctx_, ": read of the ", what, " failed: got ", got, " of ", bytes,
                   " bytes (did the file change while loading?)");
    hash_.update(dst, bytes);
    remaining_ -= bytes;
  }
  std::uint64_t u64(std::string_view what) {
    std::uint64_t v = 0;
    read(&v, 1, what);
    return v;
  }
  /// count token ids, each checked to lie in the model's vocabulary.
  std::vector<std::int32_t> tokens(std::uint64_t count, std::string_view what) {
    std::vector<std::int32_t> t;
    alloc(t, count, what);
    read(t.data(), t.size(), what);
    for (std::size_t i = 0; i < t.size(); ++i) {
      KVDECODE_CHECK(t[i] >= 0 && t[i] < vocab_, ctx_, ": token id ", t[i], " at position ", i,
                     " is outside the vocabulary [0, ", vocab_, ")");
    }
    return t;
  }
  /// Every byte read, and the same checksum as the first pass.
  void finish(std::uint64_t expected_hash) const {
    KVDECODE_CHECK(remaining_ == 0, ctx_, ": ", remaining_,
                   " payload byte(s) follow the store's data");
    KVDECODE_CHECK(hash_.digest() == expected_hash, ctx_,
                   ": the payload changed while it was being read");
  }

 private:
  std::FILE* f_;
  std::uint64_t remaining_;  // payload bytes not yet read
  std::uint64_t budget_;     // payload bytes not yet promised to an allocation
  std::uint64_t n_tokens_;
  std::int64_t vocab_;
  std::string ctx_;
  Checksum hash_;
};

/// Checks the header against the target (kind, element size, model, shape, options), then
/// verifies the payload checksum in one streaming pass, and leaves `f` at the payload again.
inline CacheFileInfo open_checked(const std::filesystem::path& file, const std::string& ctx,
                                  const ModelFingerprint& model, const StoreDescription& target,
                                  File& f) {
  const std::uint64_t size = checked_file_size(file, ctx);
  f = open_for_reading(file, ctx);
  const CacheFileInfo info = read_header(f.get(), size, ctx);
  KVDECODE_CHECK(info.store_tag == target.tag, ctx, ": saved from a ", info.store_name,
                 " store (tag ", info.store_tag, "), cannot restore into a ", target.name,
                 " store (tag ", target.tag, ")");
  KVDECODE_CHECK(info.scalar_bytes == target.scalar_bytes, ctx, ": holds ", info.scalar_bytes,
                 "-byte elements, the store holds ", target.scalar_bytes, "-byte elements");
  const std::string difference = fingerprint_difference(info.model, model);
  KVDECODE_CHECK(difference.empty(), ctx, ": was saved for another model: ", difference);
  KVDECODE_CHECK(info.n_layers == target.n_layers && info.n_kv_heads == target.n_kv_heads &&
                     info.head_size == target.head_size,
                 ctx, ": holds a store of ", info.n_layers, " layers, ", info.n_kv_heads,
                 " kv heads, head size ", info.head_size, "; the target store has ",
                 target.n_layers, ", ", target.n_kv_heads, ", ", target.head_size);
  for (std::size_t i = 0; i < kMaxOptions; ++i) {
    if (target.option_names[i].empty()) {
      KVDECODE_CHECK(info.options[i] == 0, ctx, ": option field ", i, " is ", info.options[i],
                     ", a ", target.name, " store has none there (expected 0)");
    } else {
      KVDECODE_CHECK(info.options[i] == target.options[i], ctx, ": saved from a ", target.name,
                     " store with ", target.option_names[i], " = ", info.options[i],
                     ", the target store has ", target.option_names[i], " = ", target.options[i]);
    }
  }
  // The first pass: a corrupted byte anywhere is reported as such before any field is parsed.
  Checksum hash;
  std::vector<unsigned char> chunk(
      static_cast<std::size_t>(std::min<std::uint64_t>(info.payload_bytes, 1 << 20)));
  for (std::uint64_t left = info.payload_bytes; left > 0;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(left, chunk.size()));
    const std::size_t got = std::fread(chunk.data(), 1, n, f.get());
    KVDECODE_CHECK(got == n, ctx, ": read of the payload failed at byte ",
                   info.payload_bytes - left + got, " of ", info.payload_bytes,
                   " (did the file change while loading?)");
    hash.update(chunk.data(), n);
    left -= n;
  }
  KVDECODE_CHECK(hash.digest() == info.payload_hash, ctx, ": payload checksum ", hex(hash.digest()),
                 " differs from the stored ", hex(info.payload_hash),
                 ": the cached keys, values or token ids are corrupted");
  KVDECODE_CHECK(std::fseek(f.get(), static_cast<long>(kHeaderBytes), SEEK_SET) == 0, ctx,
                 ": cannot seek back to the payload");
  return info;
}

/// Writes header + payload to "<file>.tmp.<pid>", flushes, fsyncs and renames it over `file`,
/// so a crash or an error at any point leaves `file` as it was (absent, or the previous complete
/// file); on error the temporary is removed.
template <class WritePayload>
void write_file(const ModelFingerprint& model, const StoreDescription& d,
                const std::filesystem::path& file, const std::string& ctx,
                WritePayload&& write_payload) {
  const ModelConfig& cfg = model.config;
  HeaderBytes h;
  std::memcpy(h.bytes.data(), kMagic.data(), kMagic.size());
  h.put_u32(kOffVersion, kVersion);
  h.put_u32(kOffHeaderBytes, static_cast<std::uint32_t>(kHeaderBytes));
  h.put_u32(kOffStoreTag, d.tag);
  h.put_u32(kOffScalarBytes, d.scalar_bytes);
  h.put_u32(kOffEndian, native_endian_tag());
  h.put_u32(kOffWeightBytes, model.weight_bytes);
  const auto fields = config_fields(cfg);
  for (std::size_t i = 0; i < fields.size(); ++i)
    h.put_u64(kOffConfig + 8 * i, static_cast<std::uint64_t>(fields[i]));
  h.put_u64(kOffRopeTheta, std::bit_cast<std::uint64_t>(cfg.rope_theta));
  h.put_u64(kOffNormEps, std::bit_cast<std::uint64_t>(cfg.norm_eps));
  h.put_u32(kOffRopeStyle, cfg.rope_style == RopeStyle::kAdjacentPairs ? 0 : 1);
  h.put_u32(kOffShared, cfg.shared_classifier ? 1 : 0);
  h.put_u64(kOffWeightsHash, model.weights_hash);
  h.put_u64(kOffLayers, d.n_layers);
  h.put_u64(kOffKvHeads, d.n_kv_heads);
  h.put_u64(kOffHeadSize, d.head_size);
  h.put_u64(kOffCapacity, d.capacity);
  h.put_u64(kOffTokens, d.n_tokens);
  for (std::size_t i = 0; i < kMaxOptions; ++i) h.put_u64(kOffOptions + 8 * i, d.options[i]);

  // Unique per process, so two processes saving to one name never share a temporary.
  std::filesystem::path tmp = file;
#ifdef KVDECODE_CACHE_FILE_HAS_FSYNC
  tmp += concat(".tmp.", static_cast<long long>(::getpid()));
#else
  tmp += ".tmp";
#endif
  try {
    errno = 0;
    File f(std::fopen(tmp.string().c_str(), "wb"));
    KVDECODE_CHECK(f != nullptr, ctx, ": cannot create '", tmp.string(),
                   "': ", std::generic_category().message(errno));
    bool ok = std::fwrite(h.bytes.data(), 1, h.bytes.size(), f.get()) == h.bytes.size();
    PayloadWriter out(f.get());
    write_payload(out);
    h.put_u64(kOffPayloadBytes, out.bytes());
    h.put_u64(kOffPayloadHash, out.digest());
    h.put_u64(kOffHeaderHash, Checksum::hash(h.bytes.data(), kOffHeaderHash));
    ok = ok && out.ok() && std::fseek(f.get(), 0, SEEK_SET) == 0 &&
         std::fwrite(h.bytes.data(), 1, h.bytes.size(), f.get()) == h.bytes.size();
    ok = ok && std::fflush(f.get()) == 0;
#ifdef KVDECODE_CACHE_FILE_HAS_FSYNC
    // The data must be on disk before the rename publishes it, or a power cut could leave the
    // final name pointing at an empty file.
    ok = ok && ::fsync(::fileno(f.get())) == 0;
#endif
    KVDECODE_CHECK(ok, ctx, ": writing '", tmp.string(), "' failed (",
                   std::generic_category().message(errno), ")");
    const int closed = std::fclose(f.release());
    KVDECODE_CHECK(closed == 0, ctx, ": closing '", tmp.string(), "' failed");
    std::error_code ec;
    std::filesystem::rename(tmp, file, ec);
    KVDECODE_CHECK(!ec, ctx, ": cannot rename '", tmp.string(), "' to it: ", ec.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
}

inline void check_shape(const ModelConfig& cfg, std::size_t n_layers, std::size_t n_kv_heads,
                        std::size_t head_size, const std::string& ctx) {
  KVDECODE_CHECK(n_layers == static_cast<std::size_t>(cfg.n_layers) &&
                     n_kv_heads == static_cast<std::size_t>(cfg.n_kv_heads) &&
                     head_size == static_cast<std::size_t>(cfg.head_size()),
                 ctx, ": the store's shape (", n_layers, " layers, ", n_kv_heads,
                 " kv heads, head size ", head_size, ") does not match the model (", cfg.n_layers,
                 ", ", cfg.n_kv_heads, ", ", cfg.head_size(), ")");
}

/// Every check of restore_cache, then the payload read into the store's FileState; the store
/// is not touched.
template <SavableKvStore S>
typename S::FileState read_cache(const ModelFingerprint& model, const S& store,
                                 const std::filesystem::path& file) {
  const std::string ctx = context(file);
  KVDECODE_CHECK(store.pending() == 0, ctx, ": cannot restore into a store with ", store.pending(),
                 " pending positions of an open append");
  File f;
  const CacheFileInfo info = open_checked(file, ctx, model, describe(store), f);
  KVDECODE_CHECK(info.n_tokens <= store.capacity(), ctx, ": holds ", info.n_tokens,
                 " positions, more than the target store's capacity ", store.capacity());
  PayloadReader in(f.get(), info, ctx, model.config.vocab_size);
  typename S::FileState state = store.read_payload(in);
  in.finish(info.payload_hash);
  return state;
}

}  // namespace detail::cache_file

/// Reads and checks a cache file's header without reading the payload (the payload checksum is
/// verified by a restore). Throws Error naming the file and the field: missing file, not a
/// cache file (magic), another format version, header checksum mismatch, truncated or with
/// trailing bytes.
inline CacheFileInfo read_cache_file_header(const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  const std::string ctx = cf::context(file);
  const std::uint64_t size = cf::checked_file_size(file, ctx);
  cf::File f = cf::open_for_reading(file, ctx);
  return cf::read_header(f.get(), size, ctx);
}

/// Writes the committed positions of `store` to `file`: the header (format version, store tag
/// and options, element size, model fingerprint, store shape, token count, checksums) then the
/// store's payload (its save_payload(); docs/FORMATS.md §1). The write is atomic: a crash or an
/// error at any point leaves `file` absent or as it was. Throws Error when an append is open in
/// the store, when the store's shape does not match the fingerprint's config, or on any I/O
/// failure; the store is never changed. A PagedStore is saved with the blocks it holds.
template <SavableKvStore S>
void save_cache(const ModelFingerprint& model, const S& store, const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  const std::string ctx = detail::concat("save_cache '", file.string(), "'");
  KVDECODE_CHECK(store.pending() == 0, ctx, ": the store has ", store.pending(),
                 " pending positions of an open append");
  cf::check_shape(model.config, store.n_layers(), store.n_kv_heads(), store.head_size(), ctx);
  cf::write_file(model, cf::describe(store), file, ctx,
                 [&](cf::PayloadWriter& out) { store.save_payload(out); });
}

/// save_cache with the fingerprint computed from the model (one pass over its weights).
template <class T, class W, SavableKvStore S>
void save_cache(const Model<T, W>& model, const S& store, const std::filesystem::path& file) {
  save_cache(model_fingerprint(model), store, file);
}

/// Replaces the contents of `store` with what `file` holds, bit for bit as it was saved (codes
/// and scales of a quantized store, the ring of a window store, a sequence's blocks in the
/// PagedStore's pool). Everything is checked and read into temporaries first: the header (see
/// read_cache_file_header), the store tag, element size and options (each named when it
/// differs), the model fingerprint (config field by field, then the weights hash), the store's
/// shape, that the tokens fit the store's capacity, the payload checksum (one pass over the
/// payload before any field of it is parsed), every size and token id in the payload; only then
/// is the store replaced, with operations that cannot fail. So on any Error the store is
/// exactly as it was. Peak extra memory is the payload size.
template <SavableKvStore S>
void restore_cache(const ModelFingerprint& model, S& store, const std::filesystem::path& file) {
  typename S::FileState state = detail::cache_file::read_cache(model, store, file);
  store.commit_payload(state);
}

/// restore_cache with the fingerprint computed from the model (one pass over its weights).
template <class T, class W, SavableKvStore S>
void restore_cache(const Model<T, W>& model, S& store, const std::filesystem::path& file) {
  restore_cache(model_fingerprint(model), store, file);
}

namespace detail::cache_file {

/// restore_prompt_prefix (require_prefix) and restore_longest_prefix.
template <SavableKvStore S>
std::size_t restore_prefix(const ModelFingerprint& model, S& store,
                           std::span<const std::int32_t> prompt, const std::filesystem::path& file,
                           bool require_prefix) {
  KVDECODE_CHECK(!prompt.empty(), "restoring a cache for a prompt: the prompt has no tokens");
  typename S::FileState state = read_cache(model, store, file);
  const std::span<const std::int32_t> saved = state.saved_tokens();
  std::size_t n_saved = saved.size();
  if constexpr (requires { state.saved_positions(); }) n_saved = state.saved_positions();
  std::size_t common = 0;
  while (common < std::min(saved.size(), prompt.size()) && saved[common] == prompt[common])
    ++common;
  if (require_prefix) {
    KVDECODE_CHECK(common == std::min(saved.size(), prompt.size()), context(file), ": holds token ",
                   saved[common], " at position ", common, " where the prompt has ", prompt[common],
                   "; it was saved for another prompt");
    KVDECODE_CHECK(n_saved <= prompt.size(), context(file), ": holds ", n_saved,
                   " tokens, more than the prompt's ", prompt.size());
  }
  const std::size_t keep = std::min(common, prompt.size() - 1);
  if constexpr (requires { state.can_truncate(keep); }) {
    KVDECODE_CHECK(keep == n_saved || state.can_truncate(keep), context(file), ": holds ", n_saved,
                   " positions of which ", keep, " are kept for the prompt; a ", S::kName,
                   " store cannot roll back from ", n_saved, " to ", keep, " positions");
  }
  store.commit_payload(state);
  if (keep < n_saved) store.truncate(keep);  // checked above: cannot fail
  return keep;
}

}  // namespace detail::cache_file

/// For a generator's --load-cache: restores `file` into `store` when its tokens are a prefix of
/// `prompt`, and returns how many prompt tokens it covers. At most prompt.size() - 1 positions
/// are kept (the store is truncated if needed), so the caller still prefills at least one token
/// and gets its logits. Works for any store. Throws Error, leaving the store as it was, when
/// restore_cache would, when the saved tokens are not a prefix of the prompt (naming the first
/// position that differs), or when the store cannot roll back to prompt.size() - 1.
template <SavableKvStore S>
std::size_t restore_prompt_prefix(const ModelFingerprint& model, S& store,
                                  std::span<const std::int32_t> prompt,
                                  const std::filesystem::path& file) {
  return detail::cache_file::restore_prefix(model, store, prompt, file, true);
}

/// Reuses as much of a saved cache as a prompt allows: restores `file` into `store`, then keeps
/// the longest common prefix of the saved tokens and `prompt`, at most prompt.size() - 1
/// positions (so the caller prefills at least one token); returns how many it kept, possibly 0.
/// Throws Error, leaving the store as it was, when restore_cache would, or when the store cannot
/// roll back that far (a window store keeps only max_chunk positions of rollback).
template <SavableKvStore S>
std::size_t restore_longest_prefix(const ModelFingerprint& model, S& store,
                                   std::span<const std::int32_t> prompt,
                                   const std::filesystem::path& file) {
  return detail::cache_file::restore_prefix(model, store, prompt, file, false);
}

// ---------------------------------------------------------------------------------------------
// Pools: several sequences and the blocks they share, in one file.

/// Saves `sequences` (all on `pool`, none mid-append) with the blocks they hold: each block
/// once, however many of them hold it (forks, prefix-cache hits), plus each sequence's block
/// table and tokens. Atomic as save_cache; throws Error changing nothing.
template <class T>
void save_pool(const ModelFingerprint& model, const BlockPool<T>& pool,
               std::type_identity_t<std::span<const PagedStore<T>* const>> sequences,
               const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  const std::string ctx = detail::concat("save_pool '", file.string(), "'");
  cf::check_shape(model.config, pool.n_layers(), pool.n_kv_heads(), pool.head_size(), ctx);
  cf::StoreDescription d;
  d.tag = PagedStore<T>::kFileTag;
  d.name = PagedStore<T>::kName;
  d.scalar_bytes = sizeof(T);
  d.n_layers = pool.n_layers();
  d.n_kv_heads = pool.n_kv_heads();
  d.head_size = pool.head_size();
  d.capacity = pool.capacity();
  for (std::size_t q = 0; q < sequences.size(); ++q) {
    const PagedStore<T>& s = *sequences[q];
    KVDECODE_CHECK(s.pool() == &pool, ctx, ": sequence ", q, " is not on the pool");
    KVDECODE_CHECK(s.pending() == 0, ctx, ": sequence ", s.id(), " has ", s.pending(),
                   " pending positions of an open append");
    d.n_tokens += s.size();
  }
  d.options[0] = pool.block_size();
  cf::write_file(model, d, file, ctx, [&](cf::PayloadWriter& out) {
    PagedStore<T>::save_pool_payload(out, pool, sequences);
  });
}

/// Replaces the contents of `sequences` (on `pool`, as many as the file holds) with the saved
/// ones: the blocks are taken from the pool once each and shared as they were saved (equal
/// reference counts), and full blocks re-enter the prefix cache, so later requests with the same
/// prefix reuse them. Checks everything first, including that the pool has the blocks once the
/// targets' own are released; on any Error the pool and every sequence are as they were.
template <class T>
void restore_pool(const ModelFingerprint& model, BlockPool<T>& pool,
                  std::type_identity_t<std::span<PagedStore<T>* const>> sequences,
                  const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  const std::string ctx = cf::context(file);
  cf::StoreDescription d;
  d.tag = PagedStore<T>::kFileTag;
  d.name = PagedStore<T>::kName;
  d.scalar_bytes = sizeof(T);
  d.n_layers = pool.n_layers();
  d.n_kv_heads = pool.n_kv_heads();
  d.head_size = pool.head_size();
  d.options[0] = pool.block_size();
  d.option_names[0] = PagedStore<T>::kFileOptionNames[0];
  cf::File f;
  const CacheFileInfo info = cf::open_checked(file, ctx, model, d, f);
  cf::PayloadReader in(f.get(), info, ctx, model.config.vocab_size);
  std::vector<const PagedStore<T>*> targets(sequences.begin(), sequences.end());
  auto state = PagedStore<T>::read_pool_payload(in, pool, targets);
  in.finish(info.payload_hash);
  PagedStore<T>::commit_pool_payload(pool, sequences, state);
}

}  // namespace kvdecode
