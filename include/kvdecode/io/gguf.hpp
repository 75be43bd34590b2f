// GgufFile: a reader of the GGUF container (v2 and v3, little-endian), as ggml's docs/gguf.md
// describes it: header, metadata key/values, tensor infos, aligned tensor data. The file is mapped,
// not copied; every count, length and offset is checked against GgufLimits and the file size
// before anything is allocated or read. The format is in docs/FORMATS.md §5.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/io/mapped_file.hpp"

namespace kvdecode {

/// The metadata value types of GGUF (gguf.md "gguf_metadata_value_type").
enum class GgufValueType : std::uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

/// The ggml tensor types this reader knows the layout of; any other type id is refused by name.
enum class GgmlType : std::uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,  ///< blocks of 32: f16 d, 16 bytes of 4-bit codes (x = (q - 8) * d)
  kQ8_0 = 8,  ///< blocks of 32: f16 d, 32 int8 codes (x = q * d)
  kBf16 = 30,
};

/// Caps what a GGUF header may ask for, checked before any allocation: a corrupt or hostile
/// file fails with an Error instead of a huge allocation or a long loop.
struct GgufLimits {
  std::uint64_t max_tensors = std::uint64_t{1} << 16;
  std::uint64_t max_kv = std::uint64_t{1} << 16;
  std::uint64_t max_string_bytes = std::uint64_t{1} << 20;  ///< a key, a name or a string value
  std::uint64_t max_array_length = std::uint64_t{1} << 24;  ///< elements of one array value
  std::uint64_t max_dim = std::uint64_t{1} << 32;           ///< one tensor dimension
  std::uint64_t max_alignment = std::uint64_t{1} << 20;     ///< general.alignment
};

/// One metadata value. Strings and arrays are views into the file's bytes.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  GgufValueType element_type = GgufValueType::kUint8;  ///< arrays only
  std::uint64_t offset = 0;  ///< byte offset of the value (of an array's first element)
  std::uint64_t count = 1;   ///< elements of an array; 1 for a scalar
  std::uint64_t u = 0;       ///< unsigned integers and bool
  std::int64_t i = 0;        ///< signed integers
  double f = 0;              ///< floats
  std::string_view str;      ///< a string
  std::vector<std::string_view> strings;  ///< [count]: a string array's elements
  std::span<const std::byte> raw;         ///< a numeric array's little-endian elements

  bool is_integer() const;
  bool is_float() const {
    return type == GgufValueType::kFloat32 || type == GgufValueType::kFloat64;
  }
  /// Element k < count of a numeric array as double (exact but for 64-bit integers > 2^53).
  double number_at(std::uint64_t k) const;
};

struct GgufKeyValue {
  std::string_view key;
  GgufValue value;
  std::uint64_t offset = 0;  ///< byte offset of the key
};

/// One tensor info. dims are ggml's ne: dims[0] is the innermost (contiguous) dimension, so a
/// row-major [out][in] matrix has dims {in, out}.
struct GgufTensorInfo {
  std::string_view name;
  std::uint32_t n_dims = 0;
  std::array<std::uint64_t, 4> dims{1, 1, 1, 1};
  GgmlType type = GgmlType::kF32;
  std::uint64_t offset = 0;       ///< from the start of the data section
  std::uint64_t info_offset = 0;  ///< byte offset of this tensor info in the file
  std::uint64_t elements = 0;
  std::uint64_t bytes = 0;
  std::span<const std::byte> data;  ///< [bytes]: the tensor as stored, in the mapping
};

namespace detail::gguf {

inline constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
inline constexpr std::uint64_t kDefaultAlignment = 32;
inline constexpr std::uint64_t kMaxNameBytes = 64;  // gguf.md: a tensor name is at most 64 bytes
inline constexpr std::uint32_t kMaxDims = 4;

inline const char* value_type_name(std::uint32_t t) {
  constexpr std::array<const char*, 13> kNames = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                                  "int32",  "float32", "bool",   "string", "array",
                                                  "uint64", "int64",   "float64"};
  return t < kNames.size() ? kNames[t] : "unknown";
}

inline std::uint64_t scalar_bytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

/// The ggml name of a type id (ggml.h's enum ggml_type), known to the reader or not.
inline std::string ggml_type_name(std::uint32_t t) {
  constexpr std::array<const char*, 40> kNames = {"f32",
                                                  "f16",
                                                  "q4_0",
                                                  "q4_1",
                                                  "q4_2 (removed)",
                                                  "q4_3 (removed)",
                                                  "q5_0",
                                                  "q5_1",
                                                  "q8_0",
                                                  "q8_1",
                                                  "q2_K",
                                                  "q3_K",
                                                  "q4_K",
                                                  "q5_K",
                                                  "q6_K",
                                                  "q8_K",
                                                  "iq2_xxs",
                                                  "iq2_xs",
                                                  "iq3_xxs",
                                                  "iq1_s",
                                                  "iq4_nl",
                                                  "iq3_s",
                                                  "iq2_s",
                                                  "iq4_xs",
                                                  "i8",
                                                  "i16",
                                                  "i32",
                                                  "i64",
                                                  "f64",
                                                  "iq1_m",
                                                  "bf16",
                                                  "q4_0_4_4 (removed)",
                                                  "q4_0_4_8 (removed)",
                                                  "q4_0_8_8 (removed)",
                                                  "tq1_0",
                                                  "tq2_0",
                                                  "iq4_nl_4_4 (removed)",
                                                  "iq4_nl_4_8 (removed)",
                                                  "iq4_nl_8_8 (removed)",
                                                  "mxfp4"};
  return t < kNames.size() ? std::string(kNames[t]) : concat("type ", t);
}

/// Elements per block and bytes per block of a type the reader knows; {0, 0} for any other.
struct BlockLayout {
  std::uint64_t elements = 0;
  std::uint64_t bytes = 0;
};
inline BlockLayout block_layout(std::uint32_t t) {
  switch (static_cast<GgmlType>(t)) {
    case GgmlType::kF32:
      return {1, 4};
    case GgmlType::kF16:
    case GgmlType::kBf16:
      return {1, 2};
    case GgmlType::kQ8_0:
      return {32, 34};
    case GgmlType::kQ4_0:
      return {32, 18};
  }
  return {};
}

inline std::uint16_t load_u16(const std::byte* p) {
  return static_cast<std::uint16_t>(static_cast<unsigned>(p[0]) |
                                    (static_cast<unsigned>(p[1]) << 8));
}
inline std::uint32_t load_u32(const std::byte* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline std::uint64_t load_u64(const std::byte* p) {
  return std::uint64_t{load_u32(p)} | (std::uint64_t{load_u32(p + 4)} << 32);
}

/// IEEE binary16 to float, exactly (every half is a float), written out so no ISA is assumed.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1Fu;
  std::uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0)
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24.
  const float magnitude = static_cast<float>(mantissa) * 0x1.0p-24f;
  return sign != 0 ? -magnitude : magnitude;
}

inline std::uint64_t align_up(std::uint64_t x, std::uint64_t alignment, bool& overflow) {
  const std::uint64_t rem = x % alignment;
  if (rem == 0) return x;
  if (x > std::numeric_limits<std::uint64_t>::max() - (alignment - rem)) overflow = true;
  return x + (alignment - rem);
}

/// A bounds-checked cursor over the file's bytes; every failed read names what and where.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, const std::string& ctx) : bytes_(bytes), ctx_(ctx) {}

  std::uint64_t pos() const { return pos_; }
  std::uint64_t remaining() const { return bytes_.size() - pos_; }
  const std::byte* at(std::uint64_t offset) const { return bytes_.data() + offset; }

  void need(std::uint64_t n, std::string_view what) const {
    KVDECODE_CHECK(remaining() >= n, ctx_, ": file ends at byte ", bytes_.size(), " while reading ",
                   what, " at byte ", pos_, " (needs ", n, " bytes, ", remaining(), " left)");
  }
  std::uint32_t u32(std::string_view what) {
    need(4, what);
    const std::uint32_t v = load_u32(at(pos_));
    pos_ += 4;
    return v;
  }
  std::uint64_t u64(std::string_view what) {
    need(8, what);
    const std::uint64_t v = load_u64(at(pos_));
    pos_ += 8;
    return v;
  }
  std::span<const std::byte> take(std::uint64_t n, std::string_view what) {
    need(n, what);
    const auto s = bytes_.subspan(static_cast<std::size_t>(pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }
  /// A gguf_string: u64 length, then that many bytes (not NUL-terminated).
  std::string_view string(std::string_view what, std::uint64_t max_bytes, const char* limit_name) {
    const std::uint64_t start = pos_;
    const std::uint64_t n = u64(what);
    KVDECODE_CHECK(n <= max_bytes, ctx_, ": ", what, " at byte ", start, " has length ", n,
                   ", more than GgufLimits::", limit_name, " = ", max_bytes);
    const auto s = take(n, what);
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }

 private:
  std::span<const std::byte> bytes_;
  const std::string& ctx_;
  std::uint64_t pos_ = 0;
};

}  // namespace detail::gguf

inline bool GgufValue::is_integer() const {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

inline double GgufValue::number_at(std::uint64_t k) const {
  namespace gg = detail::gguf;
  const std::byte* p = raw.data() + k * gg::scalar_bytes(element_type);
  switch (element_type) {
    case GgufValueType::kUint8:
    case GgufValueType::kBool:
      return static_cast<double>(static_cast<unsigned char>(*p));
    case GgufValueType::kInt8:
      return static_cast<double>(static_cast<std::int8_t>(*p));
    case GgufValueType::kUint16:
      return static_cast<double>(gg::load_u16(p));
    case GgufValueType::kInt16:
      return static_cast<double>(static_cast<std::int16_t>(gg::load_u16(p)));
    case GgufValueType::kUint32:
      return static_cast<double>(gg::load_u32(p));
    case GgufValueType::kInt32:
      return static_cast<double>(static_cast<std::int32_t>(gg::load_u32(p)));
    case GgufValueType::kFloat32:
      return static_cast<double>(std::bit_cast<float>(gg::load_u32(p)));
    case GgufValueType::kUint64:
      return static_cast<double>(gg::load_u64(p));
    case GgufValueType::kInt64:
      return static_cast<double>(static_cast<std::int64_t>(gg::load_u64(p)));
    case GgufValueType::kFloat64:
      return std::bit_cast<double>(gg::load_u64(p));
    case GgufValueType::kString:
    case GgufValueType::kArray:
      break;
  }
  return 0;
}

/// A parsed GGUF file: its metadata and tensor infos, with views of the mapped bytes. Move-only
/// (the mapping moves with it, and the views stay valid). Immutable after opening.
class GgufFile {
 public:
  /// Maps and parses `file`. Throws Error naming the file, the byte offset and expected vs
  /// actual when: it is not GGUF (magic), is big-endian GGUF or a version other than 2 or 3;
  /// a count, length or dimension exceeds `limits`; a value type, bool or tensor type is
  /// invalid; a key or tensor name repeats; general.alignment is not a power of two; a tensor's
  /// row is not whole blocks, its offset is unaligned, or its data overlaps another tensor or
  /// passes the end of the file (all sums checked for 64-bit overflow).
  static GgufFile open(const std::filesystem::path& file, const GgufLimits& limits = {}) {
    MappedFile mapped(file, "gguf");
    GgufFile g = parse(mapped.bytes(), file.string(), limits);
    g.mapped_ = std::move(mapped);
    return g;
  }

  /// Parses bytes the caller keeps alive as long as the result (see open() for the checks);
  /// `name` labels the error messages.
  static GgufFile parse(std::span<const std::byte> bytes, std::string_view name,
                        const GgufLimits& limits = {}) {
    GgufFile g;
    g.name_ = std::string(name);
    g.parse_all(bytes, limits);
    return g;
  }

  /// Whether `bytes` start with the GGUF magic.
  static bool has_magic(std::span<const std::byte> bytes) {
    return bytes.size() >= 4 && detail::gguf::load_u32(bytes.data()) == detail::gguf::kMagic;
  }

  const std::string& name() const { return name_; }
  /// "gguf '<name>'": the prefix of every error about this file.
  std::string context() const { return detail::concat("gguf '", name_, "'"); }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  std::uint64_t data_offset() const { return data_offset_; }
  std::uint64_t file_bytes() const { return file_bytes_; }
  const std::vector<GgufKeyValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(std::string_view key) const {
    for (const GgufKeyValue& kv : kv_)
      if (kv.key == key) return &kv.value;
    return nullptr;
  }
  const GgufTensorInfo* find_tensor(std::string_view name) const {
    for (const GgufTensorInfo& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

  /// The value of an integer key (any integer type), checked to lie in [lo, hi].
  std::int64_t get_int(std::string_view key, std::int64_t lo, std::int64_t hi) const {
    const GgufValue& v = get(key);
    KVDECODE_CHECK(v.is_integer(), context(), ": metadata key '", key, "' (value at byte ",
                   v.offset, ") has type ", type_label(v), ", expected an integer");
    const bool fits =
        v.type == GgufValueType::kUint64 || v.type == GgufValueType::kUint32 ||
                v.type == GgufValueType::kUint16 || v.type == GgufValueType::kUint8
            ? v.u <= static_cast<std::uint64_t>(hi) && static_cast<std::int64_t>(v.u) >= lo
            : v.i >= lo && v.i <= hi;
    const std::string shown =
        v.type == GgufValueType::kUint64 ? std::to_string(v.u) : std::to_string(v.i);
    KVDECODE_CHECK(fits, context(), ": metadata key '", key, "' (value at byte ", v.offset, ") is ",
                   shown, ", expected a value in [", lo, ", ", hi, "]");
    return v.type == GgufValueType::kUint64 ? static_cast<std::int64_t>(v.u) : v.i;
  }
  /// The value of a float32 or float64 key.
  double get_float(std::string_view key) const {
    const GgufValue& v = get(key);
    KVDECODE_CHECK(v.is_float(), context(), ": metadata key '", key, "' (value at byte ", v.offset,
                   ") has type ", type_label(v), ", expected float32 or float64");
    return v.f;
  }
  std::string_view get_string(std::string_view key) const {
    const GgufValue& v = get(key);
    KVDECODE_CHECK(v.type == GgufValueType::kString, context(), ": metadata key '", key,
                   "' (value at byte ", v.offset, ") has type ", type_label(v),
                   ", expected string");
    return v.str;
  }
  bool get_bool(std::string_view key) const {
    const GgufValue& v = get(key);
    KVDECODE_CHECK(v.type == GgufValueType::kBool, context(), ": metadata key '", key,
                   "' (value at byte ", v.offset, ") has type ", type_label(v), ", expected bool");
    return v.u != 0;
  }
  /// The value of `key`; throws Error naming the key when the file lacks it.
  const GgufValue& get(std::string_view key) const {
    const GgufValue* v = find(key);
    KVDECODE_CHECK(v != nullptr, context(), ": metadata key '", key, "' is missing");
    return *v;
  }

  /// "uint32", "string", "array of float32", ...
  static std::string type_label(const GgufValue& v) {
    namespace gg = detail::gguf;
    if (v.type != GgufValueType::kArray)
      return gg::value_type_name(static_cast<std::uint32_t>(v.type));
    return detail::concat("array of ",
                          gg::value_type_name(static_cast<std::uint32_t>(v.element_type)));
  }

 private:
  GgufFile() = default;

  void parse_all(std::span<const std::byte> bytes, const GgufLimits& limits) {
    namespace gg = detail::gguf;
    const std::string ctx = context();
    file_bytes_ = bytes.size();
    gg::Cursor c(bytes, ctx);
    c.need(4, "the magic");
    const std::uint32_t magic = gg::load_u32(bytes.data());
    KVDECODE_CHECK(magic != 0x47475546u, ctx,
                   ": is big-endian GGUF (magic bytes 'FUGG'); only little-endian files are read");
    KVDECODE_CHECK(magic == gg::kMagic, ctx, ": magic at byte 0 is 0x", hex32(magic),
                   ", expected 0x46554747 ('GGUF')");
    c.u32("the magic");
    version_ = c.u32("the version");
    // v1 stored the counts and lengths as u32; v2 made them u64 and v3 only allowed big-endian
    // files, so v2 and v3 read alike.
    KVDECODE_CHECK(version_ == 2 || version_ == 3, ctx, ": version at byte 4 is ", version_,
                   ", expected 2 or 3");
    const std::uint64_t n_tensors = c.u64("the tensor count");
    const std::uint64_t n_kv = c.u64("the metadata key/value count");
    KVDECODE_CHECK(n_tensors <= limits.max_tensors, ctx, ": tensor count at byte 8 is ", n_tensors,
                   ", more than GgufLimits::max_tensors = ", limits.max_tensors);
    KVDECODE_CHECK(n_kv <= limits.max_kv, ctx, ": metadata key/value count at byte 16 is ", n_kv,
                   ", more than GgufLimits::max_kv = ", limits.max_kv);
    // Each key/value takes >= 13 bytes and each tensor info >= 28, so these bounds keep a lying
    // count from reserving more than the file could describe.
    kv_.reserve(static_cast<std::size_t>(std::min(n_kv, c.remaining() / 13)));
    std::unordered_set<std::string_view> keys;
    for (std::uint64_t k = 0; k < n_kv; ++k) {
      GgufKeyValue kv;
      kv.offset = c.pos();
      kv.key = c.string(detail::concat("the key of metadata entry ", k), limits.max_string_bytes,
                        "max_string_bytes");
      KVDECODE_CHECK(!kv.key.empty(), ctx, ": metadata entry ", k, " at byte ", kv.offset,
                     " has an empty key");
      KVDECODE_CHECK(keys.insert(kv.key).second, ctx, ": metadata key '", kv.key, "' at byte ",
                     kv.offset, " appears twice");
      const std::uint64_t type_at = c.pos();
      const std::uint32_t type = c.u32(detail::concat("the value type of '", kv.key, "'"));
      KVDECODE_CHECK(type <= 12, ctx, ": metadata key '", kv.key, "': value type at byte ", type_at,
                     " is ", type, ", expected 0..12");
      kv.value.type = static_cast<GgufValueType>(type);
      read_value(c, kv.key, kv.value, limits);
      kv_.push_back(std::move(kv));
    }

    alignment_ = gg::kDefaultAlignment;
    if (const GgufValue* a = find("general.alignment")) {
      KVDECODE_CHECK(a->type == GgufValueType::kUint32, ctx,
                     ": metadata key 'general.alignment' (value at byte ", a->offset, ") has type ",
                     type_label(*a), ", expected uint32");
      KVDECODE_CHECK(
          a->u != 0 && std::has_single_bit(a->u) && a->u <= limits.max_alignment, ctx,
          ": general.alignment (value at byte ", a->offset, ") is ", a->u,
          ", expected a power of two <= GgufLimits::max_alignment = ", limits.max_alignment);
      alignment_ = a->u;
    }

    tensors_.reserve(static_cast<std::size_t>(std::min(n_tensors, c.remaining() / 28)));
    std::unordered_set<std::string_view> names;
    for (std::uint64_t k = 0; k < n_tensors; ++k) {
      GgufTensorInfo t;
      t.info_offset = c.pos();
      t.name = c.string(detail::concat("the name of tensor info ", k), limits.max_string_bytes,
                        "max_string_bytes");
      const std::string label =
          detail::concat("tensor '", t.name, "' (info at byte ", t.info_offset, ")");
      KVDECODE_CHECK(!t.name.empty() && t.name.size() <= gg::kMaxNameBytes, ctx, ": ", label,
                     ": name is ", t.name.size(), " bytes, expected 1..", gg::kMaxNameBytes);
      KVDECODE_CHECK(names.insert(t.name).second, ctx, ": ", label, " repeats a tensor name");
      const std::uint64_t dims_at = c.pos();
      t.n_dims = c.u32(detail::concat("n_dims of ", label));
      KVDECODE_CHECK(t.n_dims >= 1 && t.n_dims <= gg::kMaxDims, ctx, ": ", label,
                     ": n_dims at byte ", dims_at, " is ", t.n_dims, ", expected 1..",
                     gg::kMaxDims);
      bool overflow = false;
      t.elements = 1;
      for (std::uint32_t d = 0; d < t.n_dims; ++d) {
        const std::uint64_t at = c.pos();
        t.dims[d] = c.u64(detail::concat("dimension ", d, " of ", label));
        KVDECODE_CHECK(t.dims[d] >= 1 && t.dims[d] <= limits.max_dim, ctx, ": ", label,
                       ": dimension ", d, " at byte ", at, " is ", t.dims[d],
                       ", expected 1..GgufLimits::max_dim = ", limits.max_dim);
        if (t.elements > std::numeric_limits<std::uint64_t>::max() / t.dims[d]) overflow = true;
        t.elements *= t.dims[d];
      }
      KVDECODE_CHECK(!overflow, ctx, ": ", label, ": its element count overflows 64 bits");
      const std::uint64_t type_at = c.pos();
      const std::uint32_t type = c.u32(detail::concat("the type of ", label));
      const gg::BlockLayout layout = gg::block_layout(type);
      KVDECODE_CHECK(layout.elements != 0, ctx, ": ", label, ": ggml type ", type, " (",
                     gg::ggml_type_name(type), ") at byte ", type_at,
                     " is not supported; expected f32, f16, bf16, q8_0 or q4_0");
      t.type = static_cast<GgmlType>(type);
      KVDECODE_CHECK(t.dims[0] % layout.elements == 0, ctx, ": ", label,
                     ": row length dims[0] = ", t.dims[0], " is not a multiple of the ",
                     gg::ggml_type_name(type), " block size ", layout.elements);
      // elements / block elements * block bytes: no overflow as block bytes <= 2 * elements.
      t.bytes = t.elements / layout.elements * layout.bytes;
      KVDECODE_CHECK(
          t.elements / layout.elements <= std::numeric_limits<std::uint64_t>::max() / layout.bytes,
          ctx, ": ", label, ": its byte size overflows 64 bits");
      const std::uint64_t offset_at = c.pos();
      t.offset = c.u64(detail::concat("the data offset of ", label));
      KVDECODE_CHECK(t.offset % alignment_ == 0, ctx, ": ", label, ": data offset ", t.offset,
                     " at byte ", offset_at, " is not a multiple of the alignment ", alignment_);
      tensors_.push_back(t);
    }

    bool overflow = false;
    data_offset_ = gg::align_up(c.pos(), alignment_, overflow);
    KVDECODE_CHECK(!overflow, ctx, ": the data section's offset overflows 64 bits");
    // A file without tensors may end right after its metadata, unpadded (vocabulary files do).
    KVDECODE_CHECK(tensors_.empty() || data_offset_ <= file_bytes_, ctx,
                   ": the data section starts at byte ", data_offset_, " (after ", c.pos(),
                   " bytes of header, aligned to ", alignment_, "), past the end of the ",
                   file_bytes_, "-byte file");
    for (GgufTensorInfo& t : tensors_) {
      const std::uint64_t data_bytes = file_bytes_ - data_offset_;
      KVDECODE_CHECK(t.offset <= data_bytes && t.bytes <= data_bytes - t.offset, ctx, ": tensor '",
                     t.name, "' (info at byte ", t.info_offset, ", ",
                     gg::ggml_type_name(static_cast<std::uint32_t>(t.type)), ", ", t.elements,
                     " elements) needs bytes [", t.offset, ", ", t.offset, " + ", t.bytes,
                     ") of the data section, which holds ", data_bytes, " bytes (file of ",
                     file_bytes_, " bytes, data from byte ", data_offset_, ")");
      t.data = bytes.subspan(static_cast<std::size_t>(data_offset_ + t.offset),
                             static_cast<std::size_t>(t.bytes));
    }
    // Overlapping tensors mean a damaged offset table: each byte belongs to one tensor.
    std::vector<const GgufTensorInfo*> by_offset;
    by_offset.reserve(tensors_.size());
    for (const GgufTensorInfo& t : tensors_) by_offset.push_back(&t);
    std::sort(
        by_offset.begin(), by_offset.end(),
        [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (std::size_t k = 1; k < by_offset.size(); ++k) {
      const GgufTensorInfo& a = *by_offset[k - 1];
      const GgufTensorInfo& b = *by_offset[k];
      KVDECODE_CHECK(a.offset + a.bytes <= b.offset, ctx, ": tensor '", b.name, "' (info at byte ",
                     b.info_offset, ") starts at data offset ", b.offset, ", inside tensor '",
                     a.name, "' [", a.offset, ", ", a.offset + a.bytes, ")");
    }
  }

  void read_value(detail::gguf::Cursor& c, std::string_view key, GgufValue& v,
                  const GgufLimits& limits) {
    namespace gg = detail::gguf;
    const std::string ctx = context();
    v.offset = c.pos();
    const std::string what = detail::concat("the value of '", key, "'");
    if (v.type == GgufValueType::kString) {
      v.str = c.string(what, limits.max_string_bytes, "max_string_bytes");
      return;
    }
    if (v.type == GgufValueType::kArray) {
      const std::uint32_t et = c.u32(detail::concat("the element type of '", key, "'"));
      KVDECODE_CHECK(et <= 12 && et != static_cast<std::uint32_t>(GgufValueType::kArray), ctx,
                     ": metadata key '", key, "': array element type at byte ", v.offset, " is ",
                     et, " (", gg::value_type_name(et),
                     "), expected a scalar or string type (0..8, 10..12)");
      v.element_type = static_cast<GgufValueType>(et);
      const std::uint64_t count_at = c.pos();
      v.count = c.u64(detail::concat("the array length of '", key, "'"));
      KVDECODE_CHECK(v.count <= limits.max_array_length, ctx, ": metadata key '", key,
                     "': array length at byte ", count_at, " is ", v.count,
                     ", more than GgufLimits::max_array_length = ", limits.max_array_length);
      v.offset = c.pos();
      if (v.element_type == GgufValueType::kString) {
        // Each string takes >= 8 bytes: the length check comes before the reservation.
        KVDECODE_CHECK(v.count <= c.remaining() / 8, ctx, ": metadata key '", key, "': ", v.count,
                       " strings (each >= 8 bytes) at byte ", v.offset, " cannot fit in the ",
                       c.remaining(), " bytes left in the file");
        v.strings.reserve(static_cast<std::size_t>(v.count));
        for (std::uint64_t k = 0; k < v.count; ++k)
          v.strings.push_back(c.string(detail::concat("string ", k, " of '", key, "'"),
                                       limits.max_string_bytes, "max_string_bytes"));
        return;
      }
      const std::uint64_t size = gg::scalar_bytes(v.element_type);
      KVDECODE_CHECK(v.count <= c.remaining() / size, ctx, ": metadata key '", key, "': ", v.count,
                     " ", gg::value_type_name(et), " values at byte ", v.offset,
                     " need more than the ", c.remaining(), " bytes left in the file");
      v.raw = c.take(size * v.count, detail::concat("the ", v.count, " ", gg::value_type_name(et),
                                                    " of '", key, "'"));
      if (v.element_type == GgufValueType::kBool) {
        for (std::uint64_t k = 0; k < v.count; ++k) {
          const auto b = static_cast<unsigned>(v.raw[static_cast<std::size_t>(k)]);
          KVDECODE_CHECK(b <= 1, ctx, ": metadata key '", key, "': bool element ", k, " at byte ",
                         v.offset + k, " is ", b, ", expected 0 or 1");
        }
      }
      return;
    }
    const std::uint64_t size = gg::scalar_bytes(v.type);
    const auto s = c.take(size, what);
    std::uint64_t bits = 0;
    for (std::uint64_t k = 0; k < size; ++k)
      bits |= std::uint64_t{static_cast<unsigned char>(s[static_cast<std::size_t>(k)])} << (8 * k);
    switch (v.type) {
      case GgufValueType::kUint8:
      case GgufValueType::kUint16:
      case GgufValueType::kUint32:
      case GgufValueType::kUint64:
        v.u = bits;
        v.i = static_cast<std::int64_t>(bits);
        break;
      case GgufValueType::kInt8:
        v.i = static_cast<std::int8_t>(bits);
        break;
      case GgufValueType::kInt16:
        v.i = static_cast<std::int16_t>(bits);
        break;
      case GgufValueType::kInt32:
        v.i = static_cast<std::int32_t>(bits);
        break;
      case GgufValueType::kInt64:
        v.i = static_cast<std::int64_t>(bits);
        break;
      case GgufValueType::kFloat32:
        v.f = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
        break;
      case GgufValueType::kFloat64:
        v.f = std::bit_cast<double>(bits);
        break;
      case GgufValueType::kBool:
        KVDECODE_CHECK(bits <= 1, ctx, ": metadata key '", key, "': bool at byte ", v.offset,
                       " is ", bits, ", expected 0 or 1");
        v.u = bits;
        break;
      case GgufValueType::kString:
      case GgufValueType::kArray:
        break;
    }
  }

  static std::string hex32(std::uint32_t v) {
    constexpr char kDigits[] = "0123456789abcdef";
    std::string s(8, '0');
    for (int k = 7; k >= 0; --k, v >>= 4) s[static_cast<std::size_t>(k)] = kDigits[v & 15];
    return s;
  }

  MappedFile mapped_;  // the file's bytes when opened from a path; the views below point into it
  std::string name_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = detail::gguf::kDefaultAlignment;
  std::uint64_t data_offset_ = 0;
  std::uint64_t file_bytes_ = 0;
  std::vector<GgufKeyValue> kv_;         // [n_kv]: in file order
  std::vector<GgufTensorInfo> tensors_;  // [n_tensors]: in file order
};

}  // namespace kvdecode
