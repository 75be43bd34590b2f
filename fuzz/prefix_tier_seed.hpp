// The prefix tier's fuzz setup, shared by the target and the seed writer: the seed model, pools
// of 4-position blocks, and a 5-token prompt whose one full block is the block file under test.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "kvdecode/serving/prefix_tier.hpp"
#include "seed_model.hpp"

namespace kvdecode::fuzz {

inline constexpr std::size_t kTierBlock = 4;
inline const std::vector<std::int32_t>& tier_prompt() {
  static const std::vector<std::int32_t> p = {1, 4, 7, 10, 2};
  return p;
}

/// The block file a tier writes for tier_prompt()'s first block, into `dir` (emptied first);
/// returns its file name there.
inline std::string write_valid_block_file(const Model<float>& model, const ModelFingerprint& fp,
                                          const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  BlockPool<float> pool(model.config(), 4, kTierBlock);
  PrefixTier<float> tier(fp, {.directory = dir, .max_bytes = 1 << 20});
  tier.attach(pool);
  Activations<float> act(model.config(), {.max_chunk = 8});
  {
    PagedStore<float> s(pool);
    model.prefill(tier_prompt(), s, act);
  }
  pool.spill_cached();
  std::string name;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".kvblock") name = e.path().filename().string();
  return name;
}

}  // namespace kvdecode::fuzz
