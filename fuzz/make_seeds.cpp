// Writes the seed corpora under fuzz/corpus/<target>/ (run by hand after a format change:
//   fuzz_make_seeds <source>/fuzz/corpus). Every seed is small, so libFuzzer's default max_len
// stays small and each run is fast; they cover a valid file of each kind and its near misses.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cache_kinds.hpp"
#include "kvdecode/io/cache_file.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "prefix_tier_seed.hpp"
#include "seed_model.hpp"

namespace fs = std::filesystem;

namespace {

std::vector<unsigned char> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& p, const std::vector<unsigned char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void write_text(const fs::path& p, const std::string& s) {
  write_file(p, std::vector<unsigned char>(s.begin(), s.end()));
}

kvdecode::ModelConfig tiny(std::int64_t n_heads, std::int64_t n_kv_heads, bool shared) {
  kvdecode::ModelConfig c;
  c.dim = 4 * n_heads;
  c.hidden_dim = 6;
  c.n_layers = 1;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 5;
  c.seq_len = 3;
  c.shared_classifier = shared;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds CORPUS_DIR\n");
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* d : {"checkpoint", "tokenizer", "encode", "cache_file", "prefix_tier"})
    fs::create_directories(root / d);

  // Checkpoints: valid shared/unshared, GQA/MQA; a header alone; the v1 magic; a truncation.
  const fs::path tmp = root / "checkpoint" / "tmp.bin";
  int n = 0;
  std::vector<unsigned char> first;
  for (const auto& cfg : {tiny(1, 1, true), tiny(2, 1, false), tiny(2, 2, true)}) {
    kvdecode::save_checkpoint(kvdecode::random_weights<float>(cfg, 1), tmp);
    auto bytes = read_file(tmp);
    if (first.empty()) first = bytes;
    write_file(root / "checkpoint" / ("valid_" + std::to_string(n++) + ".bin"), bytes);
  }
  fs::remove(tmp);
  write_file(root / "checkpoint" / "header_only.bin",
             std::vector<unsigned char>(first.begin(), first.begin() + 28));
  write_file(root / "checkpoint" / "truncated.bin",
             std::vector<unsigned char>(first.begin(), first.end() - 5));
  auto magic = first;
  magic[0] = 0x32, magic[1] = 0x34, magic[2] = 0x6b, magic[3] = 0x61;
  write_file(root / "checkpoint" / "v1_magic.bin", magic);

  // Tokenizers: 2 bytes of vocab_size, then the file.
  const auto with_vocab = [](std::int64_t vocab, std::vector<std::byte> file) {
    std::vector<unsigned char> out = {static_cast<unsigned char>(vocab & 0xFF),
                                      static_cast<unsigned char>(vocab >> 8)};
    for (const std::byte b : file) out.push_back(static_cast<unsigned char>(b));
    return out;
  };
  const kvdecode::Tokenizer small(
      {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "b", " a", "ab", "<0x41>"},
      {0, 0, 0, -1, -2, -3, 1, 2, -5}, 6);
  write_file(root / "tokenizer" / "small.bin", with_vocab(9, small.to_bytes()));
  write_file(root / "tokenizer" / "small_wrong_vocab.bin", with_vocab(12, small.to_bytes()));
  const auto fixture = read_file(KVDECODE_FUZZ_TOKENIZER);
  std::vector<std::byte> fixture_bytes;
  for (const unsigned char c : fixture) fixture_bytes.push_back(static_cast<std::byte>(c));
  write_file(root / "tokenizer" / "fixture512.bin", with_vocab(512, fixture_bytes));

  // Encoder texts: ASCII, the fixture prompt, UTF-8 of 2-4 bytes, invalid UTF-8, NUL, "<0x41>".
  write_text(root / "encode" / "ascii.txt", "Once upon a time, there was a little girl.");
  write_text(root / "encode" / "spaces.txt", "  two  spaces\tand\na newline ");
  write_text(root / "encode" / "utf8.txt",
             "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xe4\xb8\xad");
  write_text(root / "encode" / "invalid_utf8.txt", "\xff\xfe \x80\x80 \xc3 \xf0\x9f\x98");
  write_text(root / "encode" / "nul.txt", std::string("a\0b", 3));
  write_text(root / "encode" / "byte_piece.txt", "<0x41> <s> </s>");
  write_text(root / "encode" / "empty.txt", "");

  // Cache files for the target's model, from every store kind (cache_kinds.hpp): 0, 3 and 8
  // (full) positions; flag byte 2·kind and 2·kind + 1 (checksums recomputed by the target).
  const kvdecode::Model<float> model(kvdecode::fuzz::seed_weights());
  const fs::path cache = root / "cache_file" / "tmp.kvc";
  const std::vector<std::int32_t> tokens = {1, 4, 7, 10, 0, 2, 3, 5};
  for (int kind = 0; kind < kvdecode::fuzz::kCacheKinds; ++kind) {
    for (const std::size_t len : {0u, 3u, 8u}) {
      kvdecode::fuzz::with_cache_store(kind, model.config(), [&](auto& s) {
        kvdecode::Activations<float> act(model.config(), {.max_chunk = kvdecode::fuzz::kMaxTokens,
                                                          .store_scratch = s.block_scratch_size()});
        kvdecode::fuzz::feed(model, s, act, std::span<const std::int32_t>(tokens).first(len));
        kvdecode::save_cache(model, s, cache);
      });
      for (const int flag : {0, 1}) {
        std::vector<unsigned char> bytes = {static_cast<unsigned char>(2 * kind + flag)};
        const auto body = read_file(cache);
        bytes.insert(bytes.end(), body.begin(), body.end());
        write_file(root / "cache_file" /
                       (std::string(kvdecode::fuzz::kCacheKindNames[kind]) + "_tokens" +
                        std::to_string(len) + "_flag" + std::to_string(flag) + ".bin"),
                   bytes);
      }
    }
  }
  fs::remove(cache);

  // Prefix tier block files (fuzz_prefix_tier): the valid file with both flag values, a cut
  // header and payload, another block's tokens, another format version.
  namespace pt = kvdecode::detail::prefix_tier;
  const fs::path tier_dir = root / "prefix_tier" / "tmp";
  const std::string block_name =
      kvdecode::fuzz::write_valid_block_file(model, kvdecode::model_fingerprint(model), tier_dir);
  const auto block = read_file(tier_dir / block_name);
  fs::remove_all(tier_dir);
  const auto with_flag = [&](unsigned char flag, std::vector<unsigned char> body) {
    body.insert(body.begin(), flag);
    return body;
  };
  write_file(root / "prefix_tier" / "valid_flag0.bin", with_flag(0, block));
  write_file(root / "prefix_tier" / "valid_flag1.bin", with_flag(1, block));
  write_file(root / "prefix_tier" / "cut_header.bin",
             with_flag(0, std::vector<unsigned char>(block.begin(), block.begin() + 100)));
  write_file(root / "prefix_tier" / "cut_payload.bin",
             with_flag(1, std::vector<unsigned char>(block.begin(), block.end() - 7)));
  auto other_tokens = block;
  other_tokens[pt::kHeaderBytes] ^= 1;
  write_file(root / "prefix_tier" / "other_tokens_flag1.bin", with_flag(1, other_tokens));
  auto version = block;
  pt::put_u32(version.data() + pt::kOffVersion, 2);
  write_file(root / "prefix_tier" / "version2_flag1.bin", with_flag(1, version));
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}
