// PrefixTier<T>: a persistent second level behind a BlockPool's prefix cache. Full blocks the
// pool evicts are written to a directory, one checksummed file per block named by the model and
// the block's chained prefix hash, so a restarted process reuses prefixes it computed before.
// The file format is docs/FORMATS.md §4; how it fits the pool, docs/PAGED.md "Prefix tier".
//
// API (for a serving engine):
//
//   PrefixTier<float> tier(fingerprint, {.directory = "cache/prefixes", .max_bytes = 1 << 30});
//   tier.attach(pool);        // the pool now spills evicted blocks to it and asks it on a miss
//   ... PagedStore<float>::open(pool, prompt) as usual: disk blocks count as cached ...
//   pool.spill_cached();      // optional, before shutdown: every cached block to disk
//   tier.stats();             // disk hits / misses, files written / evicted / skipped by reason
//   tier.detach();            // or the destructor; the pool must outlive an attached tier
//
// Threads: the pool is single-threaded, and the tier is called only from the pool's thread (one
// engine thread). Several processes may share a directory: a file appears whole (temporary +
// rename) or not at all, each process keeps its own index and applies its cap to the files it
// knows, and a file removed by another process is a miss.
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
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/io/cache_file.hpp"  // ModelFingerprint, Checksum (XXH3-64)
#include "kvdecode/store/block_pool.hpp"

namespace kvdecode {

/// Where a PrefixTier keeps its files and how many bytes of them it keeps.
struct PrefixTierOptions {
  std::filesystem::path directory;
  /// The most bytes of block files kept; the least recently used files go first.
  std::uint64_t max_bytes = std::uint64_t{1} << 30;
};

/// Why a block file was not used. Such a file is counted and never read into a block; all but
/// a mismatch are deleted (a mismatching file is a valid block of another prefix whose hash
/// collides, or a renamed file).
enum class TierSkip : std::size_t {
  kTruncated,    ///< shorter than its header says (a crash during a copy, a full disk)
  kCorrupt,      ///< bad magic, a checksum that does not match, trailing bytes
  kVersion,      ///< another format version
  kModel,        ///< another model fingerprint (config, weights hash, weight element size)
  kBlockSize,    ///< another block size
  kElementType,  ///< another element type or byte order
  kMismatch,     ///< a valid block, but not of the prefix asked for (hash, parent or tokens)
  kUnreadable,   ///< listed but could not be opened or read (removed by another process)
};
inline constexpr std::size_t kTierSkipReasons = 8;
inline constexpr std::array<std::string_view, kTierSkipReasons> kTierSkipNames = {
    "truncated",  "corrupt",      "version",  "model",
    "block size", "element type", "mismatch", "unreadable"};

/// Cumulative since construction. Memory hits and misses are the pool's (BlockPool::stats());
/// a miss there is asked here, and counts as one disk hit or one disk miss.
struct PrefixTierStats {
  std::uint64_t disk_hits = 0;       ///< blocks loaded from a file into the pool
  std::uint64_t disk_misses = 0;     ///< blocks asked for that no usable file held
  std::uint64_t files_written = 0;   ///< block files written (spills of blocks not yet on disk)
  std::uint64_t files_evicted = 0;   ///< files removed to stay within max_bytes
  std::uint64_t write_failures = 0;  ///< spills not written: an I/O error, or max_bytes < a file
  std::array<std::uint64_t, kTierSkipReasons> skipped{};  ///< files not used, by TierSkip
  std::uint64_t files_on_disk = 0;                        ///< files in the index now
  std::uint64_t bytes_on_disk = 0;                        ///< their bytes now, at most max_bytes

  std::uint64_t skipped_for(TierSkip r) const { return skipped[static_cast<std::size_t>(r)]; }
  std::uint64_t files_skipped() const {
    std::uint64_t n = 0;
    for (const std::uint64_t s : skipped) n += s;
    return n;
  }
};

namespace detail::prefix_tier {

inline constexpr std::array<char, 8> kMagic = {'K', 'V', 'D', 'B', 'L', 'O', 'C', 'K'};
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 192;
inline constexpr std::string_view kExtension = ".kvblock";

// Byte offsets of the header fields (docs/FORMATS.md §4 has the table).
enum Offset : std::size_t {
  kOffMagic = 0,           // char[8] "KVDBLOCK"
  kOffVersion = 8,         // u32
  kOffHeaderBytes = 12,    // u32 = 192
  kOffScalarBytes = 16,    // u32 sizeof(T) of the pool
  kOffEndian = 20,         // u32 1 little, 2 big: the payload's byte order
  kOffWeightBytes = 24,    // u32 the fingerprint's weight element size
  kOffRopeStyle = 28,      // u32 0 adjacent pairs, 1 half split
  kOffConfig = 32,         // i64 × 7: dim hidden_dim n_layers n_heads n_kv_heads vocab seq_len
  kOffRopeTheta = 88,      // f64 bits
  kOffNormEps = 96,        // f64 bits
  kOffShared = 104,        // u32 shared_classifier, then u32 0
  kOffWeightsHash = 112,   // u64
  kOffLayers = 120,        // u64 n_layers of the pool
  kOffKvHeads = 128,       // u64 n_kv_heads
  kOffHeadSize = 136,      // u64 head_size
  kOffBlockSize = 144,     // u64 block_size
  kOffPrefixHash = 152,    // u64 the pool's chained hash of the prefix the block ends
  kOffParentHash = 160,    // u64 the hash of the prefix before it
  kOffPayloadBytes = 168,  // u64
  kOffPayloadHash = 176,   // u64 XXH3-64 of the payload
  kOffHeaderHash = 184,    // u64 XXH3-64 of header bytes [0, 184)
};
/// Header bytes [kOffScalarBytes, kOffPrefixHash) are the same in every file of one tier
/// layout (model, element type, block size, shape); their hash names the tier's files.
inline constexpr std::size_t kLayoutEnd = kOffPrefixHash;

inline void put_u32(unsigned char* p, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_u64(unsigned char* p, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline std::uint32_t get_u32(const unsigned char* p) {
  std::uint32_t v = 0;
  for (std::size_t i = 4; i-- > 0;) v = (v << 8) | p[i];
  return v;
}
inline std::uint64_t get_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (std::size_t i = 8; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

/// The header of every file of a tier, up to the per-block fields (which stay 0).
inline std::array<unsigned char, kHeaderBytes> layout_header(
    const ModelFingerprint& model, std::size_t scalar_bytes, std::size_t n_layers,
    std::size_t n_kv_heads, std::size_t head_size, std::size_t block_size) {
  std::array<unsigned char, kHeaderBytes> h{};
  const ModelConfig& c = model.config;
  std::memcpy(h.data() + kOffMagic, kMagic.data(), kMagic.size());
  put_u32(h.data() + kOffVersion, kVersion);
  put_u32(h.data() + kOffHeaderBytes, static_cast<std::uint32_t>(kHeaderBytes));
  put_u32(h.data() + kOffScalarBytes, static_cast<std::uint32_t>(scalar_bytes));
  put_u32(h.data() + kOffEndian, detail::cache_file::native_endian_tag());
  put_u32(h.data() + kOffWeightBytes, model.weight_bytes);
  put_u32(h.data() + kOffRopeStyle, c.rope_style == RopeStyle::kAdjacentPairs ? 0 : 1);
  const std::array<std::int64_t, 7> fields = {c.dim,        c.hidden_dim, c.n_layers, c.n_heads,
                                              c.n_kv_heads, c.vocab_size, c.seq_len};
  for (std::size_t i = 0; i < fields.size(); ++i)
    put_u64(h.data() + kOffConfig + 8 * i, static_cast<std::uint64_t>(fields[i]));
  put_u64(h.data() + kOffRopeTheta, std::bit_cast<std::uint64_t>(c.rope_theta));
  put_u64(h.data() + kOffNormEps, std::bit_cast<std::uint64_t>(c.norm_eps));
  put_u32(h.data() + kOffShared, c.shared_classifier ? 1 : 0);
  put_u64(h.data() + kOffWeightsHash, model.weights_hash);
  put_u64(h.data() + kOffLayers, n_layers);
  put_u64(h.data() + kOffKvHeads, n_kv_heads);
  put_u64(h.data() + kOffHeadSize, head_size);
  put_u64(h.data() + kOffBlockSize, block_size);
  return h;
}

/// Checks a block file's bytes against the header a tier expects (`layout`, from
/// layout_header) and, when `key` is given, the prefix asked for. Returns why the file must be
/// skipped, or nothing when its payload (tokens, keys, values) may be used. Reads only `file`.
inline std::optional<TierSkip> check_block_file(std::span<const unsigned char> file,
                                                std::span<const unsigned char, kHeaderBytes> layout,
                                                std::uint64_t prefix_hash,
                                                std::uint64_t parent_hash,
                                                std::span<const std::int32_t> tokens) {
  if (file.size() < kHeaderBytes) return TierSkip::kTruncated;
  const unsigned char* h = file.data();
  if (std::memcmp(h + kOffMagic, kMagic.data(), kMagic.size()) != 0) return TierSkip::kCorrupt;
  if (get_u32(h + kOffVersion) != kVersion) return TierSkip::kVersion;
  if (get_u32(h + kOffHeaderBytes) != kHeaderBytes ||
      get_u64(h + kOffHeaderHash) != Checksum::hash(h, kOffHeaderHash))
    return TierSkip::kCorrupt;
  if (std::memcmp(h + kOffScalarBytes, layout.data() + kOffScalarBytes, 8) != 0)
    return TierSkip::kElementType;  // element size and byte order
  if (std::memcmp(h + kOffBlockSize, layout.data() + kOffBlockSize, 8) != 0)
    return TierSkip::kBlockSize;
  if (std::memcmp(h + kOffWeightBytes, layout.data() + kOffWeightBytes,
                  kOffBlockSize - kOffWeightBytes) != 0)
    return TierSkip::kModel;  // config, rope, weights hash, and the shape the config implies
  const std::uint64_t block_size = get_u64(layout.data() + kOffBlockSize);
  const std::uint64_t expected_payload =
      4 * block_size + 2 * get_u64(layout.data() + kOffLayers) *
                           get_u64(layout.data() + kOffKvHeads) *
                           get_u64(layout.data() + kOffHeadSize) * block_size *
                           get_u32(layout.data() + kOffScalarBytes);
  if (get_u64(h + kOffPayloadBytes) != expected_payload) return TierSkip::kCorrupt;
  if (file.size() - kHeaderBytes < expected_payload) return TierSkip::kTruncated;
  if (file.size() - kHeaderBytes > expected_payload) return TierSkip::kCorrupt;
  if (get_u64(h + kOffPayloadHash) != Checksum::hash(h + kHeaderBytes, expected_payload))
    return TierSkip::kCorrupt;
  if (get_u64(h + kOffPrefixHash) != prefix_hash || get_u64(h + kOffParentHash) != parent_hash ||
      tokens.size() != block_size ||
      std::memcmp(h + kHeaderBytes, tokens.data(), tokens.size_bytes()) != 0)
    return TierSkip::kMismatch;
  return std::nullopt;
}

inline std::string hex16(std::uint64_t v) {
  std::array<char, 17> s{};
  std::snprintf(s.data(), s.size(), "%016llx", static_cast<unsigned long long>(v));
  return std::string(s.data(), 16);
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace detail::prefix_tier

/// Block files for the prefix cache of one model: see the top of this header.
///
/// A file holds one full block: its token ids and its keys and values for every layer and kv
/// head, with the hash of the prefix it ends and of the prefix before it. A load verifies the
/// file (checksums, format, model, element type, block size) and that it ends the prefix asked
/// for: the same prefix hash, the same parent hash and the same block_size token ids. (In memory
/// the pool also compares parent entries exactly; across a restart the parent prefix is known by
/// its 64-bit hash, so use the pool's full 64 hash bits with a tier.)
template <class T>
class PrefixTier final : public BlockPool<T>::Tier {
 public:
  using Pool = BlockPool<T>;
  using TierKey = typename Pool::TierKey;

  /// Creates the directory if needed and checks that a file can be written in it; throws
  /// Error naming the directory when it cannot.
  PrefixTier(const ModelFingerprint& model, PrefixTierOptions options)
      : model_(model), directory_(std::move(options.directory)), max_bytes_(options.max_bytes) {
    KVDECODE_CHECK(!directory_.empty(), "PrefixTier: the directory must be named");
    std::error_code ec;
    std::filesystem::create_directories(directory_, ec);
    KVDECODE_CHECK(!ec && std::filesystem::is_directory(directory_), "PrefixTier: directory '",
                   directory_.string(), "' cannot be created: ",
                   ec ? ec.message() : std::string("it is not a directory"));
    const std::filesystem::path probe = directory_ / (".probe" + temp_suffix());
    errno = 0;
    bool ok = false;
    if (std::FILE* f = std::fopen(probe.string().c_str(), "wb"); f != nullptr) {
      const bool put = std::fputc('k', f) != EOF;
      ok = std::fclose(f) == 0 && put;
    }
    const int err = errno;
    std::filesystem::remove(probe, ec);
    KVDECODE_CHECK(ok, "PrefixTier: directory '", directory_.string(),
                   "' cannot be written: ", std::generic_category().message(err));
  }
  PrefixTier(const PrefixTier&) = delete;
  PrefixTier& operator=(const PrefixTier&) = delete;
  ~PrefixTier() override { detach(); }

  /// Makes this the pool's tier: checks the pool's shape against the model, lists the
  /// directory's files of this layout (model, element type, block size) from least to most
  /// recently written, and removes the oldest beyond max_bytes. One pool at a time.
  void attach(Pool& pool) {
    const ModelConfig& c = model_.config;
    KVDECODE_CHECK(pool.n_layers() == static_cast<std::size_t>(c.n_layers) &&
                       pool.n_kv_heads() == static_cast<std::size_t>(c.n_kv_heads) &&
                       pool.head_size() == static_cast<std::size_t>(c.head_size()),
                   "PrefixTier: the pool's shape (", pool.n_layers(), " layers, ",
                   pool.n_kv_heads(), " kv heads, head size ", pool.head_size(),
                   ") does not match the model (", c.n_layers, ", ", c.n_kv_heads, ", ",
                   c.head_size(), ")");
    KVDECODE_CHECK(pool.tier() == nullptr || pool.tier() == this,
                   "PrefixTier: the pool already has another tier");
    detach();
    namespace pt = detail::prefix_tier;
    layout_ = pt::layout_header(model_, sizeof(T), pool.n_layers(), pool.n_kv_heads(),
                                pool.head_size(), pool.block_size());
    prefix_ = pt::hex16(Checksum::hash(layout_.data() + pt::kOffScalarBytes,
                                       pt::kLayoutEnd - pt::kOffScalarBytes)) +
              "-";
    run_elems_ = pool.block_size() * pool.head_size();
    file_bytes_ =
        file_bytes_for(pool.n_layers(), pool.n_kv_heads(), pool.head_size(), pool.block_size());
    payload_bytes_ = file_bytes_ - pt::kHeaderBytes;
    buffer_.assign(file_bytes_ + 1, 0);  // one more, to see trailing bytes when reading
    scan();
    make_room(0);
    pool_ = &pool;
    pool.set_tier(this);
  }

  /// Stops serving the pool (its evictions are no longer written). The files stay.
  void detach() noexcept {
    if (pool_ != nullptr && pool_->tier() == this) pool_->set_tier(nullptr);
    pool_ = nullptr;
  }

  const PrefixTierStats& stats() const { return stats_; }
  const std::filesystem::path& directory() const { return directory_; }
  std::uint64_t max_bytes() const { return max_bytes_; }
  /// Bytes of one block file of the attached pool (header + tokens + keys + values).
  std::size_t file_bytes() const { return file_bytes_; }
  /// Bytes of one block file for a pool of this shape, before any pool is attached (a cap
  /// below it keeps nothing): header, block_size int32 tokens, then keys and values.
  static std::size_t file_bytes_for(std::size_t n_layers, std::size_t n_kv_heads,
                                    std::size_t head_size, std::size_t block_size) {
    return detail::prefix_tier::kHeaderBytes + 4 * block_size +
           2 * n_layers * n_kv_heads * block_size * head_size * sizeof(T);
  }
  /// The file that holds the block ending the prefix with this hash (attached only).
  std::filesystem::path file_for(std::uint64_t prefix_hash) const {
    return directory_ / (prefix_ + detail::prefix_tier::hex16(prefix_hash) +
                         std::string(detail::prefix_tier::kExtension));
  }

  // ---------------------------------------------------------------------------------------------
  // BlockPool<T>::Tier: called by the pool on its thread; nothing throws out of them.

  void spill(const Pool& pool, std::size_t b, const TierKey& key) noexcept override {
    try {
      if (const auto it = index_.find(key.hash); it != index_.end()) {
        touch(it->second, key.hash);  // already on disk: the same prefix, or a collision
        return;
      }
      if (file_bytes_ > max_bytes_) {
        ++stats_.write_failures;
        return;
      }
      make_room(file_bytes_);
      write_file(pool, b, key);
      index_.emplace(key.hash, Entry{file_bytes_, 0});
      touch(index_.at(key.hash), key.hash);
      ++stats_.files_written;
      stats_.bytes_on_disk += file_bytes_;
      stats_.files_on_disk = index_.size();
    } catch (...) {  // I/O or memory: the block is simply not kept
      ++stats_.write_failures;
    }
  }

  bool contains(const TierKey& key) noexcept override {
    if (index_.count(key.hash) != 0) return true;
    ++stats_.disk_misses;
    return false;
  }

  bool load(Pool& pool, std::size_t b, const TierKey& key) noexcept override {
    namespace pt = detail::prefix_tier;
    try {
      const auto it = index_.find(key.hash);
      if (it == index_.end()) {
        ++stats_.disk_misses;
        return false;
      }
      const std::filesystem::path path = file_for(key.hash);
      std::size_t n = 0;
      {
        pt::File f(std::fopen(path.string().c_str(), "rb"));
        if (f == nullptr) return skip(TierSkip::kUnreadable, key.hash);
        n = std::fread(buffer_.data(), 1, buffer_.size(), f.get());
        if (std::ferror(f.get()) != 0) return skip(TierSkip::kUnreadable, key.hash);
      }
      const std::span<const unsigned char, pt::kHeaderBytes> layout(layout_);
      if (const auto r = pt::check_block_file({buffer_.data(), n}, layout, key.hash,
                                              key.parent_hash, key.tokens))
        return skip(*r, key.hash);
      // Payload: tokens [block_size] int32, keys then values [n_layers][n_kv_heads][run].
      const unsigned char* p = buffer_.data() + pt::kHeaderBytes + key.tokens.size_bytes();
      for (int kv = 0; kv < 2; ++kv)
        for (std::size_t l = 0; l < pool.n_layers(); ++l)
          for (std::size_t h = 0; h < pool.n_kv_heads(); ++h) {
            T* dst = kv == 0 ? pool.keys(b, l, h) : pool.values(b, l, h);
            std::memcpy(dst, p, run_elems_ * sizeof(T));
            p += run_elems_ * sizeof(T);
          }
      touch(it->second, key.hash);
      // The file's time is its last use, so that a restart lists files in LRU order.
      std::error_code ec;
      std::filesystem::last_write_time(path, std::filesystem::file_time_type::clock::now(), ec);
      ++stats_.disk_hits;
      return true;
    } catch (...) {
      ++stats_.disk_misses;
      return false;
    }
  }

 private:
  struct Entry {
    std::uint64_t bytes = 0;
    std::uint64_t tick = 0;  // last write or use; the smallest is the least recently used
  };

  static std::string temp_suffix() {
#ifdef KVDECODE_CACHE_FILE_HAS_FSYNC
    return detail::concat(".tmp.", static_cast<long long>(::getpid()));
#else
    return ".tmp";
#endif
  }

  void touch(Entry& e, std::uint64_t hash) {
    if (e.tick != 0) lru_.erase(e.tick);
    e.tick = ++clock_;
    lru_.emplace(e.tick, hash);
  }

  /// Removes a file from the index (and the directory); counts the bytes.
  void forget(std::uint64_t hash, bool remove_file) {
    const auto it = index_.find(hash);
    if (it == index_.end()) return;
    if (remove_file) {
      std::error_code ec;
      std::filesystem::remove(file_for(hash), ec);  // already gone is fine
    }
    lru_.erase(it->second.tick);
    stats_.bytes_on_disk -= it->second.bytes;
    index_.erase(it);
    stats_.files_on_disk = index_.size();
  }

  bool skip(TierSkip r, std::uint64_t hash) {
    ++stats_.skipped[static_cast<std::size_t>(r)];
    ++stats_.disk_misses;
    // A mismatch is a valid block of another prefix: kept. Anything else is of no use.
    if (r != TierSkip::kMismatch) forget(hash, true);
    return false;
  }

  /// Evicts least recently used files until `incoming` more bytes fit within max_bytes.
  void make_room(std::uint64_t incoming) {
    while (!lru_.empty() && stats_.bytes_on_disk + incoming > max_bytes_) {
      forget(lru_.begin()->second, true);
      ++stats_.files_evicted;
    }
  }

  /// Lists the directory's files named as this layout's blocks, oldest write first.
  void scan() {
    index_.clear();
    lru_.clear();
    stats_.bytes_on_disk = 0;
    const std::string_view ext = detail::prefix_tier::kExtension;
    const std::size_t name_size = prefix_.size() + 16 + ext.size();
    std::vector<std::pair<std::filesystem::file_time_type, std::uint64_t>> found;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(directory_, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() != name_size || name.compare(0, prefix_.size(), prefix_) != 0 ||
          name.compare(name_size - ext.size(), ext.size(), ext) != 0)
        continue;
      std::uint64_t hash = 0;
      bool hex = true;
      for (std::size_t i = prefix_.size(); i < prefix_.size() + 16; ++i) {
        const char ch = name[i];
        const int d = ch >= '0' && ch <= '9'   ? ch - '0'
                      : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                                               : -1;
        if (d < 0) hex = false;
        hash = (hash << 4) | static_cast<std::uint64_t>(d < 0 ? 0 : d);
      }
      std::error_code fe;
      const std::uint64_t bytes = it->file_size(fe);
      const auto when = it->last_write_time(fe);
      if (!hex || fe || !it->is_regular_file(fe)) continue;
      index_[hash] = Entry{bytes, 0};
      stats_.bytes_on_disk += bytes;
      found.emplace_back(when, hash);
    }
    std::sort(found.begin(), found.end());
    for (const auto& [when, hash] : found) touch(index_.at(hash), hash);
    stats_.files_on_disk = index_.size();
  }

  /// Header + payload into buffer_, to "<file>.tmp.<pid>", then renamed over the file. No fsync:
  /// a file cut short by a power loss is skipped as truncated when read.
  void write_file(const Pool& pool, std::size_t b, const TierKey& key) {
    namespace pt = detail::prefix_tier;
    unsigned char* h = buffer_.data();
    std::memcpy(h, layout_.data(), pt::kHeaderBytes);
    pt::put_u64(h + pt::kOffPrefixHash, key.hash);
    pt::put_u64(h + pt::kOffParentHash, key.parent_hash);
    pt::put_u64(h + pt::kOffPayloadBytes, payload_bytes_);
    unsigned char* p = h + pt::kHeaderBytes;
    std::memcpy(p, key.tokens.data(), key.tokens.size_bytes());
    p += key.tokens.size_bytes();
    for (int kv = 0; kv < 2; ++kv)
      for (std::size_t l = 0; l < pool.n_layers(); ++l)
        for (std::size_t hd = 0; hd < pool.n_kv_heads(); ++hd) {
          const T* src = kv == 0 ? pool.keys(b, l, hd) : pool.values(b, l, hd);
          std::memcpy(p, src, run_elems_ * sizeof(T));
          p += run_elems_ * sizeof(T);
        }
    pt::put_u64(h + pt::kOffPayloadHash, Checksum::hash(h + pt::kHeaderBytes, payload_bytes_));
    pt::put_u64(h + pt::kOffHeaderHash, Checksum::hash(h, pt::kOffHeaderHash));

    const std::filesystem::path file = file_for(key.hash);
    std::filesystem::path tmp = file;
    tmp += temp_suffix();
    bool ok = false;
    {
      pt::File f(std::fopen(tmp.string().c_str(), "wb"));
      ok = f != nullptr && std::fwrite(h, 1, file_bytes_, f.get()) == file_bytes_;
      ok = f != nullptr && std::fclose(f.release()) == 0 && ok;
    }
    std::error_code ec;
    if (ok) std::filesystem::rename(tmp, file, ec);
    if (!ok || ec) {
      std::filesystem::remove(tmp, ec);
      KVDECODE_FAIL("PrefixTier: cannot write '", file.string(), "'");
    }
  }

  ModelFingerprint model_;
  std::filesystem::path directory_;
  std::uint64_t max_bytes_ = 0;
  Pool* pool_ = nullptr;
  std::array<unsigned char, detail::prefix_tier::kHeaderBytes> layout_{};  // the tier's header
  std::string prefix_;                 // "<16 hex digits of the layout hash>-": its files' names
  std::size_t run_elems_ = 0;          // block_size × head_size: one (layer, kv head) of a block
  std::size_t payload_bytes_ = 0;      // tokens + keys + values of one block
  std::size_t file_bytes_ = 0;         // header + payload
  std::vector<unsigned char> buffer_;  // [file_bytes + 1] one file being written or read
  std::unordered_map<std::uint64_t, Entry> index_;  // prefix hash → file on disk
  std::map<std::uint64_t, std::uint64_t> lru_;      // tick → prefix hash, oldest first
  std::uint64_t clock_ = 0;
  PrefixTierStats stats_;
};

}  // namespace kvdecode
