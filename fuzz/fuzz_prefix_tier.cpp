// libFuzzer target: arbitrary bytes as the prefix tier's block file for a prompt's first block
// (serving/prefix_tier.hpp, docs/FORMATS.md §4). Byte 0 is a flag: its low bit set, the target
// recomputes both checksums first, so mutations reach the field checks. A new pool and tier on
// the directory then open the prompt: the file must be skipped with exactly one reason, or used
// whole (exactly a block file long); the pool's invariants hold and a decode runs either way.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "fuzz_util.hpp"
#include "prefix_tier_seed.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  namespace pt = kvdecode::detail::prefix_tier;
  if (size < 1) return 0;
  static const kvdecode::Model<float> model(kf::seed_weights());
  static const kvdecode::ModelFingerprint fingerprint = kvdecode::model_fingerprint(model);
  static const std::filesystem::path dir =
      kf::scratch_file("prefix_tier").string() + "_dir";  // per process, in /dev/shm
  static const std::string name = kf::write_valid_block_file(model, fingerprint, dir);
  static const struct RemoveAtExit {
    ~RemoveAtExit() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove_at_exit;
  kf::require(!name.empty(), "the valid block file was written");

  std::vector<std::uint8_t> file(data + 1, data + size);
  if ((data[0] & 1) != 0 && file.size() >= pt::kHeaderBytes) {
    pt::put_u64(
        file.data() + pt::kOffPayloadHash,
        kvdecode::Checksum::hash(file.data() + pt::kHeaderBytes, file.size() - pt::kHeaderBytes));
    pt::put_u64(file.data() + pt::kOffHeaderHash,
                kvdecode::Checksum::hash(file.data(), pt::kOffHeaderHash));
  }
  kf::write_scratch(dir / name, file.data(), file.size());

  kvdecode::BlockPool<float> pool(model.config(), 4, kf::kTierBlock);
  kvdecode::PrefixTier<float> tier(fingerprint, {.directory = dir, .max_bytes = 1 << 20});
  tier.attach(pool);
  kvdecode::PagedStore<float> s = kvdecode::PagedStore<float>::open(pool, kf::tier_prompt());
  const kvdecode::PrefixTierStats& st = tier.stats();
  kf::require(st.disk_hits + st.disk_misses == 1, "the block was asked of the tier once");
  kf::require(st.disk_hits == 1 ? s.size() == kf::kTierBlock && st.files_skipped() == 0
                                : s.size() == 0 && st.files_skipped() == 1,
              "a block file is used whole, or skipped with one reason");
  kf::require(st.disk_hits == 0 || file.size() == tier.file_bytes(), "a used file is one block");
  pool.check_invariants();
  kvdecode::Activations<float> act(model.config(), {.max_chunk = 8});
  const std::span<const std::int32_t> prompt(kf::tier_prompt());
  (void)model.prefill(prompt.subspan(s.size()), s, act);
  (void)model.decode(3, s, act);
  return 0;
}
