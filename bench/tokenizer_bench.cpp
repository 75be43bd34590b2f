// BM_Encode: Tokenizer::encode over the llama2c-tiny fixture vocabulary (512 pieces) for texts
// of 1 KiB to 256 KiB, with a complexity fit over the text length (the heap-based merge loop is
// O(n log n) at worst, a text without spaces; word by word it is about linear); BM_EncodeRunCLoop
// beside it is run.c's merge loop (rescan every pair after each merge, O(n²)) as the baseline, up
// to 8 KiB so that it stays affordable. BM_EncodeBundled: the bundled model's 4096-piece vocabulary
// on 1 and 4 KiB, a server's prompt sizes (checked against run.c's loop first).

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/text/tokenizer.hpp"

#ifndef KVDECODE_TEST_DATA_DIR
#error "define KVDECODE_TEST_DATA_DIR as the tests/data directory (bench/CMakeLists.txt does)"
#endif

namespace {

using kvdecode::Tokenizer;

const Tokenizer& fixture_tokenizer() {
  static const Tokenizer t =
      Tokenizer::load(KVDECODE_TEST_DATA_DIR "/llama2c-tiny/tokenizer.bin", 512);
  return t;
}

const Tokenizer& bundled_tokenizer() {
  static const Tokenizer t = Tokenizer::load(KVDECODE_MODEL_DIR "/tokenizer.bin", 4096);
  return t;
}

/// English-like text of `bytes` bytes: a story sentence repeated, as a long prompt would be.
std::string story_text(std::size_t bytes) {
  static constexpr std::string_view kSentence =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "sunshine. One day, she saw a big, red ball in the park. ";
  std::string text;
  text.reserve(bytes + kSentence.size());
  while (text.size() < bytes) text += kSentence;
  text.resize(bytes);
  return text;
}

void BM_Encode(benchmark::State& state) {
  const Tokenizer& t = fixture_tokenizer();
  const std::string text = story_text(static_cast<std::size_t>(state.range(0)));
  std::vector<std::int32_t> out;
  t.encode(text, true, false, out);  // sizes `out`, so the timed calls allocate nothing
  state.counters["tokens"] = static_cast<double>(out.size());
  for (auto _ : state) {
    t.encode(text, true, false, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
  state.SetComplexityN(state.range(0));
}

/// run.c's encode(text, bos = 1, eos = 0) as the baseline: one token per code point (or per
/// byte, byte + 3), then the merge loop that rescans every pair for the best one after each
/// merge. Lookups are Tokenizer::find, a binary search as run.c's bsearch.
std::vector<std::int32_t> run_c_encode(const Tokenizer& t, std::string_view text) {
  std::vector<std::int32_t> tokens = {Tokenizer::kBos, *t.find(" ")};
  for (std::size_t c = 0; c < text.size();) {
    std::size_t end = c + 1;
    while (end < text.size() && end - c < 4 &&
           (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80)
      ++end;
    if (const auto id = t.find(text.substr(c, end - c))) {
      tokens.push_back(*id);
    } else {
      for (std::size_t i = c; i < end; ++i)
        tokens.push_back(static_cast<unsigned char>(text[i]) + Tokenizer::kByteIdOffset);
    }
    c = end;
  }
  std::string merged;
  while (true) {
    float best_score = -1e10f;
    std::int32_t best_id = -1;
    std::size_t best_idx = tokens.size();
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      merged.assign(t.piece(tokens[i]));
      merged += t.piece(tokens[i + 1]);
      const auto id = t.find(merged);
      if (id && t.score(*id) > best_score) {
        best_score = t.score(*id);
        best_id = *id;
        best_idx = i;
      }
    }
    if (best_idx == tokens.size()) break;
    tokens[best_idx] = best_id;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_idx) + 1);
  }
  return tokens;
}

void BM_EncodeRunCLoop(benchmark::State& state) {
  const Tokenizer& t = fixture_tokenizer();
  const std::string text = story_text(static_cast<std::size_t>(state.range(0)));
  if (run_c_encode(t, text) != t.encode(text)) {
    state.SkipWithError("run.c's loop and Tokenizer::encode disagree");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(run_c_encode(t, text).data());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
  state.SetComplexityN(state.range(0));
}

void BM_EncodeBundled(benchmark::State& state) {
  const Tokenizer& t = bundled_tokenizer();
  const std::string text = story_text(static_cast<std::size_t>(state.range(0)));
  std::vector<std::int32_t> out;
  t.encode(text, true, false, out);
  if (run_c_encode(t, text) != out) {
    state.SkipWithError("run.c's loop and Tokenizer::encode disagree");
    return;
  }
  state.counters["tokens"] = static_cast<double>(out.size());
  for (auto _ : state) {
    t.encode(text, true, false, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}

BENCHMARK(BM_Encode)
    ->RangeMultiplier(4)
    ->Range(1 << 10, kvdecode::bench::top(256 << 10, 4 << 10))
    ->Unit(benchmark::kMicrosecond)
    ->Complexity(benchmark::oNLogN);
BENCHMARK(BM_EncodeRunCLoop)
    ->RangeMultiplier(2)
    ->Range(1 << 10, kvdecode::bench::top(8 << 10, 1 << 10))
    ->Unit(benchmark::kMicrosecond)
    ->Complexity(benchmark::oNSquared);
BENCHMARK(BM_EncodeBundled)->Arg(1 << 10)->Arg(4 << 10)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
