// AlignedBuffer<T>: an owned, 64-byte aligned, zero-initialised array. Every weight, cache and
// scratch buffer lives in one, so SIMD loads never straddle cache lines. Large ones (≥ 4 MiB:
// classifiers, embedding tables, caches) start on a 2 MiB boundary and ask Linux for transparent
// huge pages, so a decode step streaming them walks one TLB entry per 2 MiB, not per 4 KiB.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <utility>

#include "kvdecode/error.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvdecode {

inline constexpr std::size_t kAlignment = 64;

/// A transparent huge page (x86-64, and the alignment buffers of kHugePageMinBytes or more get).
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
inline constexpr std::size_t kHugePageMinBytes = 2 * kHugePageBytes;

/// The alignment of an AlignedBuffer of `bytes` bytes.
constexpr std::size_t buffer_alignment(std::uint64_t bytes) {
  return bytes >= kHugePageMinBytes ? kHugePageBytes : kAlignment;
}

/// Bytes an AlignedBuffer of `bytes` bytes allocates: rounded up to its alignment, what a user
/// sizing memory must count. Saturates at the largest uint64 (the stores' byte formulas report
/// that as an overflow).
constexpr std::uint64_t aligned_allocation_bytes(std::uint64_t bytes) {
  const std::uint64_t align = buffer_alignment(bytes);
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  return bytes > max - (align - 1) ? max : (bytes + align - 1) / align * align;
}

/// A fixed-size array of trivially copyable T, aligned to kAlignment. Move-only: copies of
/// large buffers must be explicit (copy_from), so their cost is visible.
template <class T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size) : size_(size) {
    if (size == 0) return;
    KVDECODE_CHECK(size <= std::numeric_limits<std::size_t>::max() / sizeof(T) - kHugePageBytes,
                   "AlignedBuffer: ", size, " elements of ", sizeof(T), " bytes overflow size_t");
    const std::size_t align = alignment(size);
    const std::size_t bytes = allocated_bytes(size);
    data_ = static_cast<T*>(::operator new (bytes, std::align_val_t{align}));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Before the first touch, so the zeroing faults in huge pages; a refusal changes nothing.
    if (align == kHugePageBytes) static_cast<void>(::madvise(data_, bytes, MADV_HUGEPAGE));
#endif
    std::fill_n(data_, size, T{});
  }
  /// `size` elements at `data`, inside storage another buffer owns (Weights' arena of matrices):
  /// the view frees nothing and must not outlive that owner. data must be kAlignment-aligned.
  static AlignedBuffer view(T* data, std::size_t size) {
    AlignedBuffer b;
    b.data_ = data;
    b.size_ = size;
    b.owned_ = false;
    return b;
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        owned_(std::exchange(other.owned_, true)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      owned_ = std::exchange(other.owned_, true);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  /// Copies every element of other, whose size must equal this one's.
  void copy_from(const AlignedBuffer& other) {
    KVDECODE_CHECK(other.size_ == size_, "AlignedBuffer::copy_from: size ", other.size_,
                   " differs from ", size_);
    std::copy_n(other.data_, size_, data_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  /// Bytes allocated: bytes() rounded up to the alignment (aligned_allocation_bytes).
  std::size_t allocated_bytes() const { return allocated_bytes(size_); }
  bool empty() const { return size_ == 0; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::span<T> span() { return {data_, size_}; }
  std::span<const T> span() const { return {data_, size_}; }

 private:
  /// The alignment of a buffer of `size` elements.
  static std::size_t alignment(std::size_t size) { return buffer_alignment(size * sizeof(T)); }

  static std::size_t allocated_bytes(std::size_t size) {
    return static_cast<std::size_t>(aligned_allocation_bytes(size * sizeof(T)));
  }

  void release() {
    if (data_ != nullptr && owned_) ::operator delete (data_, std::align_val_t{alignment(size_)});
    data_ = nullptr;
    size_ = 0;
    owned_ = true;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  bool owned_ = true;  // false for a view()
};

}  // namespace kvdecode
