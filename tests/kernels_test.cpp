// The optimised kernels against naive loops written here: GEMV (f32, bf16), the column-sliced
// GEMM, the few-token GEMM of batched decode (also against each token's GEMV), the threaded
// projection at 1/2/3 threads, the thread pool, bf16 rounding, and threaded
// attention. Odd sizes (1 row, columns not multiples of 16 or 32) cover every tail path.
//
// f32 bound: a sum of n products computed in f32 in any order is within γ_n·Σ|w_i x_i| of the
// exact sum, γ_n ≈ n·2^-24 (Higham, Accuracy and Stability, §3.1); the naive loop sums in double.
#include "kvdecode/detail/kernels.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

template <class W>
std::vector<W> random_vector(std::size_t n, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<W> v(n);
  for (auto& e : v) e = static_cast<W>(static_cast<float>(rng.symmetric()));
  return v;
}

/// Exact-ish y = w·x in double, and Σ|w x| per row (the scale of the f32 error bound).
/// x_round rounds the input the way the kernel does before multiplying (identity for f32).
template <class W, class Round>
void naive_gemv(const std::vector<W>& w, const std::vector<float>& x, std::size_t rows,
                std::size_t cols, Round x_round, std::vector<double>& y, std::vector<double>& mag) {
  y.assign(rows, 0);
  mag.assign(rows, 0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      const double p = static_cast<double>(static_cast<float>(w[r * cols + c])) * x_round(x[c]);
      y[r] += p;
      mag[r] += std::abs(p);
    }
}

const std::vector<std::size_t> kRows = {1, 3, 16, 17, 33};
const std::vector<std::size_t> kCols = {1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 288};

TEST(KernelsTest, GemvF32MatchesNaive) {
  for (const std::size_t rows : kRows)
    for (const std::size_t cols : kCols) {
      const auto w = random_vector<float>(rows * cols, rows * 1000 + cols);
      const auto x = random_vector<float>(cols, cols);
      std::vector<double> ref, mag;
      naive_gemv(
          w, x, rows, cols, [](float v) { return static_cast<double>(v); }, ref, mag);
      std::vector<float> y(rows, std::numeric_limits<float>::quiet_NaN());
      detail::gemv_rows(y.data(), w.data(), x.data(), 0, rows, cols);
      for (std::size_t r = 0; r < rows; ++r)
        EXPECT_LE(std::abs(y[r] - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
            << rows << "×" << cols << " row " << r;
    }
}

TEST(KernelsTest, GemmFewMatchesNaiveAndEachTokensGemv) {
  for (const std::size_t n : {1, 2, 3, 4, 5, 7, 8, 17, 32})
    for (const std::size_t rows : kRows)
      for (const std::size_t cols : {1, 15, 16, 17, 31, 32, 33, 100, 288}) {
        const auto w = random_vector<float>(rows * cols, rows * 1000 + cols);
        const auto x = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        // Columns [1, rows) only when rows > 1: the slice a thread gets; column 0 stays NaN.
        const std::size_t c0 = rows > 1 ? 1 : 0;
        std::vector<float> y(n * rows, std::numeric_limits<float>::quiet_NaN());  // [n][rows]
        detail::gemm_few(y.data(), x.data(), w.data(), n, cols, rows, c0, rows,
                         static_cast<float*>(nullptr));
        for (std::size_t t = 0; t < n; ++t) {
          const std::vector<float> xt(x.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                      x.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
          std::vector<double> ref, mag;
          naive_gemv(
              w, xt, rows, cols, [](float v) { return static_cast<double>(v); }, ref, mag);
          std::vector<float> gemv(rows);
          detail::gemv_rows(gemv.data(), w.data(), xt.data(), 0, rows, cols);
          for (std::size_t r = 0; r < rows; ++r) {
            const float got = y[t * rows + r];
            if (r < c0) {
              EXPECT_TRUE(std::isnan(got)) << "column outside the slice was written";
              continue;
            }
            EXPECT_LE(std::abs(got - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
                << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
            // With the AVX-512 kernel a token's outputs are its GEMV's, bit for bit.
            if (detail::kHasGemmFew<float, float>) {
              EXPECT_EQ(got, gemv[r]) << n << " tokens " << rows << "×" << cols << " token " << t;
            }
          }
        }
      }
}

TEST(KernelsTest, GemvF32RowRangeTouchesOnlyItsRows) {
  const std::size_t rows = 37, cols = 45;
  const auto w = random_vector<float>(rows * cols, 5);
  const auto x = random_vector<float>(cols, 6);
  std::vector<float> whole(rows), part(rows, -7.0f);
  detail::gemv_rows(whole.data(), w.data(), x.data(), 0, rows, cols);
  detail::gemv_rows(part.data(), w.data(), x.data(), 5, 22, cols);
  for (std::size_t r = 0; r < rows; ++r) {
    if (r >= 5 && r < 22) {
      EXPECT_EQ(part[r], whole[r]) << "row " << r;  // same per-row arithmetic, bit for bit
    } else {
      EXPECT_EQ(part[r], -7.0f) << "row " << r;
    }
  }
}

// bf16: the kernel multiplies bf16 weights by x rounded to bf16 (exact products) and sums in
// f32, so against the naive loop over the same rounded values the f32 bound holds; against the
// unrounded x it may add the input rounding, 2^-8 relative per term.
TEST(KernelsTest, GemvBf16MatchesNaive) {
  for (const std::size_t rows : kRows)
    for (const std::size_t cols : kCols) {
      const auto w = random_vector<bf16>(rows * cols, rows * 77 + cols);
      const auto x = random_vector<float>(cols, cols + 1);
      std::vector<double> ref, mag, ref_x, mag_x;
      naive_gemv(
          w, x, rows, cols,
          [](float v) { return static_cast<double>(static_cast<float>(bf16(v))); }, ref, mag);
      naive_gemv(
          w, x, rows, cols, [](float v) { return static_cast<double>(v); }, ref_x, mag_x);
      std::vector<float> y(rows), y_portable(rows);
      detail::gemv_rows(y.data(), w.data(), x.data(), 0, rows, cols);
      detail::gemv_rows_bf16_portable(y_portable.data(), w.data(), x.data(), 0, rows, cols);
      for (std::size_t r = 0; r < rows; ++r) {
        const double f32 = static_cast<double>(cols) * 0x1p-24 * mag[r];
        EXPECT_LE(std::abs(y[r] - ref[r]), f32) << rows << "×" << cols << " row " << r;
        EXPECT_LE(std::abs(y_portable[r] - ref[r]), f32) << rows << "×" << cols << " row " << r;
        EXPECT_LE(std::abs(y[r] - ref_x[r]), f32 + 0x1p-8 * mag_x[r]);
      }
    }
}

/// detail::linear at 1, 2 and 3 threads: GEMV bit-identical to one thread, GEMM (Eigen per
/// column slice, bf16 widened in panels of kPanelRows rows) within the f32 bound of the naive.
template <class W>
void check_linear() {
  const std::size_t in = 70;
  for (const std::size_t out :
       {std::size_t{1}, std::size_t{17}, std::size_t{130}, std::size_t{600}})
    for (const std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{5}}) {
      const auto w = random_vector<W>(out * in, out + n);
      const auto x = random_vector<float>(n * in, 3 * n);
      std::vector<float> one(n * out);
      std::vector<float> one_panel(detail::kPanelRows * in);
      detail::linear(one.data(), x.data(), w.data(), n, in, out, nullptr, one_panel.data(), 0);
      for (const std::size_t threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        std::vector<float> panels(threads * detail::kPanelRows * in);
        std::vector<float> y(n * out, std::numeric_limits<float>::quiet_NaN());
        // kMinParallelWeights keeps small products on one thread; force the split through the
        // pool by calling gemv/gemm on each share exactly as linear() does for large ones.
        pool.run([&](std::size_t t) {
          const auto [c0, c1] = ThreadPool::share(out, threads, t, 16);
          if (c1 <= c0) return;
          if (n == 1) {
            detail::gemv_rows(y.data(), w.data(), x.data(), c0, c1, in);
          } else {
            detail::gemm_cols(y.data(), x.data(), w.data(), n, in, out, c0, c1,
                              panels.data() + t * detail::kPanelRows * in);
          }
        });
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t o = 0; o < out; ++o) {
            double ref = 0, mag = 0;
            for (std::size_t c = 0; c < in; ++c) {
              // GEMV with bf16 weights rounds x; the GEMM widens the weights and keeps x.
              const float xv = (n == 1 && !std::is_same_v<W, float>)
                                   ? static_cast<float>(bf16(x[i * in + c]))
                                   : x[i * in + c];
              const double p = static_cast<double>(static_cast<float>(w[o * in + c])) * xv;
              ref += p;
              mag += std::abs(p);
            }
            const float got = y[i * out + o];
            EXPECT_LE(std::abs(got - ref), static_cast<double>(in) * 0x1p-24 * mag)
                << "n " << n << " out " << out << " threads " << threads;
            if (n == 1) {
              EXPECT_EQ(got, one[o]) << "out " << out << " threads " << threads;
            }
          }
      }
    }
}

TEST(KernelsTest, LinearF32AtOneTwoThreeThreads) { check_linear<float>(); }
TEST(KernelsTest, LinearBf16AtOneTwoThreeThreads) { check_linear<bf16>(); }

TEST(KernelsTest, LinearLargeGemvSplitsAcrossPoolBitIdentically) {
  const std::size_t in = 333, out = 1001;  // above kMinParallelWeights, odd sizes
  static_assert(333 * 1001 >= detail::kMinParallelWeights);
  const auto w = random_vector<float>(out * in, 8);
  const auto x = random_vector<float>(in, 9);
  std::vector<float> one(out), three(out);
  detail::linear(one.data(), x.data(), w.data(), 1, in, out, nullptr, nullptr, 0);
  ThreadPool pool(3);
  detail::linear(three.data(), x.data(), w.data(), 1, in, out, &pool, nullptr, 0);
  EXPECT_EQ(one, three);
}

TEST(ThreadPoolTest, RunsEveryIndexOnceAndPropagatesErrors) {
  for (const std::size_t threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int round = 0; round < 200; ++round) {  // many regions: wake-up and completion races
      std::vector<std::atomic<int>> hits(threads);
      pool.run([&](std::size_t i) { hits[i].fetch_add(1); });
      for (std::size_t i = 0; i < threads; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
    }
    EXPECT_THROW(pool.run([&](std::size_t i) {
      if (i == threads - 1) throw std::runtime_error("boom");
    }),
                 std::runtime_error);
    int after = 0;
    pool.run([&](std::size_t i) {
      if (i == 0) after = 1;
    });
    EXPECT_EQ(after, 1);  // the pool still works after an error
  }
}

TEST(ThreadPoolTest, ShareCoversTheRangeOnAlignedBoundaries) {
  for (const std::size_t count : {0, 1, 15, 16, 17, 100, 32000})
    for (const std::size_t parts : {1, 2, 3, 7}) {
      std::size_t expected_begin = 0;
      for (std::size_t p = 0; p < parts; ++p) {
        const auto [b, e] = ThreadPool::share(count, parts, p, 16);
        EXPECT_EQ(b, expected_begin);
        EXPECT_LE(b, e);
        if (e != count) {
          EXPECT_EQ(e % 16, 0u);
        }
        expected_begin = e;
      }
      EXPECT_EQ(expected_begin, count);
    }
}

TEST(Bf16Test, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(static_cast<float>(bf16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(bf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even significand (1).
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);  // tie → even upward
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  detail::SplitMix64 rng(3);
  for (int i = 0; i < 10000; ++i) {  // relative error ≤ 2^-8 for normal values
    const auto v = static_cast<float>(rng.symmetric() * 1e3);
    if (v == 0) continue;
    EXPECT_LE(std::abs(static_cast<float>(bf16(v)) - v), 0x1p-8 * std::abs(v)) << v;
  }
}

// Attention split across kv heads gives bit-identical outputs: each head's arithmetic is the
// same on any thread. Long enough (and with GQA) to pass kMinParallelAttention.
TEST(KernelsTest, ThreadedAttentionEqualsSingleThreaded) {
  ModelConfig cfg = testing_util::small_config(8, 2, 600);
  const std::size_t dim = static_cast<std::size_t>(cfg.dim);
  const std::size_t kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  ContiguousStore<float> store(cfg);
  const std::size_t len = 520, n = 4;
  const std::vector<std::int32_t> ids(len, 0);
  store.begin_append(ids);
  for (std::size_t l = 0; l < store.n_layers(); ++l)
    for (std::size_t p = 0; p < len; ++p) {
      const auto k = random_vector<float>(kv_dim, 100 * l + 2 * p);
      const auto v = random_vector<float>(kv_dim, 100 * l + 2 * p + 1);
      store.write(l, p, k.data(), v.data());
    }
  const auto q = random_vector<float>(n * dim, 4);
  AttentionScratch<float> one(cfg, n, 0);
  std::vector<float> out1(n * dim), out3(n * dim);
  attend(cfg, store, 1, len - n, n, q.data(), out1.data(), one);
  ThreadPool pool(3);
  AttentionScratch<float> three(cfg, n, 0, 3);
  attend(cfg, store, 1, len - n, n, q.data(), out3.data(), three, &pool);
  EXPECT_EQ(out1, out3);
  ThreadPool four(4);
  EXPECT_THROW(attend(cfg, store, 1, len - n, n, q.data(), out3.data(), three, &four), Error);
}

}  // namespace
}  // namespace kvdecode
