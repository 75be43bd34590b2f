// Tests for io/checkpoint.hpp: the llama2c-tiny fixture against its own raw bytes, save/load
// round trips, and every malformed-file case with the parts its error message must name.
#include "kvdecode/io/checkpoint.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "test_util.hpp"

// ---------------------------------------------------------------------------------------------
// Aligned-allocation accounting. AlignedBuffer allocates every tensor with the aligned operator
// new, so replacing it here shows how many tensor buffers a load allocates and its peak bytes.

namespace {

std::atomic<std::int64_t> g_aligned_allocations{0};
std::atomic<std::int64_t> g_aligned_live_bytes{0};
std::atomic<std::int64_t> g_aligned_peak_bytes{0};

}  // namespace

// Each block carries its size in a prefix one alignment unit long, so the unsized delete that
// AlignedBuffer calls can subtract it.
void* operator new(std::size_t size, std::align_val_t align) {
  const auto a = static_cast<std::size_t>(align);
  const std::size_t total = (size + a + a - 1) / a * a;
  auto* base = static_cast<unsigned char*>(std::aligned_alloc(a, total));
  if (base == nullptr) throw std::bad_alloc();
  std::memcpy(base, &size, sizeof(size));
  g_aligned_allocations.fetch_add(1);
  const std::int64_t live = g_aligned_live_bytes.fetch_add(static_cast<std::int64_t>(size)) +
                            static_cast<std::int64_t>(size);
  std::int64_t peak = g_aligned_peak_bytes.load();
  while (live > peak && !g_aligned_peak_bytes.compare_exchange_weak(peak, live)) {
  }
  return base + a;
}

void operator delete(void* p, std::align_val_t align) noexcept {
  if (p == nullptr) return;
  auto* base = static_cast<unsigned char*>(p) - static_cast<std::size_t>(align);
  std::size_t size = 0;
  std::memcpy(&size, base, sizeof(size));
  g_aligned_live_bytes.fetch_sub(static_cast<std::int64_t>(size));
  std::free(base);
}

void operator delete(void* p, std::size_t, std::align_val_t align) noexcept {
  operator delete(p, align);
}

namespace kvdecode {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------------------------
// Helpers

const fs::path kFixture = fs::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny" / "model.bin";
const fs::path kFixtureConfig = fs::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny" / "config.json";
constexpr std::uint64_t kFixtureBytes = 503068;  // tests/data/llama2c-tiny/README: 28 + 4 * 125760

using Bytes = std::vector<unsigned char>;

Bytes read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in.is_open()) << file;
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& file, const Bytes& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << file;
}

// The fixture file, read once: the malformed cases each start from a copy.
const Bytes& fixture_bytes() {
  static const Bytes bytes = read_bytes(kFixture);
  return bytes;
}

std::int32_t header_field(const Bytes& bytes, std::size_t index) {
  std::uint32_t u = 0;
  for (std::size_t b = 0; b < 4; ++b) u |= std::uint32_t{bytes[4 * index + b]} << (8 * b);
  return static_cast<std::int32_t>(u);
}

void set_header_field(Bytes& bytes, std::size_t index, std::int32_t value) {
  const auto u = static_cast<std::uint32_t>(value);
  for (std::size_t b = 0; b < 4; ++b)
    bytes[4 * index + b] = static_cast<unsigned char>(u >> (8 * b));
}

float f32_at(const Bytes& bytes, std::uint64_t offset) {
  std::uint32_t u = 0;
  for (std::size_t b = 0; b < 4; ++b) u |= std::uint32_t{bytes[offset + b]} << (8 * b);
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint32_t bits(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return u;
}

// A fresh directory per test, removed afterwards; the random suffix keeps parallel ctest runs
// (and other builds running the same test) apart.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("kvdecode_checkpoint_" + std::string(info->name()) + "_" + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  fs::path operator/(const std::string& name) const { return path_ / name; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// The message of the kvdecode::Error that fn throws; a test failure if it throws nothing else.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-kvdecode exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

std::string load_error(const fs::path& file, const CheckpointLimits& limits = {}) {
  return error_of([&] { (void)load_checkpoint(file, limits); });
}

// One tensor of `w` by checkpoint name, written out member by member so that the test does not
// rely on Weights::for_each_tensor's order.
const AlignedBuffer<float>& tensor(const Weights<float>& w, const std::string& name,
                                   std::int64_t layer) {
  const auto l = static_cast<std::size_t>(layer);
  if (name == "token_embedding_table") return w.token_embedding;
  if (name == "rms_att_weight") return w.layers[l].rms_att;
  if (name == "wq") return w.layers[l].wq;
  if (name == "wk") return w.layers[l].wk;
  if (name == "wv") return w.layers[l].wv;
  if (name == "wo") return w.layers[l].wo;
  if (name == "rms_ffn_weight") return w.layers[l].rms_ffn;
  if (name == "w1") return w.layers[l].w1;
  if (name == "w2") return w.layers[l].w2;
  if (name == "w3") return w.layers[l].w3;
  if (name == "rms_final_weight") return w.rms_final;
  if (name == "wcls") return w.wcls;
  throw std::logic_error("unknown tensor " + name);
}

struct TensorAt {
  std::string name;
  std::int64_t layer;      // -1 for tensors outside the layers
  std::uint64_t offset;    // byte offset in the file
  std::uint64_t elements;  // f32 count
};

// The v0 layout, from docs/FORMATS.md §2, computed here without the library.
std::vector<TensorAt> v0_layout(const ModelConfig& c) {
  const auto dim = static_cast<std::uint64_t>(c.dim);
  const auto hidden = static_cast<std::uint64_t>(c.hidden_dim);
  const auto kv_dim = static_cast<std::uint64_t>(c.n_kv_heads * (c.dim / c.n_heads));
  const auto vocab = static_cast<std::uint64_t>(c.vocab_size);
  const auto head_size = static_cast<std::uint64_t>(c.dim / c.n_heads);
  std::vector<TensorAt> out;
  std::uint64_t offset = 28;
  const auto add = [&](const std::string& name, std::int64_t layers, std::uint64_t per) {
    for (std::int64_t l = 0; l < std::max<std::int64_t>(layers, 1); ++l) {
      out.push_back({name, layers == 0 ? -1 : l, offset, per});
      offset += 4 * per;
    }
  };
  const std::int64_t n = c.n_layers;
  add("token_embedding_table", 0, vocab * dim);
  add("rms_att_weight", n, dim);
  add("wq", n, dim * dim);
  add("wk", n, kv_dim * dim);
  add("wv", n, kv_dim * dim);
  add("wo", n, dim * dim);
  add("rms_ffn_weight", n, dim);
  add("w1", n, hidden * dim);
  add("w2", n, dim * hidden);
  add("w3", n, hidden * dim);
  add("rms_final_weight", 0, dim);
  offset += 2 * 4 * static_cast<std::uint64_t>(c.seq_len) * (head_size / 2);  // freq_cis, skipped
  if (!c.shared_classifier) add("wcls", 0, vocab * dim);
  return out;
}

std::uint64_t v0_file_bytes(const ModelConfig& c) {
  const auto dim = static_cast<std::uint64_t>(c.dim);
  const auto hidden = static_cast<std::uint64_t>(c.hidden_dim);
  const auto kv_dim = static_cast<std::uint64_t>(c.kv_dim());
  const auto vocab = static_cast<std::uint64_t>(c.vocab_size);
  const auto layers = static_cast<std::uint64_t>(c.n_layers);
  return 28 + 4 * (vocab * dim +
                   layers * (2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * dim * hidden) + dim +
                   static_cast<std::uint64_t>(c.seq_len * c.head_size()) +
                   (c.shared_classifier ? 0 : vocab * dim));
}

// Every tensor of a and b has the same bits (NaN payloads and -0 included).
void expect_bit_identical(const Weights<float>& a, const Weights<float>& b) {
  EXPECT_EQ(a.config, b.config);
  for (const TensorAt& t : v0_layout(a.config)) {
    const AlignedBuffer<float>& x = tensor(a, t.name, t.layer);
    const AlignedBuffer<float>& y = tensor(b, t.name, t.layer);
    ASSERT_EQ(x.size(), y.size()) << t.name << " layer " << t.layer;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.bytes()), 0) << t.name << " layer " << t.layer;
  }
}

ModelConfig small_config(bool shared, std::int64_t n_kv_heads) {
  ModelConfig c = testing_util::test_config({.dim = 48,
                                             .hidden_dim = 100,
                                             .n_layers = 3,
                                             .n_heads = 6,  // head_size 8
                                             .n_kv_heads = n_kv_heads,
                                             .vocab_size = 37,
                                             .seq_len = 20});
  c.shared_classifier = shared;
  return c;
}

// ---------------------------------------------------------------------------------------------
// The fixture

TEST(CheckpointTest, FixtureConfigMatchesConfigJson) {
  const Bytes json_bytes = read_bytes(kFixtureConfig);
  const std::string json(json_bytes.begin(), json_bytes.end());
  const auto json_int = [&](const std::string& key) -> std::int64_t {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(json, m, std::regex("\"" + key + "\":\\s*(-?[0-9]+)"))) << key;
    return m.empty() ? -1 : std::stoll(m[1]);
  };
  const Weights<float> w = load_checkpoint(kFixture);
  const ModelConfig& c = w.config;
  EXPECT_EQ(c.dim, json_int("dim"));
  EXPECT_EQ(c.hidden_dim, json_int("hidden_dim"));
  EXPECT_EQ(c.n_layers, json_int("n_layers"));
  EXPECT_EQ(c.n_heads, json_int("n_heads"));
  EXPECT_EQ(c.n_kv_heads, json_int("n_kv_heads"));
  EXPECT_EQ(c.vocab_size, json_int("vocab_size"));
  EXPECT_EQ(c.seq_len, json_int("seq_len"));
  EXPECT_EQ(c.head_size(), json_int("head_size"));
  EXPECT_EQ(c.kv_dim(), json_int("kv_dim"));
  EXPECT_EQ(c.kv_mul(), json_int("kv_mul"));
  EXPECT_THAT(json, HasSubstr("\"shared\": true"));
  EXPECT_TRUE(c.shared_classifier);
  // The values config.json states, so a regex slip above cannot pass silently.
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 128);
  EXPECT_EQ(c.rope_style, RopeStyle::kAdjacentPairs);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.norm_eps, 1e-5);
  EXPECT_TRUE(w.wcls.empty());
  EXPECT_EQ(w.classifier(), w.token_embedding.data());
}

TEST(CheckpointTest, HeaderReportsFixtureSizes) {
  const CheckpointHeader h = read_checkpoint_header(kFixture);
  EXPECT_EQ(h.fields, (std::array<std::int32_t, 7>{64, 172, 2, 4, 2, 512, 128}));
  EXPECT_EQ(h.file_bytes_expected, kFixtureBytes);
  EXPECT_EQ(h.file_bytes_expected, fs::file_size(kFixture));
  EXPECT_EQ(h.freq_cis_bytes, 2u * 4u * 128u * 8u);
  EXPECT_EQ(h.freq_cis_offset, kFixtureBytes - h.freq_cis_bytes);
  EXPECT_EQ(h.weight_bytes, kFixtureBytes - 28 - h.freq_cis_bytes);
  EXPECT_EQ(h.file_bytes_expected, v0_file_bytes(h.config));
}

TEST(CheckpointTest, FixtureTensorsMatchRawBytesAtComputedOffsets) {
  const Bytes& raw = fixture_bytes();
  ASSERT_EQ(raw.size(), kFixtureBytes);
  const Weights<float> w = load_checkpoint(kFixture);
  const std::vector<TensorAt> layout = v0_layout(w.config);
  ASSERT_EQ(layout.size(), 2u + 9u * 2u);
  for (const TensorAt& t : layout) {
    SCOPED_TRACE(t.name + " layer " + std::to_string(t.layer));
    const AlignedBuffer<float>& b = tensor(w, t.name, t.layer);
    ASSERT_EQ(b.size(), t.elements);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % kAlignment, 0u);
    EXPECT_EQ(bits(b[0]), bits(f32_at(raw, t.offset)));
    EXPECT_EQ(bits(b[b.size() - 1]), bits(f32_at(raw, t.offset + 4 * (t.elements - 1))));
    for (std::uint64_t i = 0; i < t.elements; ++i) {
      if (bits(b[i]) != bits(f32_at(raw, t.offset + 4 * i))) {
        ADD_FAILURE() << "element " << i << " differs from the file";
        break;
      }
    }
  }
  // RMSNorm gains are 1 ± 0.25 in the fixture, a cheap sign that the offsets are not shifted.
  for (const auto& l : w.layers) {
    for (std::size_t i = 0; i < l.rms_att.size(); ++i) {
      EXPECT_NEAR(l.rms_att[i], 1.0f, 0.25f);
      EXPECT_NEAR(l.rms_ffn[i], 1.0f, 0.25f);
    }
  }
  // The last tensor ends where the freq_cis block begins: cos(0) = 1 for every j at pos 0.
  const std::uint64_t freq = layout.back().offset + 4 * layout.back().elements;
  EXPECT_EQ(f32_at(raw, freq), 1.0f);
  EXPECT_EQ(f32_at(raw, freq + 4 * 7), 1.0f);
}

TEST(CheckpointTest, LoadPeakMemoryIsAboutTheFileSize) {
  g_aligned_peak_bytes.store(g_aligned_live_bytes.load());
  const std::int64_t before = g_aligned_live_bytes.load();
  {
    const Weights<float> w = load_checkpoint(kFixture);
    EXPECT_EQ(w.bytes(), kFixtureBytes - 28 - 2 * 4 * 128 * 8);
  }
  const std::int64_t peak = g_aligned_peak_bytes.load() - before;
  // The tensors are read into their final buffers: peak = the weights, ≈ 1.0× the file.
  EXPECT_GE(peak, static_cast<std::int64_t>(kFixtureBytes - 28 - 2 * 4 * 128 * 8));
  EXPECT_LE(peak, static_cast<std::int64_t>(kFixtureBytes));
  EXPECT_EQ(g_aligned_live_bytes.load(), before);
}

// ---------------------------------------------------------------------------------------------
// Save and round trips

TEST(CheckpointTest, SaveOfLoadedFixtureReproducesTheFileByteForByte) {
  ScratchDir dir;
  const fs::path out = dir / "model.bin";
  save_checkpoint(load_checkpoint(kFixture), out);
  const Bytes& expected = fixture_bytes();
  const Bytes actual = read_bytes(out);
  ASSERT_EQ(actual.size(), expected.size());
  // Includes the freq_cis block: double cos/sin rounded to f32, as the fixture's generator.
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (actual[i] != expected[i]) {
      FAIL() << "first difference at byte " << i;
    }
  }
  EXPECT_FALSE(fs::exists(dir / "model.bin.tmp"));
}

TEST(CheckpointTest, RoundTripIsBitIdenticalSharedGqa) {
  ScratchDir dir;
  Weights<float> w = random_weights<float>(small_config(/*shared=*/true, /*n_kv_heads=*/2), 7);
  // Values a careless conversion would change: NaN payload, -0, infinity, a subnormal.
  const std::uint32_t nan_bits = 0x7fc01234u;
  std::memcpy(&w.layers[1].wk[3], &nan_bits, 4);
  w.layers[2].w2[0] = -0.0f;
  w.rms_final[5] = std::numeric_limits<float>::infinity();
  w.token_embedding[11] = std::numeric_limits<float>::denorm_min();
  const fs::path file = dir / "shared.bin";
  save_checkpoint(w, file);
  EXPECT_EQ(fs::file_size(file), v0_file_bytes(w.config));
  EXPECT_EQ(header_field(read_bytes(file), 5), 37);
  expect_bit_identical(load_checkpoint(file), w);
}

TEST(CheckpointTest, RoundTripIsBitIdenticalUnsharedMqa) {
  ScratchDir dir;
  const Weights<float> w = random_weights<float>(small_config(/*shared=*/false, 1), 8);
  const fs::path file = dir / "unshared.bin";
  save_checkpoint(w, file);
  const Bytes raw = read_bytes(file);
  EXPECT_EQ(raw.size(), v0_file_bytes(w.config));
  EXPECT_EQ(header_field(raw, 5), -37);  // negative vocab_size = separate wcls follows
  const Weights<float> loaded = load_checkpoint(file);
  EXPECT_FALSE(loaded.config.shared_classifier);
  EXPECT_EQ(loaded.classifier(), loaded.wcls.data());
  expect_bit_identical(loaded, w);
  // wcls sits after the freq_cis block, at the offset the format gives.
  const TensorAt wcls = v0_layout(w.config).back();
  ASSERT_EQ(wcls.name, "wcls");
  EXPECT_EQ(wcls.offset + 4 * wcls.elements, raw.size());
  EXPECT_EQ(bits(f32_at(raw, wcls.offset)), bits(w.wcls[0]));
}

TEST(CheckpointTest, SaveReplacesAnExistingFileAndLeavesNoTempFile) {
  ScratchDir dir;
  const fs::path file = dir / "m.bin";
  write_bytes(file, Bytes(100, 0xAB));
  const Weights<float> w = random_weights<float>(small_config(true, 3), 9);
  save_checkpoint(w, file);
  EXPECT_EQ(fs::file_size(file), v0_file_bytes(w.config));
  EXPECT_FALSE(fs::exists(dir / "m.bin.tmp"));
  expect_bit_identical(load_checkpoint(file), w);
}

TEST(CheckpointTest, SaveRefusesSettingsV0CannotStore) {
  ScratchDir dir;
  const fs::path file = dir / "m.bin";
  {
    Weights<float> w = random_weights<float>(small_config(true, 2), 1);
    w.config.rope_theta = 500000.0;
    EXPECT_THAT(error_of([&] { save_checkpoint(w, file); }),
                AllOf(HasSubstr(file.string()), HasSubstr("rope_theta 10000"),
                      HasSubstr("this model has 500000")));
  }
  {
    Weights<float> w = random_weights<float>(small_config(true, 2), 1);
    w.config.norm_eps = 1e-6;
    EXPECT_THAT(error_of([&] { save_checkpoint(w, file); }),
                AllOf(HasSubstr("norm_eps 1e-05"), HasSubstr("this model has 1e-06")));
  }
  {
    Weights<float> w = random_weights<float>(small_config(true, 2), 1);
    w.config.rope_style = RopeStyle::kHalfSplit;
    EXPECT_THAT(error_of([&] { save_checkpoint(w, file); }), HasSubstr("half-split"));
  }
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(dir / "m.bin.tmp"));
}

TEST(CheckpointTest, SaveRefusesATensorOfTheWrongSize) {
  ScratchDir dir;
  const fs::path file = dir / "m.bin";
  Weights<float> w = random_weights<float>(small_config(true, 2), 1);
  w.layers[1].wk = AlignedBuffer<float>(5);
  EXPECT_THAT(error_of([&] { save_checkpoint(w, file); }),
              AllOf(HasSubstr(file.string()), HasSubstr("tensor wk[layer 1] has 5 elements"),
                    HasSubstr("implies 768")));
  EXPECT_FALSE(fs::exists(file));
}

TEST(CheckpointTest, SaveIntoAMissingDirectoryFailsAndLeavesNothing) {
  ScratchDir dir;
  const fs::path file = dir / "no" / "such" / "m.bin";
  const Weights<float> w = random_weights<float>(small_config(true, 2), 1);
  EXPECT_THAT(error_of([&] { save_checkpoint(w, file); }),
              AllOf(HasSubstr(file.string()), HasSubstr("cannot create")));
  EXPECT_FALSE(fs::exists(dir / "no"));
}

TEST(CheckpointTest, ConvertWeightsRoundTripsThroughDouble) {
  const Weights<float> w = load_checkpoint(kFixture);
  const Weights<double> d = convert_weights<double>(w);
  EXPECT_EQ(d.config, w.config);
  EXPECT_EQ(d.layers[1].w2[17], static_cast<double>(w.layers[1].w2[17]));
  expect_bit_identical(convert_weights<float>(d), w);
}

// ---------------------------------------------------------------------------------------------
// Malformed files. Each case writes a modified copy of the fixture and checks that the message
// names the file, the field and the numbers.

class Malformed {
 public:
  Malformed() : bytes_(fixture_bytes()) {}
  Bytes& bytes() { return bytes_; }
  // Writes the current bytes and returns the load error.
  std::string load_error_of(const std::string& name, const CheckpointLimits& limits = {}) {
    path_ = dir_ / name;
    write_bytes(path_, bytes_);
    return load_error(path_, limits);
  }
  std::string path() const { return path_.string(); }

 private:
  ScratchDir dir_;
  Bytes bytes_;
  fs::path path_;
};

constexpr std::array<const char*, 7> kFields = {"dim",        "hidden_dim", "n_layers", "n_heads",
                                                "n_kv_heads", "vocab_size", "seq_len"};

TEST(CheckpointTest, RejectsZeroInEveryHeaderField) {
  for (std::size_t i = 0; i < kFields.size(); ++i) {
    SCOPED_TRACE(kFields[i]);
    Malformed m;
    set_header_field(m.bytes(), i, 0);
    const std::string e = m.load_error_of("zero.bin");
    EXPECT_THAT(e, AllOf(HasSubstr(m.path()),
                         HasSubstr(std::string("header field ") + kFields[i] + " (int32 #" +
                                   std::to_string(i) + " at byte " + std::to_string(4 * i) + ")"),
                         HasSubstr("got 0")));
    EXPECT_THAT(e, HasSubstr(i == 5 ? "must be nonzero" : "must be positive"));
  }
}

TEST(CheckpointTest, RejectsNegativeHeaderFields) {
  for (std::size_t i = 0; i < kFields.size(); ++i) {
    if (i == 5) continue;  // a negative vocab_size is the unshared flag: next test
    SCOPED_TRACE(kFields[i]);
    Malformed m;
    set_header_field(m.bytes(), i, -3);
    EXPECT_THAT(m.load_error_of("negative.bin"),
                AllOf(HasSubstr(m.path()), HasSubstr(std::string("header field ") + kFields[i]),
                      HasSubstr("must be positive, got -3")));
  }
}

TEST(CheckpointTest, NegativeVocabSizeExpectsAClassifierTheFixtureLacks) {
  Malformed m;
  set_header_field(m.bytes(), 5, -512);
  const std::uint64_t expected = kFixtureBytes + 4 * 512 * 64;
  EXPECT_THAT(m.load_error_of("unshared.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("truncated"), HasSubstr("vocab_size=-512"),
                    HasSubstr("expects " + std::to_string(expected) + " bytes"),
                    HasSubstr("the file has " + std::to_string(kFixtureBytes)),
                    HasSubstr("(131072 missing)"), HasSubstr("should vocab_size be positive")));
}

TEST(CheckpointTest, SharedHeaderOnAFileWithAClassifierHintsAtTheSign) {
  Malformed m;
  m.bytes().resize(kFixtureBytes + 4 * 512 * 64, 0);
  EXPECT_THAT(m.load_error_of("extra_wcls.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("131072 trailing byte(s)"),
                    HasSubstr("should vocab_size be negative")));
}

TEST(CheckpointTest, RejectsInt32MinVocabSize) {
  Malformed m;
  set_header_field(m.bytes(), 5, std::numeric_limits<std::int32_t>::min());
  EXPECT_THAT(m.load_error_of("int32min.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("vocab_size"), HasSubstr("-2147483648"),
                    HasSubstr("does not fit int32")));
}

TEST(CheckpointTest, RejectsHugeHeaderFields) {
  constexpr std::int32_t kHuge = std::int32_t{1} << 30;
  for (std::size_t i : {0u, 1u, 2u, 5u, 6u}) {
    SCOPED_TRACE(kFields[i]);
    Malformed m;
    set_header_field(m.bytes(), i, kHuge);
    if (i == 0) set_header_field(m.bytes(), 3, 1 << 24);  // keep head_size = 64, even
    if (i == 0) set_header_field(m.bytes(), 4, 1 << 24);
    EXPECT_THAT(m.load_error_of("huge.bin"),
                AllOf(HasSubstr(m.path()), HasSubstr(std::string(kFields[i]) + " (1073741824)"),
                      HasSubstr("exceeds the supported maximum 16777216")));
  }
  {
    Malformed m;
    set_header_field(m.bytes(), 3, kHuge);
    EXPECT_THAT(m.load_error_of("huge_heads.bin"),
                AllOf(HasSubstr(m.path()),
                      HasSubstr("dim (64) must be divisible by n_heads (1073741824)")));
  }
  {
    Malformed m;
    set_header_field(m.bytes(), 4, kHuge);
    EXPECT_THAT(m.load_error_of("huge_kv_heads.bin"),
                AllOf(HasSubstr(m.path()),
                      HasSubstr("n_heads (4) must be a multiple of n_kv_heads (1073741824)")));
  }
}

TEST(CheckpointTest, RejectsSizesThatOverflow64BitsBeforeAllocating) {
  Malformed m;
  // Every field within validate()'s 2^24 cap, but n_layers * 3 * dim * hidden_dim = 3 * 2^72.
  for (std::size_t i : {0u, 1u, 2u, 5u, 6u}) set_header_field(m.bytes(), i, 1 << 24);
  set_header_field(m.bytes(), 3, 1 << 20);
  set_header_field(m.bytes(), 4, 1 << 20);
  const std::int64_t allocations = g_aligned_allocations.load();
  EXPECT_THAT(m.load_error_of("overflow.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("dim=16777216 hidden_dim=16777216"),
                    HasSubstr("more tensor bytes than fit in 64 bits")));
  EXPECT_EQ(g_aligned_allocations.load(), allocations);
}

TEST(CheckpointTest, RejectsAHeaderOverTheDefaultLimitBeforeAllocating) {
  Malformed m;
  // A Llama-2-70B-shaped header (about 275 GB of f32) on a 0.5 MB file.
  const std::array<std::int32_t, 7> big = {8192, 28672, 80, 64, 8, 32000, 4096};
  for (std::size_t i = 0; i < big.size(); ++i) set_header_field(m.bytes(), i, big[i]);
  const ModelConfig c = testing_util::test_config({.dim = 8192,
                                                   .hidden_dim = 28672,
                                                   .n_layers = 80,
                                                   .n_heads = 64,
                                                   .n_kv_heads = 8,
                                                   .vocab_size = 32000,
                                                   .seq_len = 4096});
  const std::uint64_t weight_bytes = v0_file_bytes(c) - 28 - 4 * 4096 * 128;
  const std::int64_t allocations = g_aligned_allocations.load();
  EXPECT_THAT(m.load_error_of("llama70b.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("needs " + std::to_string(weight_bytes)),
                    HasSubstr("CheckpointLimits::max_bytes = 34359738368"),
                    Not(HasSubstr("cannot allocate"))));
  EXPECT_EQ(g_aligned_allocations.load(), allocations);
}

TEST(CheckpointTest, SmallLimitRefusesTheFixtureBeforeAllocating) {
  const std::uint64_t weight_bytes = kFixtureBytes - 28 - 2 * 4 * 128 * 8;
  const std::int64_t allocations = g_aligned_allocations.load();
  EXPECT_THAT(
      load_error(kFixture, CheckpointLimits{weight_bytes - 1}),
      AllOf(HasSubstr(kFixture.string()), HasSubstr("needs " + std::to_string(weight_bytes)),
            HasSubstr("max_bytes = " + std::to_string(weight_bytes - 1))));
  EXPECT_THAT(error_of([&] { (void)read_checkpoint_header(kFixture, CheckpointLimits{1000}); }),
              HasSubstr("max_bytes = 1000"));
  EXPECT_EQ(g_aligned_allocations.load(), allocations);
  EXPECT_EQ(load_checkpoint(kFixture, CheckpointLimits{weight_bytes}).bytes(), weight_bytes);
}

TEST(CheckpointTest, RejectsHeadsNotAMultipleOfKvHeads) {
  Malformed m;
  set_header_field(m.bytes(), 4, 3);
  EXPECT_THAT(
      m.load_error_of("gqa.bin"),
      AllOf(HasSubstr(m.path()), HasSubstr("n_heads (4) must be a multiple of n_kv_heads (3)")));
}

TEST(CheckpointTest, RejectsDimNotDivisibleByHeads) {
  Malformed m;
  set_header_field(m.bytes(), 3, 6);
  EXPECT_THAT(m.load_error_of("heads.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("dim (64) must be divisible by n_heads (6)")));
}

TEST(CheckpointTest, RejectsOddHeadSize) {
  Malformed m;
  set_header_field(m.bytes(), 3, 64);  // head_size 1
  EXPECT_THAT(m.load_error_of("odd.bin"),
              AllOf(HasSubstr(m.path()),
                    HasSubstr("head_size = dim / n_heads = 64 / 64 = 1 must be even")));
}

TEST(CheckpointTest, RejectsTheV1V2ExportMagic) {
  Malformed m;
  set_header_field(m.bytes(), 0, 0x616b3432);
  EXPECT_THAT(m.load_error_of("v1.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("'ak42'"), HasSubstr("legacy v0")));
}

TEST(CheckpointTest, RejectsFilesShorterThanTheHeader) {
  for (std::size_t size : {0u, 1u, 27u}) {
    SCOPED_TRACE(size);
    Malformed m;
    m.bytes().resize(size);
    EXPECT_THAT(m.load_error_of("short.bin"),
                AllOf(HasSubstr(m.path()), HasSubstr("file is " + std::to_string(size) + " bytes"),
                      HasSubstr("shorter than the 28-byte header")));
  }
}

TEST(CheckpointTest, RejectsTruncatedBodies) {
  const std::vector<TensorAt> layout = v0_layout(load_checkpoint(kFixture).config);
  const auto wq1 = std::find_if(layout.begin(), layout.end(),
                                [](const TensorAt& t) { return t.name == "wq" && t.layer == 1; });
  ASSERT_NE(wq1, layout.end());
  const std::vector<std::uint64_t> sizes = {
      28,                                                       // header only
      wq1->offset + 4 * (wq1->elements / 2) + 2,                // mid-tensor, mid-float
      layout.back().offset + 4 * layout.back().elements + 100,  // inside freq_cis
      kFixtureBytes - 1,                                        // the last byte missing
  };
  for (const std::uint64_t size : sizes) {
    SCOPED_TRACE(size);
    Malformed m;
    m.bytes().resize(size);
    EXPECT_THAT(
        m.load_error_of("truncated.bin"),
        AllOf(HasSubstr(m.path()), HasSubstr("truncated"),
              HasSubstr("dim=64 hidden_dim=172 n_layers=2 n_heads=4 n_kv_heads=2 "
                        "vocab_size=512 seq_len=128"),
              HasSubstr("expects 503068 bytes"), HasSubstr("the file has " + std::to_string(size)),
              HasSubstr("(" + std::to_string(kFixtureBytes - size) + " missing)")));
    EXPECT_THAT(error_of([&] { (void)read_checkpoint_header(m.path()); }), HasSubstr("truncated"));
  }
}

TEST(CheckpointTest, RejectsOneTrailingByte) {
  Malformed m;
  m.bytes().push_back(0);
  EXPECT_THAT(m.load_error_of("trailing.bin"),
              AllOf(HasSubstr(m.path()), HasSubstr("has 1 trailing byte(s)"),
                    HasSubstr("expects 503068 bytes, the file has 503069")));
}

TEST(CheckpointTest, RejectsANonexistentFile) {
  ScratchDir dir;
  const fs::path file = dir / "missing.bin";
  EXPECT_THAT(load_error(file), AllOf(HasSubstr(file.string()), HasSubstr("does not exist")));
  EXPECT_THAT(error_of([&] { (void)read_checkpoint_header(file); }), HasSubstr("does not exist"));
}

TEST(CheckpointTest, RejectsADirectory) {
  ScratchDir dir;
  EXPECT_THAT(load_error(dir.path()),
              AllOf(HasSubstr(dir.path().string()), HasSubstr("is a directory")));
}

}  // namespace
}  // namespace kvdecode
