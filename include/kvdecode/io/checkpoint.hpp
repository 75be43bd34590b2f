// Reading and writing llama2.c legacy "v0" checkpoints (the only format run.c reads): a 28-byte
// header of 7 int32, then f32 tensors in a fixed order. Every header value and the file size are
// checked before anything is allocated; the format is in docs/FORMATS.md §2.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/weights.hpp"

namespace kvdecode {

// The file holds IEEE binary32 little-endian values; a big-endian host swaps bytes on the way.
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4,
              "checkpoint I/O needs IEEE-754 binary32 float");
static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "checkpoint I/O supports little- and big-endian hosts only");

/// Size of the v0 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len.
inline constexpr std::uint64_t kCheckpointHeaderBytes = 28;

/// Caps what a checkpoint header may ask for, so that a corrupt or hostile header fails with an
/// Error instead of an enormous allocation.
struct CheckpointLimits {
  /// Most bytes of tensor storage a load may allocate (the weights, not the skipped freq_cis
  /// block). 32 GiB by default: above every llama2.c-sized model, below a typical machine's RAM.
  std::uint64_t max_bytes = std::uint64_t{32} << 30;
};

/// What a v0 header describes, after every check read_checkpoint_header() makes.
struct CheckpointHeader {
  ModelConfig config;  ///< vocab_size = |header vocab_size|; shared_classifier = (it was > 0)
  std::array<std::int32_t, 7> fields{};   ///< the header as stored, in file order
  std::uint64_t weight_bytes = 0;         ///< tensor storage a load allocates (f32, no freq_cis)
  std::uint64_t freq_cis_offset = 0;      ///< byte offset of the legacy freq_cis block (skipped)
  std::uint64_t freq_cis_bytes = 0;       ///< its size: 2 tables of [seq_len][head_size/2] f32
  std::uint64_t file_bytes_expected = 0;  ///< header + tensors; the file's size equals it
};

namespace detail::checkpoint {

inline constexpr std::array<const char*, 7> kFieldNames = {
    "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};

// llama2.c's newer export formats (v1/v2) start with this magic ("ak42"); run.c cannot read them.
inline constexpr std::int32_t kExportMagic = 0x616b3432;

// The legacy export wrote RoPE tables for this theta; v0 stores neither theta nor eps, so run.c
// hard-codes both and so must we.
inline constexpr double kTheta = 10000.0;
inline constexpr double kNormEps = 1e-5;

// Bytes per ifstream read/write call: bounds std::streamsize and the big-endian staging buffer.
inline constexpr std::uint64_t kChunkBytes = std::uint64_t{1} << 26;

inline std::string context(const std::filesystem::path& file) {
  return concat("checkpoint '", file.string(), "'");
}

inline std::string describe(const std::array<std::int32_t, 7>& f) {
  std::string s;
  for (std::size_t i = 0; i < f.size(); ++i)
    s += concat(i == 0 ? "" : " ", kFieldNames[i], "=", f[i]);
  return s;
}

inline std::string tensor_label(const char* name, std::int64_t layer) {
  return layer < 0 ? std::string(name) : concat(name, "[layer ", layer, "]");
}

// Error::what() is "kvdecode: <message> [file:line]"; strip the prefix before nesting it.
inline std::string_view inner_message(const Error& e) {
  std::string_view m = e.what();
  constexpr std::string_view kPrefix = "kvdecode: ";
  if (m.substr(0, kPrefix.size()) == kPrefix) m.remove_prefix(kPrefix.size());
  return m;
}

inline std::uint32_t byteswap32(std::uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0x0000FF00u) | ((v << 8) & 0x00FF0000u) | (v << 24);
}

inline std::int32_t load_i32_le(const unsigned char* p) {
  const std::uint32_t u = std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) |
                          (std::uint32_t{p[2]} << 16) | (std::uint32_t{p[3]} << 24);
  return static_cast<std::int32_t>(u);
}

inline void store_i32_le(unsigned char* p, std::int32_t v) {
  const auto u = static_cast<std::uint32_t>(v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}

// Element count of one tensor (one layer's slice for per-layer tensors) by its checkpoint name.
inline std::uint64_t tensor_elements(const ModelConfig& cfg, std::string_view name) {
  const auto dim = static_cast<std::uint64_t>(cfg.dim);
  const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
  const auto kv_dim = static_cast<std::uint64_t>(cfg.kv_dim());
  const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
  if (name == "token_embedding_table" || name == "wcls") return vocab * dim;
  if (name == "rms_att_weight" || name == "rms_ffn_weight" || name == "rms_final_weight")
    return dim;
  if (name == "wq" || name == "wo") return dim * dim;
  if (name == "wk" || name == "wv") return kv_dim * dim;
  if (name == "w1" || name == "w2" || name == "w3") return hidden * dim;
  KVDECODE_FAIL("checkpoint: unknown tensor name '", name, "'");
}

// The checked header for the 7 stored fields and the file's actual size; throws naming the field.
inline CheckpointHeader parse_header(const std::array<std::int32_t, 7>& f, std::uint64_t file_size,
                                     const std::filesystem::path& file,
                                     const CheckpointLimits& limits) {
  const std::string ctx = context(file);
  KVDECODE_CHECK(f[0] != kExportMagic, ctx,
                 ": starts with the magic 0x616b3432 ('ak42') of llama2.c's v1/v2 export format; "
                 "only the legacy v0 format (run.c's) is supported");
  for (std::size_t i = 0; i < f.size(); ++i) {
    if (i == 5) continue;  // vocab_size: its sign is a flag, checked below
    KVDECODE_CHECK(f[i] > 0, ctx, ": header field ", kFieldNames[i], " (int32 #", i, " at byte ",
                   4 * i, ") must be positive, got ", f[i]);
  }
  const std::int32_t raw_vocab = f[5];
  KVDECODE_CHECK(raw_vocab != 0, ctx,
                 ": header field vocab_size (int32 #5 at byte 20) must be nonzero (its sign is "
                 "the shared-classifier flag), got 0");
  KVDECODE_CHECK(raw_vocab != std::numeric_limits<std::int32_t>::min(), ctx,
                 ": header field vocab_size (int32 #5 at byte 20) is ", raw_vocab,
                 ", whose magnitude does not fit int32");
  const std::int32_t dim = f[0];
  const std::int32_t n_heads = f[3];
  const std::int32_t n_kv_heads = f[4];
  KVDECODE_CHECK(dim % n_heads == 0, ctx, ": header dim (", dim, ") must be divisible by n_heads (",
                 n_heads, ")");
  KVDECODE_CHECK(n_heads % n_kv_heads == 0, ctx, ": header n_heads (", n_heads,
                 ") must be a multiple of n_kv_heads (", n_kv_heads, ")");
  KVDECODE_CHECK((dim / n_heads) % 2 == 0, ctx, ": header head_size = dim / n_heads = ", dim, " / ",
                 n_heads, " = ", dim / n_heads, " must be even (RoPE rotates pairs)");

  CheckpointHeader h;
  h.fields = f;
  ModelConfig& cfg = h.config;
  cfg.dim = f[0];
  cfg.hidden_dim = f[1];
  cfg.n_layers = f[2];
  cfg.n_heads = f[3];
  cfg.n_kv_heads = f[4];
  cfg.vocab_size = raw_vocab < 0 ? -std::int64_t{raw_vocab} : std::int64_t{raw_vocab};
  cfg.seq_len = f[6];
  cfg.shared_classifier = raw_vocab > 0;
  cfg.rope_theta = kTheta;  // = run.c: 10000 and adjacent pairs are hard-coded, not stored
  cfg.norm_eps = kNormEps;
  cfg.rope_style = RopeStyle::kAdjacentPairs;
  // The checks above name the header field; validate() holds the remaining rules (size caps).
  try {
    cfg.validate();
  } catch (const Error& e) {
    KVDECODE_FAIL(ctx, ": header ", describe(f), ": ", inner_message(e));
  }

  // Sizes in 64 bits with overflow checks: each dimension is < 2^24 now, but their products
  // (n_layers * dim * hidden_dim ...) can still pass 2^64.
  bool overflow = false;
  const auto mul = [&](std::uint64_t a, std::uint64_t b) {
    if (b != 0 && a > std::numeric_limits<std::uint64_t>::max() / b) overflow = true;
    return a * b;
  };
  const auto add = [&](std::uint64_t a, std::uint64_t b) {
    if (a > std::numeric_limits<std::uint64_t>::max() - b) overflow = true;
    return a + b;
  };
  const auto d = static_cast<std::uint64_t>(cfg.dim);
  const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
  const auto layers = static_cast<std::uint64_t>(cfg.n_layers);
  const auto kv_dim = static_cast<std::uint64_t>(cfg.kv_dim());
  const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
  const auto seq_len = static_cast<std::uint64_t>(cfg.seq_len);
  const auto head_size = static_cast<std::uint64_t>(cfg.head_size());
  // Per layer: rms_att + rms_ffn, wq + wo, wk + wv, w1 + w2 + w3.
  const std::uint64_t per_layer =
      add(add(add(mul(2, d), mul(2, mul(d, d))), mul(2, mul(kv_dim, d))), mul(3, mul(hidden, d)));
  const std::uint64_t embedding = mul(vocab, d);
  std::uint64_t weight_floats = add(add(embedding, mul(layers, per_layer)), d);
  if (!cfg.shared_classifier) weight_floats = add(weight_floats, embedding);
  // freq_cis_real and freq_cis_imag: [seq_len][head_size / 2] each.
  const std::uint64_t freq_floats = mul(seq_len, head_size);
  h.weight_bytes = mul(4, weight_floats);
  h.freq_cis_bytes = mul(4, freq_floats);
  h.file_bytes_expected = add(add(kCheckpointHeaderBytes, h.weight_bytes), h.freq_cis_bytes);
  KVDECODE_CHECK(!overflow, ctx, ": header ", describe(f),
                 " describes more tensor bytes than fit in 64 bits");
  const std::uint64_t cls_bytes = cfg.shared_classifier ? 0 : 4 * embedding;
  h.freq_cis_offset = h.file_bytes_expected - h.freq_cis_bytes - cls_bytes;

  KVDECODE_CHECK(h.weight_bytes <= limits.max_bytes, ctx, ": header ", describe(f), " needs ",
                 h.weight_bytes,
                 " bytes of weights, more than CheckpointLimits::max_bytes = ", limits.max_bytes);
  KVDECODE_CHECK(h.weight_bytes <= std::numeric_limits<std::size_t>::max(), ctx, ": header ",
                 describe(f), " needs ", h.weight_bytes, " bytes, more than size_t can address");

  // A hint for the commonest mismatch: the shared flag (vocab_size's sign) is wrong.
  const std::uint64_t one_classifier = 4 * embedding;
  if (file_size < h.file_bytes_expected) {
    const std::uint64_t missing = h.file_bytes_expected - file_size;
    KVDECODE_FAIL(ctx, ": file is truncated: header ", describe(f), " expects ",
                  h.file_bytes_expected, " bytes, the file has ", file_size, " (", missing,
                  " missing)",
                  !cfg.shared_classifier && missing == one_classifier
                      ? "; exactly one [vocab_size][dim] classifier is missing: should vocab_size "
                        "be positive (shared classifier)?"
                      : "");
  }
  // run.c ignores anything after the last tensor; we refuse it, because a longer file almost
  // always means a wrong header (lost unshared flag, another format), not harmless padding.
  if (file_size > h.file_bytes_expected) {
    const std::uint64_t extra = file_size - h.file_bytes_expected;
    KVDECODE_FAIL(ctx, ": file has ", extra, " trailing byte(s) after the last tensor: header ",
                  describe(f), " expects ", h.file_bytes_expected, " bytes, the file has ",
                  file_size,
                  cfg.shared_classifier && extra == one_classifier
                      ? "; the extra bytes are exactly one [vocab_size][dim] classifier: should "
                        "vocab_size be negative (unshared classifier)?"
                      : "");
  }
  return h;
}

struct OpenedCheckpoint {
  std::ifstream in;  // positioned just after the header
  CheckpointHeader header;
};

inline OpenedCheckpoint open_and_check(const std::filesystem::path& file,
                                       const CheckpointLimits& limits) {
  const std::string ctx = context(file);
  std::error_code ec;
  const auto status = std::filesystem::status(file, ec);
  KVDECODE_CHECK(status.type() != std::filesystem::file_type::not_found, ctx,
                 ": file does not exist");
  KVDECODE_CHECK(!ec, ctx, ": cannot stat the file: ", ec.message());
  KVDECODE_CHECK(status.type() != std::filesystem::file_type::directory, ctx,
                 ": is a directory, not a checkpoint file");
  KVDECODE_CHECK(status.type() == std::filesystem::file_type::regular, ctx,
                 ": is not a regular file");
  const std::uintmax_t file_size = std::filesystem::file_size(file, ec);
  KVDECODE_CHECK(!ec, ctx, ": cannot read the file size: ", ec.message());

  OpenedCheckpoint out;
  errno = 0;
  out.in.open(file, std::ios::binary);
  KVDECODE_CHECK(out.in.is_open(), ctx,
                 ": cannot open for reading: ", std::generic_category().message(errno));
  KVDECODE_CHECK(file_size >= kCheckpointHeaderBytes, ctx, ": file is ", file_size,
                 " bytes, shorter than the ", kCheckpointHeaderBytes, "-byte header");
  std::array<unsigned char, kCheckpointHeaderBytes> raw{};
  out.in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
  KVDECODE_CHECK(out.in.gcount() == static_cast<std::streamsize>(raw.size()), ctx, ": read only ",
                 out.in.gcount(), " of the ", kCheckpointHeaderBytes, " header bytes");
  std::array<std::int32_t, 7> fields{};
  for (std::size_t i = 0; i < fields.size(); ++i) fields[i] = load_i32_le(raw.data() + 4 * i);
  out.header = parse_header(fields, file_size, file, limits);
  return out;
}

// Reads `count` f32 straight into dst (the final aligned buffer: no staging copy).
inline void read_f32(std::ifstream& in, float* dst, std::uint64_t count, std::uint64_t offset,
                     const std::string& ctx, const std::string& label) {
  auto* bytes = reinterpret_cast<char*>(dst);
  const std::uint64_t total = 4 * count;
  for (std::uint64_t done = 0; done < total;) {
    const std::uint64_t n = std::min(kChunkBytes, total - done);
    in.read(bytes + done, static_cast<std::streamsize>(n));
    const auto got = static_cast<std::uint64_t>(in.gcount());
    // Only reachable if the file shrank after its size was checked, or on an I/O error.
    KVDECODE_CHECK(got == n, ctx, ": read of tensor ", label, " failed at byte ",
                   offset + done + got, ": wanted ", n, " bytes, got ", got,
                   " (did the file change while loading?)");
    done += n;
  }
  if constexpr (std::endian::native == std::endian::big) {
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint32_t u;
      std::memcpy(&u, dst + i, 4);
      u = byteswap32(u);
      std::memcpy(dst + i, &u, 4);
    }
  }
}

// Writes `count` f32 as little-endian.
inline void write_f32(std::ofstream& out, const float* src, std::uint64_t count) {
  if constexpr (std::endian::native == std::endian::little) {
    const auto* bytes = reinterpret_cast<const char*>(src);
    const std::uint64_t total = 4 * count;
    for (std::uint64_t done = 0; done < total;) {
      const std::uint64_t n = std::min(kChunkBytes, total - done);
      out.write(bytes + done, static_cast<std::streamsize>(n));
      done += n;
    }
  } else {
    std::vector<std::uint32_t> staging(std::min<std::uint64_t>(count, kChunkBytes / 4));
    for (std::uint64_t done = 0; done < count;) {
      const std::uint64_t n = std::min<std::uint64_t>(staging.size(), count - done);
      for (std::uint64_t i = 0; i < n; ++i) {
        std::uint32_t u;
        std::memcpy(&u, src + done + i, 4);
        staging[i] = byteswap32(u);
      }
      out.write(reinterpret_cast<const char*>(staging.data()), static_cast<std::streamsize>(4 * n));
      done += n;
    }
  }
}

// The legacy freq_cis_real then freq_cis_imag tables, [seq_len][head_size/2] f32 each: cos and
// sin of pos * theta^(-2j/head_size), computed in double and rounded once, as this project's
// fixture generator (tools/make_llama2c_checkpoint.py) does. llama2.c's export computes them in
// torch f32, so its bytes may differ in the last bit; run.c never reads them either way.
inline void write_freq_cis(std::ofstream& out, const ModelConfig& cfg) {
  const std::int64_t half = cfg.head_size() / 2;
  std::vector<double> freq(static_cast<std::size_t>(half));
  for (std::int64_t j = 0; j < half; ++j) {
    freq[static_cast<std::size_t>(j)] =
        1.0 / std::pow(kTheta, static_cast<double>(2 * j) / static_cast<double>(cfg.head_size()));
  }
  std::vector<float> row(static_cast<std::size_t>(half));
  for (const bool imag : {false, true}) {
    for (std::int64_t t = 0; t < cfg.seq_len; ++t) {
      for (std::size_t j = 0; j < row.size(); ++j) {
        const double angle = static_cast<double>(t) * freq[j];
        row[j] = static_cast<float>(imag ? std::sin(angle) : std::cos(angle));
      }
      write_f32(out, row.data(), row.size());
    }
  }
}

}  // namespace detail::checkpoint

/// Reads and checks the header of a v0 checkpoint without loading the tensors. Throws Error,
/// naming the file, the field and expected vs actual, when: the file is missing, a directory or
/// shorter than 28 bytes; a field is zero or negative (vocab_size may be negative: unshared
/// classifier) or INT32_MIN; dim % n_heads != 0, n_heads % n_kv_heads != 0 or head_size is odd;
/// the sizes overflow 64 bits or need more than limits.max_bytes; the file size differs from
/// what the header implies (shorter: truncated; longer: trailing bytes, refused too).
inline CheckpointHeader read_checkpoint_header(const std::filesystem::path& file,
                                               const CheckpointLimits& limits = {}) {
  return detail::checkpoint::open_and_check(file, limits).header;
}

/// Loads a v0 checkpoint into 64-byte aligned f32 buffers, reading tensor by tensor straight
/// into them (peak memory ≈ 1.0× the file), and skipping the legacy freq_cis block. Checks as
/// read_checkpoint_header(); on failure it throws and leaves nothing behind.
inline Weights<float> load_checkpoint(const std::filesystem::path& file,
                                      const CheckpointLimits& limits = {}) {
  namespace ck = detail::checkpoint;
  ck::OpenedCheckpoint opened = ck::open_and_check(file, limits);
  const CheckpointHeader& h = opened.header;
  const std::string ctx = ck::context(file);
  Weights<float> w;
  try {
    w = Weights<float>(h.config);
  } catch (const std::bad_alloc&) {
    KVDECODE_FAIL(ctx, ": cannot allocate ", h.weight_bytes, " bytes for the weights");
  }
  std::uint64_t offset = kCheckpointHeaderBytes;
  w.for_each_tensor([&](const char* name, std::int64_t layer, AlignedBuffer<float>& buffer) {
    // wcls is the only tensor after the freq_cis block; the order is fixed by the format.
    if (std::string_view(name) == "wcls") {
      offset += h.freq_cis_bytes;
      opened.in.seekg(static_cast<std::streamoff>(offset));
      KVDECODE_CHECK(opened.in.good(), ctx, ": cannot seek past freq_cis to byte ", offset);
    }
    ck::read_f32(opened.in, buffer.data(), buffer.size(), offset, ctx,
                 ck::tensor_label(name, layer));
    offset += buffer.bytes();
  });
  return w;
}

/// Writes `weights` as a v0 checkpoint that run.c and load_checkpoint() read back bit for bit:
/// the header (vocab_size negated when the classifier is unshared), the tensors, the legacy
/// freq_cis block, then wcls if unshared. The bytes go to "<file>.tmp", which is flushed and
/// renamed over `file`, so a failed save leaves `file` as it was (the rename is atomic on POSIX;
/// there is no fsync, so durability across a power cut is up to the OS). Throws Error when the
/// config cannot be stored in v0 (rope_theta other than 10000, norm_eps other than 1e-5 or
/// half-split RoPE: the format hard-codes them), when a tensor's size disagrees with the config,
/// or on any I/O failure.
inline void save_checkpoint(const Weights<float>& weights, const std::filesystem::path& file) {
  namespace ck = detail::checkpoint;
  const std::string ctx = detail::concat("save_checkpoint '", file.string(), "'");
  const ModelConfig& cfg = weights.config;
  try {
    cfg.validate();
  } catch (const Error& e) {
    KVDECODE_FAIL(ctx, ": ", ck::inner_message(e));
  }
  KVDECODE_CHECK(cfg.rope_style == RopeStyle::kAdjacentPairs, ctx,
                 ": v0 checkpoints imply adjacent-pair RoPE; this model uses half-split RoPE");
  KVDECODE_CHECK(cfg.rope_theta == ck::kTheta, ctx, ": v0 checkpoints imply rope_theta ",
                 ck::kTheta, "; this model has ", cfg.rope_theta);
  KVDECODE_CHECK(cfg.norm_eps == ck::kNormEps, ctx, ": v0 checkpoints imply norm_eps ",
                 ck::kNormEps, "; this model has ", cfg.norm_eps);
  KVDECODE_CHECK(weights.layers.size() == static_cast<std::size_t>(cfg.n_layers), ctx, ": has ",
                 weights.layers.size(), " layers, config n_layers is ", cfg.n_layers);
  weights.for_each_tensor([&](const char* name, std::int64_t layer, const AlignedBuffer<float>& b) {
    const std::uint64_t expected = ck::tensor_elements(cfg, name);
    KVDECODE_CHECK(b.size() == expected, ctx, ": tensor ", ck::tensor_label(name, layer), " has ",
                   b.size(), " elements, the config implies ", expected);
  });

  // validate() capped every field at 2^24 and vocab_size at INT32_MAX, so each fits int32.
  std::array<unsigned char, kCheckpointHeaderBytes> header{};
  const std::array<std::int64_t, 7> fields = {
      cfg.dim,     cfg.hidden_dim, cfg.n_layers,
      cfg.n_heads, cfg.n_kv_heads, cfg.shared_classifier ? cfg.vocab_size : -cfg.vocab_size,
      cfg.seq_len};
  for (std::size_t i = 0; i < fields.size(); ++i)
    ck::store_i32_le(header.data() + 4 * i, static_cast<std::int32_t>(fields[i]));

  std::filesystem::path tmp = file;
  tmp += ".tmp";
  try {
    std::ofstream out;
    errno = 0;
    out.open(tmp, std::ios::binary | std::ios::trunc);
    KVDECODE_CHECK(out.is_open(), ctx, ": cannot create '", tmp.string(),
                   "': ", std::generic_category().message(errno));
    out.write(reinterpret_cast<const char*>(header.data()),
              static_cast<std::streamsize>(header.size()));
    weights.for_each_tensor([&](const char* name, std::int64_t, const AlignedBuffer<float>& b) {
      if (std::string_view(name) == "wcls") ck::write_freq_cis(out, cfg);
      ck::write_f32(out, b.data(), b.size());
    });
    if (cfg.shared_classifier) ck::write_freq_cis(out, cfg);
    out.flush();
    KVDECODE_CHECK(out.good(), ctx, ": writing '", tmp.string(), "' failed (disk full?)");
    out.close();
    KVDECODE_CHECK(!out.fail(), ctx, ": closing '", tmp.string(), "' failed");
    std::error_code ec;
    std::filesystem::rename(tmp, file, ec);
    KVDECODE_CHECK(!ec, ctx, ": cannot rename '", tmp.string(), "' to it: ", ec.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }
}

/// Converts every tensor of `from` to element type To (e.g. float -> double for a reference
/// model, or back), keeping the config. Allocates a full second copy of the weights.
template <class To, class From>
Weights<To> convert_weights(const Weights<From>& from) {
  Weights<To> to(from.config);
  std::vector<const AlignedBuffer<From>*> sources;
  from.for_each_tensor(
      [&](const char*, std::int64_t, const AlignedBuffer<From>& b) { sources.push_back(&b); });
  std::size_t i = 0;
  to.for_each_tensor([&](const char* name, std::int64_t layer, AlignedBuffer<To>& b) {
    KVDECODE_CHECK(i < sources.size() && sources[i]->size() == b.size(), "convert_weights: tensor ",
                   detail::checkpoint::tensor_label(name, layer), " has ",
                   i < sources.size() ? sources[i]->size() : 0, " elements, the config implies ",
                   b.size());
    std::transform(sources[i]->data(), sources[i]->data() + b.size(), b.data(),
                   [](From v) { return static_cast<To>(v); });
    ++i;
  });
  return to;
}

}  // namespace kvdecode
