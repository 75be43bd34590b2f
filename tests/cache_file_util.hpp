// Helpers of the cache-file tests: a file's bytes read and written whole, little-endian fields
// patched in place, and checksums recomputed after an edit, as a forger (or a buggy writer)
// would, so that the checks behind them are the ones tested.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "kvdecode/io/cache_file.hpp"

namespace kvdecode::testing_util {

using FileBytes = std::vector<unsigned char>;

inline FileBytes read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& p, const FileBytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

inline void put_u32(FileBytes& b, std::size_t at, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_u64(FileBytes& b, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<unsigned char>(v >> (8 * i));
}

/// Recomputes the header checksum (XXH3-64 of the bytes before it) after an edit and, with
/// payload_too, first the payload's (XXH3-64 of every byte after the header).
inline void reseal(FileBytes& b, bool payload_too = false) {
  namespace cf = detail::cache_file;
  if (payload_too) {
    put_u64(b, cf::kOffPayloadHash,
            XXH3_64bits(b.data() + cf::kHeaderBytes, b.size() - cf::kHeaderBytes));
  }
  put_u64(b, cf::kOffHeaderHash, XXH3_64bits(b.data(), cf::kOffHeaderHash));
}

}  // namespace kvdecode::testing_util
