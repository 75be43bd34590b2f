// MappedFile: a whole file mapped read-only into memory (POSIX mmap), so a reader can take views
// of its bytes without copying them. Move-only; the mapping ends with the object.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>

#include "kvdecode/error.hpp"

namespace kvdecode {

/// A read-only, private mapping of a regular file. An empty file maps to an empty span. As with
/// any mapping, a file truncated by another process while mapped faults on access (SIGBUS).
class MappedFile {
 public:
  MappedFile() = default;

  /// Maps `file`. Throws Error naming `what` and the file when it is missing, a directory, not a
  /// regular file, or cannot be opened or mapped.
  explicit MappedFile(const std::filesystem::path& file, std::string_view what = "file") {
    const std::string ctx = detail::concat(what, " '", file.string(), "'");
    std::error_code ec;
    const auto status = std::filesystem::status(file, ec);
    KVDECODE_CHECK(status.type() != std::filesystem::file_type::not_found, ctx,
                   ": file does not exist");
    KVDECODE_CHECK(!ec, ctx, ": cannot stat the file: ", ec.message());
    KVDECODE_CHECK(status.type() != std::filesystem::file_type::directory, ctx,
                   ": is a directory, not a file");
    KVDECODE_CHECK(status.type() == std::filesystem::file_type::regular, ctx,
                   ": is not a regular file");
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    KVDECODE_CHECK(fd >= 0, ctx,
                   ": cannot open for reading: ", std::generic_category().message(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      KVDECODE_FAIL(ctx, ": cannot stat the open file: ", std::generic_category().message(err));
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
      const int err = errno;
      ::close(fd);
      KVDECODE_CHECK(p != MAP_FAILED, ctx, ": cannot map its ", size_,
                     " bytes: ", std::generic_category().message(err));
      data_ = static_cast<const std::byte*>(p);
    } else {
      ::close(fd);
    }
  }

  MappedFile(MappedFile&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      unmap();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { unmap(); }

  std::span<const std::byte> bytes() const { return {data_, static_cast<std::size_t>(size_)}; }
  std::uint64_t size() const { return size_; }

 private:
  void unmap() {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), static_cast<std::size_t>(size_));
    data_ = nullptr;
    size_ = 0;
  }

  const std::byte* data_ = nullptr;  // [size_]: the file's bytes, read-only
  std::uint64_t size_ = 0;
};

}  // namespace kvdecode
