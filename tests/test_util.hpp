// Helpers shared by the test suites: test model shapes, random token streams, logit comparisons,
// error messages, seeds from the environment.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_instances.hpp"

namespace kvdecode::testing_util {

/// The seven sizes of a test model, each named where a test writes its shape
/// (test_config({.dim = 16, .hidden_dim = 24, ...})).
struct TestShape {
  std::int64_t dim = 0;
  std::int64_t hidden_dim = 0;
  std::int64_t n_layers = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t vocab_size = 0;
  std::int64_t seq_len = 0;
};

/// The config of a test shape; the other fields (RoPE, norm, classifier) keep ModelConfig's
/// defaults, and a test that needs another sets it on the result.
constexpr ModelConfig test_config(const TestShape& s) {
  ModelConfig c;
  c.dim = s.dim;
  c.hidden_dim = s.hidden_dim;
  c.n_layers = s.n_layers;
  c.n_heads = s.n_heads;
  c.n_kv_heads = s.n_kv_heads;
  c.vocab_size = s.vocab_size;
  c.seq_len = s.seq_len;
  return c;
}

/// Head size 16, two layers, n_heads / n_kv_heads as given (GQA by default), vocab 53.
constexpr ModelConfig small_config(std::int64_t n_heads = 4, std::int64_t n_kv_heads = 2,
                                   std::int64_t seq_len = 48) {
  return test_config({.dim = 16 * n_heads,
                      .hidden_dim = 96,
                      .n_layers = 2,
                      .n_heads = n_heads,
                      .n_kv_heads = n_kv_heads,
                      .vocab_size = 53,
                      .seq_len = seq_len});
}

/// The bytes the library's buffers allocate for `bytes` bytes, as its header documents them:
/// whole 64-byte lines, or whole 2 MiB huge pages from 4 MiB on. Written here, not taken from
/// the library, so memory tests check its arithmetic.
constexpr std::uint64_t allocated(std::uint64_t bytes) {
  const std::uint64_t unit = bytes >= (std::uint64_t{4} << 20) ? std::uint64_t{2} << 20 : 64;
  return (bytes + unit - 1) / unit * unit;
}

/// The ids a store's tokens() shows when it holds the sequence `all`: every one, but for a window
/// store holding more than S + R positions (R = W - 1 + max_chunk) those of the newest R.
template <class S>
std::vector<std::int32_t> shown_tokens(const S& store, const std::vector<std::int32_t>& all) {
  std::size_t n = all.size();
  if constexpr (requires { store.sinks(); }) {
    const std::size_t r = store.window() - 1 + store.max_chunk();
    if (n > store.sinks() + r) n = r;
  }
  return {all.end() - static_cast<std::ptrdiff_t>(n), all.end()};
}

/// dim 16, 2 query heads on 1 kv head (GQA), vocab 11, 24 positions: a model whose no-cache
/// recompute costs microseconds, for property runs of thousands of operations.
constexpr ModelConfig tiny_config(std::int64_t n_layers) {
  return test_config({.dim = 16,
                      .hidden_dim = 24,
                      .n_layers = n_layers,
                      .n_heads = 2,
                      .n_kv_heads = 1,
                      .vocab_size = 11,
                      .seq_len = 24});
}

/// The message of the kvdecode::Error fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

/// The environment variable `name` as a number (a seed, an operation count), else fallback.
inline std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 0) : fallback;
}

inline std::vector<std::int32_t> random_tokens(std::size_t n, std::int64_t vocab,
                                               std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(vocab));
  return t;
}

/// max |a - b| over two equally long logit vectors. A NaN in either (which std::max would skip)
/// is a failure of the calling test and makes the result +infinity, so every bound on it fails
/// too, and so does a maximum taken over several calls.
template <class RangeA, class RangeB>
double max_abs_diff(const RangeA& a, const RangeB& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) {
      ADD_FAILURE() << "max_abs_diff: NaN at index " << i << " (" << a[i] << " vs " << b[i] << ")";
      return std::numeric_limits<double>::infinity();
    }
    worst = std::max(worst, d);
  }
  return worst;
}

/// Whether two stores hold bit-identical keys and values for their first n positions.
template <class T>
bool same_contents(const ContiguousStore<T>& a, const ContiguousStore<T>& b, std::size_t n) {
  for (std::size_t l = 0; l < a.n_layers(); ++l)
    for (std::size_t h = 0; h < a.n_kv_heads(); ++h)
      for (std::size_t p = 0; p < n; ++p) {
        const auto ka = a.key(l, h, p), kb = b.key(l, h, p);
        const auto va = a.value(l, h, p), vb = b.value(l, h, p);
        for (std::size_t i = 0; i < ka.size(); ++i)
          if (ka[i] != kb[i] || va[i] != vb[i]) return false;
      }
  return true;
}

/// Forces a kernel set for one test and restores the previous one.
class ForcedKernelSet {
 public:
  explicit ForcedKernelSet(KernelSet s) : before_(active_kernel_set()) { force_kernel_set(s); }
  ~ForcedKernelSet() { force_kernel_set(before_); }
  ForcedKernelSet(const ForcedKernelSet&) = delete;
  ForcedKernelSet& operator=(const ForcedKernelSet&) = delete;

 private:
  KernelSet before_;
};

/// Sets AMX on or off for one test, restoring the choice before it after.
class ForcedAmx {
 public:
  explicit ForcedAmx(bool on) : before_(amx_enabled()) { force_amx(on); }
  ~ForcedAmx() { force_amx(before_); }
  ForcedAmx(const ForcedAmx&) = delete;
  ForcedAmx& operator=(const ForcedAmx&) = delete;

 private:
  bool before_;
};

/// Half the step of a quantized stores' f16 range over [lo, hi] with top code `levels` (255,
/// 15, 3), plus the f32 arithmetic of the codes: min is rounded down by at most one f16 unit
/// (2^-10 relative, 2^-24 below the normal range) and the step up by as much, so
/// s ≤ ((hi − lo + 2^-10 |lo| + 2^-24) / levels) (1 + 2^-10) + 2^-24.
inline double range_half_step(double lo, double hi, double levels) {
  const double s = (hi - lo + 0x1p-10 * std::abs(lo) + 0x1p-24) / levels * (1 + 0x1p-10) + 0x1p-24;
  return s / 2 + 1e-6 * (1 + std::abs(lo) + std::abs(hi));
}

}  // namespace kvdecode::testing_util
