// Saving a sequence's KV cache to a file and restoring it: a versioned, checksummed format that
// records which model (config + weights hash) and which store kind wrote it, so a long prompt is
// prefilled once. Writes are atomic (temporary file, flush, fsync, rename); restores validate
// everything before touching the target store. The format is written out in docs/ERRORS.md §4.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
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
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // fsync, getpid
#define KVDECODE_CACHE_FILE_HAS_FSYNC 1
#endif

#include "kvdecode/bf16.hpp"
#include "kvdecode/contiguous_store.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model.hpp"
#include "kvdecode/model_config.hpp"
#include "kvdecode/weights.hpp"

namespace kvdecode {

// ---------------------------------------------------------------------------------------------
// XXH64: the 64-bit xxHash of Yann Collet (github.com/Cyan4973/xxHash, XXH64 spec), written out
// here so the library has no dependency. It hashes the weights for the model fingerprint and the
// payload for its checksum at several GB/s (FNV-1a's byte loop would take seconds on 7B weights).

/// A streaming XXH64: update() any number of times, then digest(). Same result as one call over
/// the concatenated bytes.
class Xxh64 {
 public:
  explicit Xxh64(std::uint64_t seed = 0)
      : acc_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed) {}

  void update(const void* data, std::size_t size) {
    if (size == 0) return;  // data may be null (an empty span); memcpy(…, nullptr, 0) is UB
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += size;
    if (buffered_ + size < 32) {
      std::memcpy(buffer_.data() + buffered_, p, size);
      buffered_ += size;
      return;
    }
    if (buffered_ > 0) {
      const std::size_t fill = 32 - buffered_;
      std::memcpy(buffer_.data() + buffered_, p, fill);
      stripe(buffer_.data());
      p += fill;
      size -= fill;
      buffered_ = 0;
    }
    for (; size >= 32; p += 32, size -= 32) stripe(p);
    std::memcpy(buffer_.data(), p, size);
    buffered_ = size;
  }

  std::uint64_t digest() const {
    std::uint64_t h;
    if (total_ >= 32) {
      h = std::rotl(acc_[0], 1) + std::rotl(acc_[1], 7) + std::rotl(acc_[2], 12) +
          std::rotl(acc_[3], 18);
      for (const std::uint64_t a : acc_) h = (h ^ round(0, a)) * kP1 + kP4;
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const unsigned char* p = buffer_.data();
    std::size_t n = buffered_;
    for (; n >= 8; p += 8, n -= 8) h = std::rotl(h ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (n >= 4) {
      h = std::rotl(h ^ (std::uint64_t{read32(p)} * kP1), 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; ++p, --n) h = std::rotl(h ^ (std::uint64_t{*p} * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

  /// One-shot hash of a byte range.
  static std::uint64_t hash(const void* data, std::size_t size, std::uint64_t seed = 0) {
    Xxh64 h(seed);
    h.update(data, size);
    return h.digest();
  }

 private:
  static constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ull;
  static constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
  static constexpr std::uint64_t kP3 = 0x165667B19E3779F9ull;
  static constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
  static constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ull;

  // The spec reads lanes little-endian; memcpy compiles to one load.
  static std::uint64_t read64(const unsigned char* p) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    if constexpr (std::endian::native == std::endian::big) {
      std::uint64_t r = 0;
      for (int i = 0; i < 8; ++i) r = (r << 8) | ((v >> (8 * i)) & 0xFF);
      v = r;
    }
    return v;
  }
  static std::uint32_t read32(const unsigned char* p) {
    return std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) | (std::uint32_t{p[2]} << 16) |
           (std::uint32_t{p[3]} << 24);
  }
  static std::uint64_t round(std::uint64_t acc, std::uint64_t lane) {
    return std::rotl(acc + lane * kP2, 31) * kP1;
  }
  void stripe(const unsigned char* p) {
    for (std::size_t i = 0; i < 4; ++i) acc_[i] = round(acc_[i], read64(p + 8 * i));
  }

  std::array<std::uint64_t, 4> acc_;
  std::array<unsigned char, 32> buffer_{};  // [32] bytes of an incomplete stripe
  std::size_t buffered_ = 0;
  std::uint64_t total_ = 0;
  std::uint64_t seed_;
};

// ---------------------------------------------------------------------------------------------
// The model fingerprint.

/// What a cache file records about the model that wrote it. A cache is only meaningful for the
/// exact weights that computed it, so restore compares all of it.
struct ModelFingerprint {
  ModelConfig config;
  std::uint32_t weight_bytes = 0;  ///< bytes per stored weight element (4 f32, 8 f64, 2 bf16)
  std::uint64_t weights_hash = 0;  ///< XXH64 over (element count, XXH64 of bytes) of each tensor

  friend bool operator==(const ModelFingerprint&, const ModelFingerprint&) = default;
};

/// The fingerprint of a set of weights: one pass over every tensor byte (≈ 0.2 s per GB). The
/// generator computes it once and passes it to save_cache / restore_cache.
template <class W>
ModelFingerprint model_fingerprint(const Weights<W>& weights) {
  ModelFingerprint f;
  f.config = weights.config;
  f.weight_bytes = static_cast<std::uint32_t>(sizeof(W));
  Xxh64 combined(sizeof(W));
  weights.for_each_tensor([&](const char*, std::int64_t, const AlignedBuffer<W>& b) {
    const std::array<std::uint64_t, 2> entry = {b.size(), Xxh64::hash(b.data(), b.bytes())};
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
// Store kinds. A store type that can be saved specialises CacheFileStore with its tag; the tags
// are fixed forever (a file's tag says which kind wrote it). Reserved: 2 paged, 3 quantized,
// 4 windowed.

template <class S>
struct CacheFileStore;  // no definition: a store without a tag cannot be saved

template <class T>
struct CacheFileStore<ContiguousStore<T>> {
  static constexpr std::uint32_t kKind = 1;
};

namespace detail::cache_file {

inline constexpr std::array<char, 8> kMagic = {'K', 'V', 'D', 'C', 'A', 'C', 'H', 'E'};
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 184;
inline constexpr std::uint32_t kLittleEndian = 1;
inline constexpr std::uint32_t kBigEndian = 2;

inline const char* kind_name(std::uint32_t kind) {
  switch (kind) {
    case 1:
      return "contiguous";
    case 2:
      return "paged";
    case 3:
      return "quantized";
    case 4:
      return "windowed";
    default:
      return "unknown";
  }
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

// Byte offsets of the v1 header fields (docs/ERRORS.md §4 has the table).
enum Offset : std::size_t {
  kOffMagic = 0,           // char[8] "KVDCACHE"
  kOffVersion = 8,         // u32
  kOffHeaderBytes = 12,    // u32 = 184
  kOffStoreKind = 16,      // u32 CacheFileStore<S>::kKind
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
  kOffTokens = 152,        // u64 n_tokens
  kOffPayloadBytes = 160,  // u64
  kOffPayloadHash = 168,   // u64 XXH64 of the payload
  kOffHeaderHash = 176,    // u64 XXH64 of header bytes [0, 176)
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

/// Payload bytes for n tokens of the given shape, or 0 with overflow = true.
inline std::uint64_t payload_bytes(std::uint64_t n, std::uint64_t layers, std::uint64_t kv_dim,
                                   std::uint64_t scalar, bool& overflow) {
  const auto mul = [&](std::uint64_t a, std::uint64_t b) {
    if (b != 0 && a > std::numeric_limits<std::uint64_t>::max() / b) overflow = true;
    return a * b;
  };
  const std::uint64_t rows = mul(mul(mul(2, layers), n), kv_dim);
  const std::uint64_t kv = mul(rows, scalar);
  const std::uint64_t tokens = mul(4, n);
  if (kv > std::numeric_limits<std::uint64_t>::max() - tokens) overflow = true;
  return overflow ? 0 : kv + tokens;
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
  std::uint32_t store_kind = 0;    ///< CacheFileStore<S>::kKind of the store that was saved
  std::uint32_t scalar_bytes = 0;  ///< sizeof the store's Scalar
  ModelFingerprint model;
  std::uint64_t n_layers = 0, n_kv_heads = 0, head_size = 0;  ///< the store's shape
  std::uint64_t capacity = 0;                                 ///< the saved store's capacity
  std::uint64_t n_tokens = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t payload_hash = 0;
};

namespace detail::cache_file {

/// Reads and checks the header: file size, magic, version, header checksum, internal consistency
/// and the file size implied by the payload. Leaves `f` positioned at the payload.
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
  const std::uint64_t header_hash = Xxh64::hash(h.bytes.data(), kOffHeaderHash);
  KVDECODE_CHECK(header_hash == h.u64(kOffHeaderHash), ctx, ": header checksum ", hex(header_hash),
                 " differs from the stored ", hex(h.u64(kOffHeaderHash)),
                 ": the header is corrupted");
  // From here the header is as written by save_cache (or forged with a valid checksum, which
  // the checks below still keep from doing harm).
  KVDECODE_CHECK(h.u32(kOffHeaderBytes) == kHeaderBytes, ctx, ": header size field is ",
                 h.u32(kOffHeaderBytes), ", expected ", kHeaderBytes, " for version ", kVersion);
  const std::uint32_t endian = h.u32(kOffEndian);
  KVDECODE_CHECK(endian == native_endian_tag(), ctx, ": payload byte order ",
                 endian == kLittleEndian ? "little"
                 : endian == kBigEndian  ? "big"
                                         : "unknown",
                 "-endian (tag ", endian, ") differs from this machine's");
  info.store_kind = h.u32(kOffStoreKind);
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
  info.payload_bytes = h.u64(kOffPayloadBytes);
  info.payload_hash = h.u64(kOffPayloadHash);

  KVDECODE_CHECK(info.n_tokens <= info.capacity, ctx, ": holds ", info.n_tokens,
                 " tokens, more than the saved store's capacity ", info.capacity);
  bool overflow = info.n_kv_heads != 0 &&
                  info.head_size > std::numeric_limits<std::uint64_t>::max() / info.n_kv_heads;
  const std::uint64_t kv_dim = overflow ? 0 : info.n_kv_heads * info.head_size;
  const std::uint64_t expected =
      payload_bytes(info.n_tokens, info.n_layers, kv_dim, info.scalar_bytes, overflow);
  KVDECODE_CHECK(!overflow && expected == info.payload_bytes, ctx, ": payload size field says ",
                 info.payload_bytes, " bytes, but ", info.n_tokens, " tokens × ", info.n_layers,
                 " layers × ", info.n_kv_heads, " kv heads × head size ", info.head_size, " × ",
                 info.scalar_bytes, "-byte elements need ",
                 overflow ? std::string("more than 2^64") : std::to_string(expected));
  const std::uint64_t total = kHeaderBytes + info.payload_bytes;
  KVDECODE_CHECK(total >= info.payload_bytes && file_size >= total, ctx,
                 ": file is truncated: the header describes ", total, " bytes (", info.n_tokens,
                 " tokens), the file has ", file_size, " (", total - file_size, " missing)");
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
    return concat(file.weight_bytes, "-byte weights vs the model's ", model.weight_bytes,
                  "-byte weights");
  if (file.weights_hash != model.weights_hash)
    return concat("weights hash ", hex(file.weights_hash), " vs the model's ",
                  hex(model.weights_hash), " (same shape, different weights)");
  return {};
}

}  // namespace detail::cache_file

/// Reads and checks a cache file's header without reading the payload (the payload checksum is
/// verified by restore_cache). Throws Error naming the file and the field: missing file, not a
/// cache file (magic), another format version, header checksum mismatch, inconsistent sizes,
/// truncated or with trailing bytes.
inline CacheFileInfo read_cache_file_header(const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  const std::string ctx = cf::context(file);
  const std::uint64_t size = cf::checked_file_size(file, ctx);
  cf::File f = cf::open_for_reading(file, ctx);
  return cf::read_header(f.get(), size, ctx);
}

/// Writes the committed positions of `store` to `file`: the header (format version, store kind,
/// element size, model fingerprint, store shape, token count, payload checksum) then the payload
/// (token ids, then per layer the keys [n_tokens][kv_dim] and values [n_tokens][kv_dim]).
/// The bytes go to "<file>.tmp.<pid>", which is flushed, fsync'ed and renamed over `file`, so a
/// crash or an error at any point leaves `file` as it was (absent, or the previous complete
/// file). Throws Error when an append is open in the store, when the store's shape does not match
/// the fingerprint's config, or on any I/O failure; the store is never changed.
template <KvStore S>
void save_cache(const ModelFingerprint& model, const S& store, const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  using T = typename S::Scalar;
  const std::string ctx = detail::concat("save_cache '", file.string(), "'");
  const ModelConfig& cfg = model.config;
  KVDECODE_CHECK(store.pending() == 0, ctx, ": the store has ", store.pending(),
                 " pending positions of an open append");
  KVDECODE_CHECK(store.n_layers() == static_cast<std::size_t>(cfg.n_layers) &&
                     store.n_kv_heads() == static_cast<std::size_t>(cfg.n_kv_heads) &&
                     store.head_size() == static_cast<std::size_t>(cfg.head_size()),
                 ctx, ": the store's shape (", store.n_layers(), " layers, ", store.n_kv_heads(),
                 " kv heads, head size ", store.head_size(), ") does not match the model (",
                 cfg.n_layers, ", ", cfg.n_kv_heads, ", ", cfg.head_size(), ")");
  const std::size_t n = store.size();
  const std::size_t hs = store.head_size();
  const std::size_t kv_dim = store.n_kv_heads() * hs;
  bool overflow = false;
  const std::uint64_t payload = cf::payload_bytes(n, store.n_layers(), kv_dim, sizeof(T), overflow);

  cf::HeaderBytes h;
  std::memcpy(h.bytes.data(), cf::kMagic.data(), cf::kMagic.size());
  h.put_u32(cf::kOffVersion, cf::kVersion);
  h.put_u32(cf::kOffHeaderBytes, static_cast<std::uint32_t>(cf::kHeaderBytes));
  h.put_u32(cf::kOffStoreKind, CacheFileStore<S>::kKind);
  h.put_u32(cf::kOffScalarBytes, static_cast<std::uint32_t>(sizeof(T)));
  h.put_u32(cf::kOffEndian, cf::native_endian_tag());
  h.put_u32(cf::kOffWeightBytes, model.weight_bytes);
  const auto fields = cf::config_fields(cfg);
  for (std::size_t i = 0; i < fields.size(); ++i)
    h.put_u64(cf::kOffConfig + 8 * i, static_cast<std::uint64_t>(fields[i]));
  h.put_u64(cf::kOffRopeTheta, std::bit_cast<std::uint64_t>(cfg.rope_theta));
  h.put_u64(cf::kOffNormEps, std::bit_cast<std::uint64_t>(cfg.norm_eps));
  h.put_u32(cf::kOffRopeStyle, cfg.rope_style == RopeStyle::kAdjacentPairs ? 0 : 1);
  h.put_u32(cf::kOffShared, cfg.shared_classifier ? 1 : 0);
  h.put_u64(cf::kOffWeightsHash, model.weights_hash);
  h.put_u64(cf::kOffLayers, store.n_layers());
  h.put_u64(cf::kOffKvHeads, store.n_kv_heads());
  h.put_u64(cf::kOffHeadSize, hs);
  h.put_u64(cf::kOffCapacity, store.capacity());
  h.put_u64(cf::kOffTokens, n);
  h.put_u64(cf::kOffPayloadBytes, payload);

  // Unique per process, so two processes saving to one name never share a temporary.
  std::filesystem::path tmp = file;
#ifdef KVDECODE_CACHE_FILE_HAS_FSYNC
  tmp += detail::concat(".tmp.", static_cast<long long>(::getpid()));
#else
  tmp += ".tmp";
#endif
  try {
    errno = 0;
    cf::File f(std::fopen(tmp.string().c_str(), "wb"));
    KVDECODE_CHECK(f != nullptr, ctx, ": cannot create '", tmp.string(),
                   "': ", std::generic_category().message(errno));
    bool ok = std::fwrite(h.bytes.data(), 1, h.bytes.size(), f.get()) == h.bytes.size();
    Xxh64 payload_hash;
    const auto put = [&](const void* data, std::size_t bytes) {
      payload_hash.update(data, bytes);
      ok = ok && std::fwrite(data, 1, bytes, f.get()) == bytes;
    };
    // Token ids as int32, then the scalars, all in this machine's byte order (the endian tag).
    const std::span<const std::int32_t> tokens = store.tokens();
    put(tokens.data(), tokens.size_bytes());
    // Per layer: keys then values as [n][kv_dim] rows, gathered through for_each_block so any
    // full-history store can reuse this writer.
    std::vector<T> keys(n * kv_dim), values(n * kv_dim), scratch(store.block_scratch_size());
    for (std::size_t l = 0; l < store.n_layers() && n > 0; ++l) {
      for (std::size_t g = 0; g < store.n_kv_heads(); ++g) {
        std::size_t rows = 0;
        store.for_each_block(l, g, n, std::span<T>(scratch), [&](const KvBlock<T>& b) {
          for (std::size_t r = 0; r < b.n; ++r) {
            const std::size_t at = (b.first + r) * kv_dim + g * hs;
            std::copy_n(b.keys + r * b.stride, hs, keys.data() + at);
            std::copy_n(b.values + r * b.stride, hs, values.data() + at);
          }
          rows += b.n;
        });
        KVDECODE_CHECK(rows == n, ctx, ": the store returned ", rows, " of ", n,
                       " positions for layer ", l, " kv head ", g,
                       "; only stores that keep every position can be saved");
      }
      put(keys.data(), keys.size() * sizeof(T));
      put(values.data(), values.size() * sizeof(T));
    }
    h.put_u64(cf::kOffPayloadHash, payload_hash.digest());
    h.put_u64(cf::kOffHeaderHash, Xxh64::hash(h.bytes.data(), cf::kOffHeaderHash));
    ok = ok && std::fseek(f.get(), 0, SEEK_SET) == 0 &&
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

/// save_cache with the fingerprint computed from the model (one pass over its weights).
template <class T, class W, KvStore S>
void save_cache(const Model<T, W>& model, const S& store, const std::filesystem::path& file) {
  save_cache(model_fingerprint(model), store, file);
}

/// Replaces the contents of `store` with the sequence saved in `file`. Everything is checked
/// and read into temporaries first: the header (see read_cache_file_header), the store kind and
/// element size, the model fingerprint (config field by field, then the weights hash), the
/// store's shape, that the tokens fit the store's capacity, the payload checksum and every token
/// id; only then is the store reset and filled, with operations that cannot fail. So on any
/// Error the store is exactly as it was. Peak extra memory is the payload size.
template <KvStore S>
void restore_cache(const ModelFingerprint& model, S& store, const std::filesystem::path& file) {
  namespace cf = detail::cache_file;
  using T = typename S::Scalar;
  const std::string ctx = cf::context(file);
  KVDECODE_CHECK(store.pending() == 0, ctx, ": cannot restore into a store with ", store.pending(),
                 " pending positions of an open append");
  const std::uint64_t size = cf::checked_file_size(file, ctx);
  cf::File f = cf::open_for_reading(file, ctx);
  const CacheFileInfo info = cf::read_header(f.get(), size, ctx);

  constexpr std::uint32_t kKind = CacheFileStore<S>::kKind;
  KVDECODE_CHECK(info.store_kind == kKind, ctx, ": saved from a ", cf::kind_name(info.store_kind),
                 " store (kind ", info.store_kind, "), cannot restore into a ",
                 cf::kind_name(kKind), " store (kind ", kKind, ")");
  KVDECODE_CHECK(info.scalar_bytes == sizeof(T), ctx, ": holds ", info.scalar_bytes,
                 "-byte elements, the store holds ", sizeof(T), "-byte elements");
  const std::string difference = cf::fingerprint_difference(info.model, model);
  KVDECODE_CHECK(difference.empty(), ctx, ": was saved for another model: ", difference);
  KVDECODE_CHECK(info.n_layers == store.n_layers() && info.n_kv_heads == store.n_kv_heads() &&
                     info.head_size == store.head_size(),
                 ctx, ": holds a store of ", info.n_layers, " layers, ", info.n_kv_heads,
                 " kv heads, head size ", info.head_size, "; the target store has ",
                 store.n_layers(), ", ", store.n_kv_heads(), ", ", store.head_size());
  KVDECODE_CHECK(info.n_tokens <= store.capacity(), ctx, ": holds ", info.n_tokens,
                 " positions, more than the target store's capacity ", store.capacity());

  // Everything below is bounded by the file's real size (checked against the header above).
  const auto n = static_cast<std::size_t>(info.n_tokens);
  const std::size_t kv_dim = store.n_kv_heads() * store.head_size();
  Xxh64 payload_hash;
  const auto get = [&](void* data, std::size_t bytes, const char* what, std::size_t layer) {
    const std::size_t got = std::fread(data, 1, bytes, f.get());
    KVDECODE_CHECK(got == bytes, ctx, ": read of the ", what, " of layer ", layer, " failed: got ",
                   got, " of ", bytes, " bytes (did the file change while loading?)");
    payload_hash.update(data, bytes);
  };
  std::vector<std::int32_t> tokens(n);
  get(tokens.data(), n * sizeof(std::int32_t), "token ids", 0);
  std::vector<T> keys(store.n_layers() * n * kv_dim);    // [n_layers][n][kv_dim]
  std::vector<T> values(store.n_layers() * n * kv_dim);  // [n_layers][n][kv_dim]
  for (std::size_t l = 0; l < store.n_layers(); ++l) {
    get(keys.data() + l * n * kv_dim, n * kv_dim * sizeof(T), "keys", l);
    get(values.data() + l * n * kv_dim, n * kv_dim * sizeof(T), "values", l);
  }
  const std::uint64_t hash = payload_hash.digest();
  KVDECODE_CHECK(hash == info.payload_hash, ctx, ": payload checksum ", cf::hex(hash),
                 " differs from the stored ", cf::hex(info.payload_hash),
                 ": the cached keys, values or token ids are corrupted");
  const std::int64_t vocab = model.config.vocab_size;
  for (std::size_t i = 0; i < n; ++i) {
    KVDECODE_CHECK(tokens[i] >= 0 && tokens[i] < vocab, ctx, ": token id ", tokens[i],
                   " at position ", i, " is outside the vocabulary [0, ", vocab, ")");
  }

  // Commit: nothing here can throw (no pending append, n <= capacity, rows of the right size).
  store.reset();
  if (n == 0) return;
  store.begin_append(tokens);
  for (std::size_t l = 0; l < store.n_layers(); ++l)
    for (std::size_t i = 0; i < n; ++i)
      store.write(l, i, keys.data() + (l * n + i) * kv_dim, values.data() + (l * n + i) * kv_dim);
  store.commit_append();
}

/// restore_cache with the fingerprint computed from the model (one pass over its weights).
template <class T, class W, KvStore S>
void restore_cache(const Model<T, W>& model, S& store, const std::filesystem::path& file) {
  restore_cache(model_fingerprint(model), store, file);
}

/// For a generator's --load-cache: restores `file` into `store` (as restore_cache) when its
/// tokens are a prefix of `prompt`, and returns how many prompt tokens it covers. At most
/// prompt.size() - 1 positions are kept (the store is truncated if needed), so the caller still
/// prefills at least one token and gets its logits. S must be constructible from (ModelConfig,
/// capacity), as ContiguousStore is: the file is restored into a fresh store, which is moved
/// into `store` only when it fits the prompt (so this briefly holds two caches). Throws Error,
/// leaving the store as it was, when restore_cache would, or when the saved tokens are not a
/// prefix of the prompt (naming the first position that differs).
template <KvStore S>
std::size_t restore_prompt_prefix(const ModelFingerprint& model, S& store,
                                  std::span<const std::int32_t> prompt,
                                  const std::filesystem::path& file) {
  KVDECODE_CHECK(!prompt.empty(), "restore_prompt_prefix: the prompt has no tokens");
  // Restore into a scratch copy first, so a prompt mismatch also leaves `store` untouched.
  S restored(model.config, store.capacity());
  restore_cache(model, restored, file);
  const std::span<const std::int32_t> saved = restored.tokens();
  const std::size_t common = std::min(saved.size(), prompt.size());
  for (std::size_t i = 0; i < common; ++i) {
    KVDECODE_CHECK(saved[i] == prompt[i], detail::cache_file::context(file), ": holds token ",
                   saved[i], " at position ", i, " where the prompt has ", prompt[i],
                   "; it was saved for another prompt");
  }
  KVDECODE_CHECK(saved.size() <= prompt.size(), detail::cache_file::context(file), ": holds ",
                 saved.size(), " tokens, more than the prompt's ", prompt.size());
  const std::size_t keep = std::min(saved.size(), prompt.size() - 1);
  restored.truncate(keep);
  store = std::move(restored);
  return keep;
}

}  // namespace kvdecode
