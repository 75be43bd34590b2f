// Readers of the fixture files other implementations wrote (tests/data): whole text files,
// whitespace-separated token ids, and little-endian f32 arrays.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace kvdecode::testing_util {

inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << file;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::vector<std::int32_t> read_ids(const std::filesystem::path& file) {
  std::istringstream in(read_text(file));
  std::vector<std::int32_t> ids;
  for (std::int32_t id = 0; in >> id;) ids.push_back(id);
  return ids;
}

/// Little-endian f32 values, decoded byte by byte so the host's endianness does not matter.
inline std::vector<float> read_f32_le(const std::filesystem::path& file) {
  const std::string bytes = read_text(file);
  EXPECT_EQ(bytes.size() % 4, 0u) << file;
  std::vector<float> out(bytes.size() / 4);
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint32_t u = 0;
    for (std::size_t b = 0; b < 4; ++b)
      u |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[4 * i + b])) << (8 * b);
    out[i] = std::bit_cast<float>(u);
  }
  return out;
}

}  // namespace kvdecode::testing_util
