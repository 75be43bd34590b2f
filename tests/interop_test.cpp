// Interop with llama2.c run.c: the llama2c-tiny fixture (checkpoint, tokenizer and run.c's own
// outputs) loaded through load_checkpoint and Tokenizer::load, checked end to end. Logits of every
// position through decode, prefill (whole and chunked) and forward_reference; greedy ids; the
// prompt's encoding; the printed text; and, as a soft check, two sampled runs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_instances.hpp"

namespace kvdecode {
namespace {

// The fixture's shape (README.md there): 24 prompt ids, 87 positions, 64 sampled ids.
constexpr std::size_t kVocab = 512;
constexpr std::size_t kPromptTokens = 24;
constexpr std::size_t kPositions = 87;                              // run.c -n 87
constexpr std::size_t kGenerated = kPositions - kPromptTokens + 1;  // 64 sampled tokens

// ---------------------------------------------------------------------------------------------
// Fixture files (copied from shared/fixtures/llama2c-tiny into tests/data/llama2c-tiny)

std::filesystem::path data_dir() {
  return std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny";
}

using testing_util::read_ids;
using testing_util::read_text;

// logits.f32: [kPositions][kVocab].
std::vector<float> read_logits(const std::filesystem::path& file) {
  std::vector<float> logits = testing_util::read_f32_le(file);
  EXPECT_EQ(logits.size(), kPositions * kVocab) << file;
  return logits;
}

struct Fixture {
  Fixture()
      : model(load_checkpoint(data_dir() / "model.bin")),
        tokenizer(Tokenizer::load(data_dir() / "tokenizer.bin", model.config().vocab_size)),
        prompt_ids(read_ids(data_dir() / "prompt_ids.txt")),
        input_ids(read_ids(data_dir() / "input_ids.txt")),
        generated_ids(read_ids(data_dir() / "generated_ids.txt")),
        logits(read_logits(data_dir() / "logits.f32")) {}

  Model<float> model;
  Tokenizer tokenizer;
  std::vector<std::int32_t> prompt_ids;     // [24]  run.c encode(prompt, bos=1, eos=0)
  std::vector<std::int32_t> input_ids;      // [87]  token fed at each position
  std::vector<std::int32_t> generated_ids;  // [64]  greedy ids
  std::vector<float> logits;                // [87][512] row p = run.c forward(input_ids[p], p)
};

// Loaded once: the Model is immutable and the files are only read.
const Fixture& fixture() {
  static const Fixture f;
  return f;
}

void check_fixture_shape(const Fixture& f) {
  ASSERT_EQ(f.model.config().vocab_size, static_cast<std::int64_t>(kVocab));
  ASSERT_EQ(f.prompt_ids.size(), kPromptTokens);
  ASSERT_EQ(f.input_ids.size(), kPositions);
  ASSERT_EQ(f.generated_ids.size(), kGenerated);
  ASSERT_EQ(f.logits.size(), kPositions * kVocab);
}

std::span<const std::int32_t> input_span(const Fixture& f) {
  return {f.input_ids.data(), f.input_ids.size()};
}

std::span<const float> ref_row(const Fixture& f, std::size_t pos) {
  return std::span<const float>(f.logits).subspan(pos * kVocab, kVocab);
}

// ---------------------------------------------------------------------------------------------
// Logit comparison: |Δ| ≤ 1e-4 + 1e-4·|ref| per logit (docs/FORMATS.md §2: run.c's own -O3,
// -Ofast and float64 versions differ by ≈ 1.3e-5 with |logit| ≤ 10.4).

struct LogitCheck {
  double max_abs_delta = 0;
  std::size_t failures = 0;

  void compare(std::span<const float> ours, std::size_t pos, const Fixture& f, const char* path) {
    const std::span<const float> ref = ref_row(f, pos);
    ASSERT_EQ(ours.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double r = ref[i];
      const double d = std::abs(static_cast<double>(ours[i]) - r);
      max_abs_delta = std::max(max_abs_delta, d);
      if (!(d <= 1e-4 + 1e-4 * std::abs(r))) {  // also catches NaN
        if (++failures <= 10) {
          ADD_FAILURE() << path << ": position " << pos << " logit " << i << ": ours " << ours[i]
                        << ", run.c " << r << ", |Δ| " << d;
        }
      }
    }
  }

  void report(const char* path) const {
    EXPECT_EQ(failures, 0u) << path << ": logits outside 1e-4 + 1e-4·|ref|";
    ::testing::Test::RecordProperty("max_abs_delta", std::to_string(max_abs_delta));
    std::cout << "[ interop  ] " << path << ": max |Δ| vs run.c over " << kPositions << " × "
              << kVocab << " logits = " << max_abs_delta << "\n";
  }
};

// Our logits of every position, token by token through decode().
std::vector<float> decode_all(const Fixture& f) {
  const ModelConfig& cfg = f.model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1});
  std::vector<float> out;
  out.reserve(kPositions * kVocab);
  for (const std::int32_t token : f.input_ids) {
    const std::span<const float> logits = f.model.decode(token, cache, act);
    out.insert(out.end(), logits.begin(), logits.end());
  }
  EXPECT_EQ(cache.size(), kPositions);
  return out;
}

// ---------------------------------------------------------------------------------------------
// 1. Logits at all 87 positions

TEST(InteropTest, DecodeLogitsMatchRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const std::vector<float> ours = decode_all(f);
  ASSERT_EQ(ours.size(), kPositions * kVocab);
  LogitCheck check;
  for (std::size_t p = 0; p < kPositions; ++p)
    check.compare(std::span<const float>(ours).subspan(p * kVocab, kVocab), p, f, "decode");
  check.report("decode");
}

TEST(InteropTest, PrefillLogitsMatchRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const ModelConfig& cfg = f.model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(
      cfg, {.max_chunk = kPositions});  // one chunk: all 87 tokens in one matrix product
  std::vector<float> all(kPositions * kVocab);
  const std::span<const float> last =
      f.model.prefill(input_span(f), cache, act, std::span<float>(all));
  EXPECT_EQ(cache.size(), kPositions);
  LogitCheck check;
  for (std::size_t p = 0; p < kPositions; ++p)
    check.compare(std::span<const float>(all).subspan(p * kVocab, kVocab), p, f, "prefill");
  check.compare(last, kPositions - 1, f, "prefill (returned last row)");
  check.report("prefill");
}

TEST(InteropTest, ChunkedPrefillLogitsMatchRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const ModelConfig& cfg = f.model.config();
  LogitCheck check;
  {
    // One call, split by the library into chunks of 5 (87 = 17 × 5 + 2).
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 5});
    std::vector<float> all(kPositions * kVocab);
    f.model.prefill(input_span(f), cache, act, std::span<float>(all));
    EXPECT_EQ(cache.size(), kPositions);
    for (std::size_t p = 0; p < kPositions; ++p) {
      check.compare(std::span<const float>(all).subspan(p * kVocab, kVocab), p, f,
                    "chunked prefill (one call, max_chunk 5)");
    }
  }
  {
    // Several calls that continue the cache: the prompt, then pieces of 7 tokens, with chunk
    // boundaries (max_chunk 5) that fall inside the calls.
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 5});
    for (std::size_t done = 0; done < kPositions;) {
      const std::size_t n = done == 0 ? kPromptTokens : std::min<std::size_t>(7, kPositions - done);
      std::vector<float> all(n * kVocab);
      f.model.prefill(input_span(f).subspan(done, n), cache, act, std::span<float>(all));
      for (std::size_t i = 0; i < n; ++i) {
        check.compare(std::span<const float>(all).subspan(i * kVocab, kVocab), done + i, f,
                      "chunked prefill (calls of 24, 7, 7, ...)");
      }
      done += n;
    }
    EXPECT_EQ(cache.size(), kPositions);
  }
  check.report("chunked prefill");
}

TEST(InteropTest, ReferenceLogitsMatchRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const std::vector<float> all = f.model.forward_reference(input_span(f));
  ASSERT_EQ(all.size(), kPositions * kVocab);
  LogitCheck check;
  for (std::size_t p = 0; p < kPositions; ++p) {
    check.compare(std::span<const float>(all).subspan(p * kVocab, kVocab), p, f,
                  "forward_reference");
  }
  check.report("forward_reference");
}

// ---------------------------------------------------------------------------------------------
// 2. Greedy ids

TEST(InteropTest, GreedyArgmaxMatchesRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  // input_ids = the prompt, then the first 63 generated ids.
  ASSERT_TRUE(std::equal(f.prompt_ids.begin(), f.prompt_ids.end(), f.input_ids.begin()));
  ASSERT_TRUE(std::equal(f.generated_ids.begin(), f.generated_ids.end() - 1,
                         f.input_ids.begin() + kPromptTokens));
  const std::vector<float> ours = decode_all(f);
  std::vector<std::int32_t> argmax_ids;
  for (std::size_t p = kPromptTokens - 1; p < kPositions; ++p)
    argmax_ids.push_back(Sampler::argmax(std::span<const float>(ours).subspan(p * kVocab, kVocab)));
  EXPECT_EQ(argmax_ids, f.generated_ids);
}

// generate() as run.c -t 0 -n 87: prompt fed, 64 tokens sampled, stop at BOS (never reached).
std::vector<std::int32_t> run_generate(const Fixture& f, const SamplerOptions& options,
                                       std::size_t chunk) {
  const ModelConfig& cfg = f.model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = chunk});
  Sampler sampler(cfg.vocab_size, options);
  GenerationOptions opt;
  opt.max_new_tokens = kGenerated;
  opt.stop_token = Tokenizer::kBos;  // run.c generate(): `if (next == 1) break;`
  std::vector<std::int32_t> got;
  const GenerationStats st =
      generate(f.model, cache, act, std::span<const std::int32_t>(f.prompt_ids), sampler, opt,
               [&](std::int32_t t) { got.push_back(t); });
  EXPECT_EQ(st.prompt_tokens, kPromptTokens);
  EXPECT_EQ(st.generated_tokens, got.size());
  if (!st.hit_stop_token) {
    EXPECT_EQ(cache.size(), kPositions);  // 24 + 63: the last sampled token is never fed
  }
  return got;
}

TEST(InteropTest, GreedyGenerateMatchesRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const SamplerOptions greedy{0.0, 0.9, 0, 1};
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{5}, kPromptTokens}) {
    EXPECT_EQ(run_generate(f, greedy, chunk), f.generated_ids) << "Activations max_chunk " << chunk;
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Encode (tokenizer_test.cpp covers all 12 encode cases; this is the end-to-end prompt)

TEST(InteropTest, EncodePromptMatchesRunC) {
  const Fixture& f = fixture();
  const std::string prompt = read_text(data_dir() / "prompt.txt");
  EXPECT_EQ(f.tokenizer.encode(prompt, true, false), f.prompt_ids);
}

// ---------------------------------------------------------------------------------------------
// 4. Printed text

// = run.c generate(): print decode(token, next) through safe_printf for every step (the prompt
// after BOS, then the samples), stop before a BOS, then "\n".
std::string printed_output(const Tokenizer& t, const std::vector<std::int32_t>& prompt,
                           const std::vector<std::int32_t>& generated) {
  std::vector<std::int32_t> ids = prompt;
  ids.insert(ids.end(), generated.begin(), generated.end());
  std::string out;
  for (std::size_t pos = 0; pos + 1 < ids.size(); ++pos) {
    if (ids[pos + 1] == Tokenizer::kBos) break;
    out += Tokenizer::printed_text(t.decode(ids[pos], ids[pos + 1]));
  }
  out += '\n';
  return out;
}

TEST(InteropTest, GeneratedTextMatchesRunCStdout) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const std::string prompt = read_text(data_dir() / "prompt.txt");
  const std::vector<std::int32_t> prompt_ids = f.tokenizer.encode(prompt, true, false);
  const std::vector<std::int32_t> ours = run_generate(f, SamplerOptions{0.0, 0.9, 0, 1}, 8);
  EXPECT_EQ(printed_output(f.tokenizer, prompt_ids, ours),
            read_text(data_dir() / "expected_output.txt"));
}

// ---------------------------------------------------------------------------------------------
// 5. Sampled runs (soft check of XorShiftRng and Sampler against run.c)

struct SampledRun {
  double temperature = 0;
  double top_p = 0;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> ids;
  std::string stdout_text;
};

// Just enough JSON for sampled.json: for each run, the numbers after "temperature", "topp" and
// "seed", the integer array "sampled_ids" and the string "stdout".
std::size_t after_key(const std::string& json, std::string_view key, std::size_t from) {
  // Built by append: GCC 12 warns -Wrestrict (a false positive) on `"\"" + std::string(key)`.
  std::string quoted(1, '"');
  quoted.append(key).push_back('"');
  std::size_t at = json.find(quoted, from);
  EXPECT_NE(at, std::string::npos) << "sampled.json: no key " << quoted;
  if (at == std::string::npos) return json.size();
  at = json.find(':', at + quoted.size());
  return at == std::string::npos ? json.size() : at + 1;
}

std::string json_string(const std::string& json, std::size_t& at) {
  at = json.find('"', at);
  std::string out;
  if (at == std::string::npos) return out;
  for (++at; at < json.size() && json[at] != '"'; ++at) {
    if (json[at] != '\\') {
      out += json[at];
      continue;
    }
    const char e = json[++at];
    switch (e) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'u': {
        const unsigned cp = static_cast<unsigned>(std::stoul(json.substr(at + 1, 4), nullptr, 16));
        at += 4;
        if (cp < 0x80) {
          out += static_cast<char>(cp);
        } else if (cp < 0x800) {
          out += static_cast<char>(0xC0 | (cp >> 6));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          out += static_cast<char>(0xE0 | (cp >> 12));
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        }
        break;
      }
      default:
        out += e;  // \" \\ \/
    }
  }
  return out;
}

std::vector<SampledRun> read_sampled_runs(const std::filesystem::path& file) {
  const std::string json = read_text(file);
  std::vector<SampledRun> runs;
  for (std::size_t at = json.find("\"temperature\""); at != std::string::npos;
       at = json.find("\"temperature\"", at)) {
    SampledRun run;
    std::size_t v = after_key(json, "temperature", at);
    run.temperature = std::stod(json.substr(v, 32));
    v = after_key(json, "topp", v);
    run.top_p = std::stod(json.substr(v, 32));
    v = after_key(json, "seed", v);
    run.seed = std::stoull(json.substr(v, 32));
    v = after_key(json, "sampled_ids", v);
    const std::size_t end = json.find(']', v);
    std::istringstream list(json.substr(v, end - v));
    for (std::string item; std::getline(list, item, ',');) {
      item.erase(std::remove_if(item.begin(), item.end(),
                                [](char c) { return c == '[' || c == ' ' || c == '\n'; }),
                 item.end());
      if (!item.empty()) run.ids.push_back(static_cast<std::int32_t>(std::stol(item)));
    }
    v = after_key(json, "stdout", end);
    run.stdout_text = json_string(json, v);
    at = v;
    runs.push_back(std::move(run));
  }
  return runs;
}

// sampled.json calls this a soft check: a sampled id flips when a coin lands within rounding of
// a cdf boundary, or the top-p running sum within rounding of top_p. Measured on this fixture
// (our f32 forward and sampler, vs the same steps with f64 logits and probabilities):
// * every one of the 64 ids of both runs matches run.c, and so does its stdout; so all are
//   asserted;
// * the tightest decisions are -s 42 steps 25 and 32 (top-p sum 8.1e-6 and 7.2e-6 above 0.9)
//   and -s 7 step 26 (coin 1.5e-5 from a cdf boundary); f32-vs-f64 logits move those sums by
//   2e-8 to 5e-8, so there is a ≥ 150× margin over this build's rounding, but less than the
//   1e-4 logit tolerance would allow;
// * no two candidates in any nucleus have equal probability, so run.c's unstable qsort and our
//   tie-break by index choose the same order here;
// * run.c divides the logits by the temperature, we multiply by float(1 / T): identical for
//   T = 1, up to 1 ulp per scaled logit for T = 0.8; run.c's exp is libm's expf, ours the
//   kernel set's vector exp (within 4 · 2^-24 of exp in double), about 1e-7 of a probability,
//   also well inside that margin (the runs match in every kernel set, KVDECODE_ISA).
// If a kernel change (another summation order, FMA, SIMD width) makes a run diverge at one of
// those steps while the logit tests still pass, that is rounding, not a bug: the message gives
// the first differing index; assert the prefix before it instead.
TEST(InteropTest, SampledRunsMatchRunC) {
  const Fixture& f = fixture();
  check_fixture_shape(f);
  const std::vector<SampledRun> runs = read_sampled_runs(data_dir() / "sampled.json");
  ASSERT_EQ(runs.size(), 2u);
  const std::string prompt = read_text(data_dir() / "prompt.txt");
  for (const SampledRun& run : runs) {
    ASSERT_EQ(run.ids.size(), kGenerated);
    const std::vector<std::int32_t> ours =
        run_generate(f, SamplerOptions{run.temperature, run.top_p, 0, run.seed}, 8);
    std::size_t agree = 0;
    while (agree < ours.size() && agree < run.ids.size() && ours[agree] == run.ids[agree]) ++agree;
    std::cout << "[ interop  ] sampled run -t " << run.temperature << " -p " << run.top_p << " -s "
              << run.seed << ": first " << agree << " of " << run.ids.size()
              << " ids match run.c\n";
    RecordProperty("matching_prefix_seed_" + std::to_string(run.seed), std::to_string(agree));
    EXPECT_EQ(ours, run.ids) << "-t " << run.temperature << " -p " << run.top_p << " -s "
                             << run.seed << ": first difference at sampled index " << agree;
    EXPECT_EQ(printed_output(f.tokenizer, f.tokenizer.encode(prompt, true, false), ours),
              run.stdout_text)
        << "-s " << run.seed;
  }
}

}  // namespace
}  // namespace kvdecode
