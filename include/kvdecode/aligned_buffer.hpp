// AlignedBuffer<T>: an owned, 64-byte aligned, zero-initialised array. Every weight, cache and
// scratch buffer lives in one, so SIMD loads never straddle cache lines.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <utility>

#include "kvdecode/error.hpp"

namespace kvdecode {

inline constexpr std::size_t kAlignment = 64;

/// A fixed-size array of trivially copyable T, aligned to kAlignment. Move-only: copies of
/// large buffers must be explicit (copy_from), so their cost is visible.
template <class T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size) : size_(size) {
    if (size == 0) return;
    KVDECODE_CHECK(size <= std::numeric_limits<std::size_t>::max() / sizeof(T) - kAlignment,
                   "AlignedBuffer: ", size, " elements of ", sizeof(T), " bytes overflow size_t");
    const std::size_t bytes = (size * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    data_ = static_cast<T*>(::operator new (bytes, std::align_val_t{kAlignment}));
    std::fill_n(data_, size, T{});
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
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
  bool empty() const { return size_ == 0; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  std::span<T> span() { return {data_, size_}; }
  std::span<const T> span() const { return {data_, size_}; }

 private:
  void release() {
    if (data_ != nullptr) ::operator delete (data_, std::align_val_t{kAlignment});
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace kvdecode
