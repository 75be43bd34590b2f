// Block-quantized weights (Q8_0, Q4_0): the binary16 scale, ggml's block layouts and formulas
// written out here, the integer kernels of every kernel set against a double-precision sum with
// a bound derived from the formats, and the model on such weights (widths, stored blocks,
// batches, decode against the f32 model of the same weights).
//
// Kernel bound, per output row r and token: the kernel computes Σ_b dw_b·dx_b·Σ_j qw_j·qx_j with
// exact integer inner sums, where x_j = qx_j·dx_b + e_j, |e_j| ≤ dx_b / 2 (nearest rounding,
// dx_b = max|x in block b| / 127). Against the exact Σ_j ŵ_j·x_j (ŵ the dequantized weights):
//   |y − exact| ≤ Σ_b (dx_b / 2)·Σ_j |ŵ_j|   (activation rounding)
//               + γ_{nb+2}·Σ_b |dw_b·dx_b·Σ_j qw_j·qx_j|   (f32: one product, nb sums; Higham §3.1)
// with γ_k = k·2^-24 / (1 − k·2^-24); the test adds 1 % to γ and nothing else. Against the
// double sum of the same quantized products (the second term alone) only the f32 rounding is
// left. Every set, batch size and row range forms each output by the same operations (one scale
// product and one fma per block, in block order), so the sets agree bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvdecode/detail/linear.hpp"
#include "kvdecode/detail/qgemv.hpp"
#include "kvdecode/detail/row_groups.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

// ---------------------------------------------------------------------------------------------
// binary16
// ---------------------------------------------------------------------------------------------

TEST(WeightBlocksTest, HalfConversionKnownValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_f16(0.1f), 0x2E66);             // 0.0999755859375
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);         // the largest half
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);         // below the halfway point to 65536
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);         // the halfway point rounds to even: inf
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);         // the smallest subnormal
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);         // halfway to 0: even
  EXPECT_EQ(float_to_f16(0x3p-25f), 0x0002);         // 1.5 units: even
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);         // the smallest normal
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f), 0x3C00);  // a tie between 1 and 1 + 2^-10: even
  EXPECT_EQ(float_to_f16(1.0f + 0x3p-11f), 0x3C02);  // a tie between 1 + 2^-10 and 1 + 2^-9
  EXPECT_EQ(float_to_f16(INFINITY), 0x7C00);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(NAN))));
  EXPECT_EQ(f16_to_float(0x3555), 0x1.554p-2f);  // 0.333251953125
  EXPECT_EQ(f16_to_float(0x8001), -0x1p-24f);
}

TEST(WeightBlocksTest, HalfRoundTripsEveryHalf) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = f16_to_float(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_f16(f), bits) << std::hex << h;
  }
}

// ---------------------------------------------------------------------------------------------
// Block layout and formulas (ggml's block_q8_0 / block_q4_0).
// ---------------------------------------------------------------------------------------------

TEST(WeightBlocksTest, LayoutIsGgmls) {
  EXPECT_EQ(sizeof(Q8_0), 34u);
  EXPECT_EQ(offsetof(Q8_0, d), 0u);
  EXPECT_EQ(offsetof(Q8_0, qs), 2u);
  EXPECT_EQ(sizeof(Q4_0), 18u);
  EXPECT_EQ(offsetof(Q4_0, d), 0u);
  EXPECT_EQ(offsetof(Q4_0, qs), 2u);
}

TEST(WeightBlocksTest, Q4DequantizesLowNibblesFirst) {
  Q4_0 b{};
  b.d = float_to_f16(0.5f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  float x[32];
  dequantize_row(&b, x, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(x[j], static_cast<float>(j - 8) * 0.5f) << j;
    EXPECT_EQ(x[j + 16], static_cast<float>(15 - j - 8) * 0.5f) << j;
  }
}

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  detail::SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& e : v) e = static_cast<float>(scale * rng.symmetric());
  return v;
}

// q8_0: codes = round(x / d) with d = max|x| / 127; |x − q·d̂| ≤ d/2 + 127·|d − d̂|, d̂ the
// binary16 scale (|d − d̂| ≤ d·2^-11).
TEST(WeightBlocksTest, Q8QuantizesByTheFormula) {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    const auto x = random_floats(32, seed, static_cast<double>(seed) * 0.37);
    double amax = 0;
    for (float v : x) amax = std::max(amax, std::abs(static_cast<double>(v)));
    const double d = amax / 127;
    const Q8_0 b = quantize_block_q8_0(x.data());
    const double dh = f16_to_float(b.d);
    EXPECT_LE(std::abs(dh - d), d * 0x1p-11);
    float back[32];
    dequantize_row(&b, back, 32);
    for (int j = 0; j < 32; ++j) {
      EXPECT_EQ(b.qs[j], static_cast<int>(std::round(x[j] / d))) << seed << " " << j;
      EXPECT_LE(std::abs(back[j] - x[j]), d / 2 + 127 * std::abs(dh - d) + 1e-7 * amax);
    }
  }
}

// Blocks at the edges of f32: a block of subnormals (d = max|x| / 127 is subnormal, so 1/d
// overflows to infinity) and blocks holding an infinity or a NaN. Codes stay in ggml's range
// (q8_0 never -128) and the subnormal block gives back 0 everywhere (its binary16 scale is 0).
// (clang's UBSan, in the fuzz preset, reports a code converted from an out-of-range float: the
// fuzz corpus holds the GGUF file that found it, fuzz/corpus/gguf/subnormal_block_q8_0.gguf.)
TEST(WeightBlocksTest, QuantizesSubnormalAndNonFiniteBlocks) {
  std::array<float, 32> tiny{};
  for (std::size_t j = 0; j < tiny.size(); ++j)
    tiny[j] = std::numeric_limits<float>::denorm_min() * static_cast<float>(j % 2 ? 7 : -3);
  std::array<float, 32> with_inf{};
  with_inf.fill(0.5f);
  with_inf[3] = std::numeric_limits<float>::infinity();
  std::array<float, 32> with_nan{};
  with_nan.fill(-0.25f);
  with_nan[7] = std::numeric_limits<float>::quiet_NaN();
  for (const auto* x : {&tiny, &with_inf, &with_nan}) {
    float back[32];
    const Q8_0 b8 = quantize_block_q8_0(x->data());
    dequantize_row(&b8, back, 32);
    for (int j = 0; j < 32; ++j) {
      EXPECT_NE(b8.qs[j], -128) << j;
      if (x == &tiny) {
        EXPECT_EQ(back[j], 0.0f) << j;
      }
    }
    const Q4_0 b4 = quantize_block_q4_0(x->data());
    dequantize_row(&b4, back, 32);
    if (x == &tiny) {
      for (int j = 0; j < 32; ++j) EXPECT_EQ(back[j], 0.0f) << j;
    }
  }
}

// q4_0: the value m of largest magnitude maps to code 0 (d = m / −8); codes round to nearest
// except at the far end, clamped to 15: error ≤ |d|/2 where x/d + 8 ≤ 15.5, else ≤ |d|, plus
// 8·|d − d̂| for the binary16 scale.
TEST(WeightBlocksTest, Q4QuantizesByTheFormula) {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    const auto x = random_floats(32, seed + 100, static_cast<double>(seed) * 0.37);
    double m = 0;
    for (float v : x)
      if (std::abs(v) > std::abs(m)) m = v;
    const double d = m / -8;
    const Q4_0 b = quantize_block_q4_0(x.data());
    const double dh = f16_to_float(b.d);
    float back[32];
    dequantize_row(&b, back, 32);
    for (int j = 0; j < 32; ++j) {
      const double code = x[j] / d + 8;
      const double bound = (code <= 15.5 ? std::abs(d) / 2 : std::abs(d)) + 8 * std::abs(dh - d) +
                           1e-7 * std::abs(m);
      EXPECT_LE(std::abs(back[j] - x[j]), bound) << seed << " " << j;
    }
    EXPECT_EQ(back[std::distance(x.begin(), std::find(x.begin(), x.end(), static_cast<float>(m)))],
              static_cast<float>(-8 * dh));
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels, every set.
// ---------------------------------------------------------------------------------------------

class QuantKernelTest : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << kernel_set_name(GetParam()) << " kernels";
  }
  KernelSet ks() const { return GetParam(); }
};

/// w [rows][nb] as stored → the kernels' row-group layout (a copy).
template <class B>
std::vector<B> repacked(const std::vector<B>& w, std::size_t rows, std::size_t nb) {
  std::vector<B> r = w;
  std::vector<B> scratch;
  detail::repack_row_groups(r.data(), rows, nb, scratch);
  return r;
}

/// The outputs of every (row range, token count) split of one random matrix, checked against
/// the bounds at the top of this file: ranges [0, rows) at once and split off the group grid
/// (rows / 2, as two threads might), every token alone (bit for bit the batched output).
/// Returns the outputs of the whole call for cross-set checks.
template <class B>
std::vector<float> check_kernel(KernelSet ks, std::size_t rows, std::size_t cols, std::size_t n,
                                std::uint64_t seed) {
  const std::size_t nb = cols / kWeightBlock;
  const auto wf = random_floats(rows * cols, seed, 0.2);
  std::vector<B> w(rows * nb);
  quantize_row(wf.data(), w.data(), rows * cols);
  std::vector<float> wd(rows * cols);
  dequantize_row(w.data(), wd.data(), rows * cols);
  std::vector<std::int8_t> qw(rows * cols);  // the signed codes, from the formulas
  for (std::size_t i = 0; i < rows * cols; ++i) {
    const B& blk = w[i / kWeightBlock];
    const std::size_t j = i % kWeightBlock;
    if constexpr (std::is_same_v<B, Q8_0>) {
      qw[i] = blk.qs[j];
    } else {
      qw[i] = static_cast<std::int8_t>((j < 16 ? blk.qs[j] & 15 : blk.qs[j - 16] >> 4) - 8);
    }
  }
  const std::vector<B> wr = repacked(w, rows, nb);
  // Activations with a wide dynamic range between blocks, and one all-zero block.
  auto x = random_floats(n * cols, seed + 7, 3.0);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] *= static_cast<float>(1 + (i / kWeightBlock) % 5);
  std::fill_n(x.begin(), kWeightBlock, 0.0f);
  std::vector<std::int8_t> xc(n * cols);
  std::vector<float> xs(n * nb);
  std::vector<std::int32_t> xsum(n * nb);
  detail::quantize_activations(ks, x.data(), n, cols, xc.data(), xs.data(), xsum.data());
  for (std::size_t b = 0; b < xsum.size(); ++b) {  // the sums' definition
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < kWeightBlock; ++j) sum += xc[b * kWeightBlock + j];
    EXPECT_EQ(xsum[b], sum) << b;
  }

  std::vector<float> y(n * rows, -1.0f);
  detail::qgemm_rows(ks, y.data(), wr.data(), xc.data(), xs.data(), xsum.data(), n, cols, rows, 0,
                     rows);
  std::vector<float> ys(n * rows, -1.0f);
  const std::size_t mid = rows / 2;
  detail::qgemm_rows(ks, ys.data(), wr.data(), xc.data(), xs.data(), xsum.data(), n, cols, rows, 0,
                     mid);
  detail::qgemm_rows(ks, ys.data(), wr.data(), xc.data(), xs.data(), xsum.data(), n, cols, rows,
                     mid, rows);
  EXPECT_EQ(std::memcmp(ys.data(), y.data(), y.size() * sizeof(float)), 0) << "split at " << mid;
  std::vector<float> y1(rows);
  const double k = static_cast<double>(nb + 2) * 0x1p-24;
  const double gamma = 1.01 * k / (1 - k);
  for (std::size_t t = 0; t < n; ++t) {
    detail::qgemm_rows(ks, y1.data(), wr.data(), xc.data() + t * cols, xs.data() + t * nb,
                       xsum.data() + t * nb, 1, cols, rows, 0, rows);
    for (std::size_t r = 0; r < rows; ++r) {
      EXPECT_EQ(std::memcmp(&y1[r], &y[t * rows + r], sizeof(float)), 0)
          << "token " << t << " row " << r;
      double exact = 0;
      double act = 0;
      double quantized = 0;  // Σ_b dw·dx·Σ qw·qx in double
      double mag = 0;
      for (std::size_t b = 0; b < nb; ++b) {
        double ints = 0;
        for (std::size_t j = 0; j < kWeightBlock; ++j) {
          const std::size_t c = b * kWeightBlock + j;
          exact += static_cast<double>(wd[r * cols + c]) * x[t * cols + c];
          act += std::abs(static_cast<double>(wd[r * cols + c])) * xs[t * nb + b] / 2;
          ints += static_cast<double>(qw[r * cols + c]) * xc[t * cols + c];
        }
        const double block = ints * f16_to_float(w[r * nb + b].d) * xs[t * nb + b];
        quantized += block;
        mag += std::abs(block);
      }
      const auto where = [&] {
        return std::string(kernel_set_name(ks)) + " " + block_format_name<B>() + " rows " +
               std::to_string(rows) + " cols " + std::to_string(cols) + " token " +
               std::to_string(t) + " row " + std::to_string(r);
      };
      EXPECT_LE(std::abs(y[t * rows + r] - quantized), gamma * mag) << where();
      EXPECT_LE(std::abs(y[t * rows + r] - exact), act + gamma * mag) << where();
    }
  }
  return y;
}

// Rows below, at and past whole groups of 8 (tails of 1..7 rows; one, two and three groups, so
// pairs of groups and a group left over), token counts covering the VNNI tiles of 8, 4, 2 and 1,
// and widths from one block up.
TEST_P(QuantKernelTest, Q8MatchesQuantizedProductsWithinBound) {
  for (const std::size_t rows : {1, 3, 8, 17, 24, 39})
    for (const std::size_t cols : {32, 64, 96, 288, 800})
      for (const std::size_t n : {1, 2, 7, 15})
        check_kernel<Q8_0>(ks(), rows, cols, n, rows * cols + n);
}

TEST_P(QuantKernelTest, Q4MatchesQuantizedProductsWithinBound) {
  for (const std::size_t rows : {1, 3, 8, 17, 24, 39})
    for (const std::size_t cols : {32, 64, 96, 288, 800})
      for (const std::size_t n : {1, 2, 7, 15})
        check_kernel<Q4_0>(ks(), rows, cols, n, rows * cols + n);
}

// The input's quantization by the formula: d = max|x| / 127 in f32, codes = x · (127 / max|x|)
// rounded to nearest, ties to even, clamped to ±127; an all-zero block gets d = 0 and codes 0; a
// block holding an infinity or a NaN gets d = NaN, codes 0 and sum 0.
TEST_P(QuantKernelTest, ActivationsQuantizeByTheFormula) {
  const std::size_t in = 32 * 7, n = 3, nb = in / kWeightBlock;
  auto x = random_floats(n * in, 5, 4.0);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] *= static_cast<float>(1 + (i / 32) % 6);
  std::fill_n(x.begin() + 32, 32, 0.0f);  // block 1: zero
  x[2 * 32 + 5] = INFINITY;               // block 2: an infinity
  x[3 * 32 + 9] = std::nanf("");          // block 3: a NaN
  for (std::size_t j = 0; j < 32; ++j)    // block 4: max 127, ties at ±k.5
    x[4 * 32 + j] =
        j == 0 ? 127.0f
               : static_cast<float>(j % 2 == 0 ? 1 : -1) * (static_cast<float>(j) * 0.5f + 0.5f);
  std::vector<std::int8_t> xc(n * in, 99);
  std::vector<float> xs(n * nb, -1.0f);
  std::vector<std::int32_t> xsum(n * nb, -1);
  detail::quantize_activations(ks(), x.data(), n, in, xc.data(), xs.data(), xsum.data());
  for (std::size_t b = 0; b < n * nb; ++b) {
    float amax = 0;
    bool finite = true;
    for (std::size_t j = 0; j < 32; ++j) {
      finite = finite && std::isfinite(x[b * 32 + j]);
      if (std::isfinite(x[b * 32 + j])) amax = std::max(amax, std::abs(x[b * 32 + j]));
    }
    if (!finite) {
      EXPECT_TRUE(std::isnan(xs[b])) << b;
      EXPECT_EQ(xsum[b], 0) << b;
      for (std::size_t j = 0; j < 32; ++j) EXPECT_EQ(xc[b * 32 + j], 0) << b << " " << j;
      continue;
    }
    EXPECT_EQ(xs[b], amax / 127.0f) << b;
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < 32; ++j) {
      const float v = amax == 0 ? 0.0f : x[b * 32 + j] * (127.0f / amax);
      double want = std::floor(static_cast<double>(v));
      const double frac = static_cast<double>(v) - want;
      if (frac > 0.5 || (frac == 0.5 && std::fmod(want, 2.0) != 0)) want += 1;  // ties to even
      want = std::clamp(want, -127.0, 127.0);
      EXPECT_EQ(xc[b * 32 + j], static_cast<std::int8_t>(want)) << b << " " << j;
      sum += static_cast<std::int32_t>(want);
    }
    EXPECT_EQ(xsum[b], sum) << b;
  }
}

// Prefill sizes: more tokens than one pass over the groups takes (2048 columns: 32 tokens per
// pass), so tokens run in several passes and tiles.
TEST_P(QuantKernelTest, ManyTokensMatchWithinBound) {
  check_kernel<Q8_0>(ks(), 21, 2048, 37, 11);
  check_kernel<Q4_0>(ks(), 21, 2048, 37, 12);
}

// Extreme codes: q8 weights of −128 (a stored file may hold them) and 127 against inputs of
// ±127 make the largest maddubs pair sums; the integer sums must still be exact, in the groups
// (rows 0..7) and in the row after them.
TEST_P(QuantKernelTest, ExtremeCodesSumExactly) {
  const std::size_t cols = 64, rows = 9;
  std::vector<Q8_0> w(rows * 2);
  for (Q8_0& b : w) {
    b.d = float_to_f16(1.0f);
    for (int j = 0; j < 32; ++j) b.qs[j] = static_cast<std::int8_t>(j % 2 == 0 ? -128 : 127);
  }
  std::vector<std::int8_t> xc(cols);
  for (std::size_t j = 0; j < cols; ++j) xc[j] = static_cast<std::int8_t>(j % 2 == 0 ? -127 : 127);
  const float xs[2] = {1.0f, 1.0f};
  std::int32_t sums[2] = {0, 0};
  std::vector<float> y(rows);
  detail::qgemm_rows(ks(), y.data(), repacked(w, rows, 2).data(), xc.data(), xs, sums, 1, cols,
                     rows, 0, rows);
  for (std::size_t r = 0; r < rows; ++r) EXPECT_EQ(y[r], 64.0f / 2 * (128.0f * 127 + 127.0f * 127));
  // q4_0 codes 0 and 15 (−8 and +7) against ±127, all products of one sign: the largest q4_0
  // block sums, 16-bit partial sums included (AVX2), the −8 carried by the input's block sums.
  std::vector<Q4_0> w4(rows * 2);
  for (Q4_0& b : w4) {
    b.d = float_to_f16(1.0f);
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j % 2 == 0 ? 0xF0 : 0x0F);
  }
  for (std::size_t e = 0; e < cols; ++e) {  // element e % 32 < 16: low nibble of byte e % 16
    const std::size_t j = e % 32;
    const bool minus8 = j < 16 ? j % 2 == 0 : (j - 16) % 2 == 1;
    xc[e] = static_cast<std::int8_t>(minus8 ? -127 : 127);
  }
  for (std::size_t b = 0; b < 2; ++b) {
    sums[b] = 0;
    for (std::size_t j = 0; j < 32; ++j) sums[b] += xc[b * 32 + j];
  }
  detail::qgemm_rows(ks(), y.data(), repacked(w4, rows, 2).data(), xc.data(), xs, sums, 1, cols,
                     rows, 0, rows);
  for (std::size_t r = 0; r < rows; ++r) EXPECT_EQ(y[r], 2.0f * 16 * (8 * 127 + 7 * 127));
}

// Every set gives the portable kernel's outputs bit for bit: the same integers, scaled and
// added by the same f32 operations.
TEST_P(QuantKernelTest, EqualsPortableBitForBit) {
  for (const std::size_t cols : {32, 160, 2048}) {
    for (const std::size_t n : {1, 6}) {
      const auto p4 = check_kernel<Q4_0>(KernelSet::kPortable, 19, cols, n, cols + n);
      const auto k4 = check_kernel<Q4_0>(ks(), 19, cols, n, cols + n);
      EXPECT_EQ(std::memcmp(p4.data(), k4.data(), p4.size() * sizeof(float)), 0) << "q4_0 " << cols;
      const auto p8 = check_kernel<Q8_0>(KernelSet::kPortable, 19, cols, n, cols + n);
      const auto k8 = check_kernel<Q8_0>(ks(), 19, cols, n, cols + n);
      EXPECT_EQ(std::memcmp(p8.data(), k8.data(), p8.size() * sizeof(float)), 0) << "q8_0 " << cols;
    }
  }
}

// The repacked layout holds every block: read back, each is the stored one byte for byte, and
// the rows past the last whole group are untouched.
TEST(RowGroupsTest, RepackedBlocksReadBackAsStored) {
  for (const std::size_t rows : {1, 8, 13, 32}) {
    const std::size_t nb = 3;
    const auto wf = random_floats(rows * nb * kWeightBlock, rows, 1.0);
    std::vector<Q8_0> w8(rows * nb);
    std::vector<Q4_0> w4(rows * nb);
    quantize_row(wf.data(), w8.data(), wf.size());
    quantize_row(wf.data(), w4.data(), wf.size());
    const auto r8 = repacked(w8, rows, nb);
    const auto r4 = repacked(w4, rows, nb);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t b = 0; b < nb; ++b) {
        const Q8_0 a8 = detail::repacked_block(r8.data(), rows, nb, r, b);
        const Q4_0 a4 = detail::repacked_block(r4.data(), rows, nb, r, b);
        EXPECT_EQ(std::memcmp(&a8, &w8[r * nb + b], sizeof a8), 0) << rows << " " << r << " " << b;
        EXPECT_EQ(std::memcmp(&a4, &w4[r * nb + b], sizeof a4), 0) << rows << " " << r << " " << b;
      }
    }
    const std::size_t kept = rows / 8 * 8 * nb;
    EXPECT_EQ(std::memcmp(r8.data() + kept, w8.data() + kept, (w8.size() - kept) * sizeof(Q8_0)),
              0);
    if (rows >= 8) {
      EXPECT_NE(std::memcmp(r8.data(), w8.data(), 8 * nb * sizeof(Q8_0)), 0);
    }
  }
}

// The projection scheduler at 1, 2 and 3 threads: the same outputs bit for bit.
TEST_P(QuantKernelTest, LinearGroupThreadsAgree) {
  force_kernel_set(ks());
  const std::size_t in = 256;
  const std::size_t out = 700;  // above kMinParallelWeights, so the pool runs
  const auto wf = random_floats(out * in, 5, 0.1);
  std::vector<Q4_0> w(out * in / kWeightBlock);
  quantize_row(wf.data(), w.data(), out * in);
  w = repacked(w, out, in / kWeightBlock);
  for (const std::size_t n : {1, 3}) {
    const auto x = random_floats(n * in, 9 + n);
    std::vector<std::int8_t> codes(n * in);
    std::vector<float> scales(n * in / kWeightBlock);
    std::vector<std::int32_t> sums(n * in / kWeightBlock);
    const detail::LinearScratch<float> scratch{nullptr,       0,          nullptr, codes.data(),
                                               scales.data(), sums.data()};
    std::vector<float> y0(n * out);
    detail::linear_group<float, Q4_0>({{y0.data(), w.data(), out}}, x.data(), n, in, nullptr,
                                      scratch, ks());
    for (const std::size_t threads : {2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> y(n * out);
      detail::linear_group<float, Q4_0>({{y.data(), w.data(), out}}, x.data(), n, in, &pool,
                                        scratch, ks());
      EXPECT_EQ(std::memcmp(y.data(), y0.data(), y.size() * sizeof(float)), 0)
          << threads << " threads, " << n << " tokens";
    }
  }
  force_kernel_set(best_kernel_set());
}

INSTANTIATE_TEST_SUITE_P(EverySet, QuantKernelTest, ::testing::ValuesIn(kKernelSets),
                         [](const ::testing::TestParamInfo<KernelSet>& set) {
                           return std::string(kernel_set_name(set.param));
                         });

// ---------------------------------------------------------------------------------------------
// Weights and the model.
// ---------------------------------------------------------------------------------------------

ModelConfig quant_config() {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 160;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 67;
  c.seq_len = 40;
  return c;
}

TEST(QuantizedWeightsTest, WidthNotAMultipleOf32IsAnError) {
  ModelConfig c = quant_config();
  c.hidden_dim = 100;
  try {
    Weights<Q8_0> w(c);
    FAIL() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w2 are hidden_dim = 100"), std::string::npos) << e.what();
  }
  c = quant_config();
  c.dim = 48;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  try {
    Weights<Q4_0> w(c);
    FAIL() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("wq, wk, wv, wo, w1, w3 and wcls are dim = 48"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(Weights<bf16>{c});  // values need no blocks
}

TEST(QuantizedWeightsTest, BytesAreTheBlockSizes) {
  const ModelConfig c = quant_config();
  const Weights<float> f = random_weights<float>(c, 1);
  const Weights<Q8_0> q8 = quantize_weights<Q8_0>(f);
  const Weights<Q4_0> q4 = quantize_weights<Q4_0>(f);
  const std::size_t gains = (2 * 2 + 1) * 64 * 4;
  const std::size_t matrix_weights = (f.bytes() - gains) / 4;
  EXPECT_EQ(q8.bytes(), matrix_weights / 32 * 34 + gains);
  EXPECT_EQ(q4.bytes(), matrix_weights / 32 * 18 + gains);
}

/// The blocks of `from` handed over as raw bytes, tensor by tensor (what a GGUF reader does).
template <class B>
Weights<B> reload_as_bytes(const Weights<B>& from) {
  Weights<B> to(from.config);
  std::vector<std::span<const std::byte>> sources;
  from.for_each_tensor([&](const char*, std::int64_t, const auto& b) {
    sources.push_back(std::as_bytes(b.span()));
  });
  std::size_t i = 0;
  to.for_each_tensor([&](const char* name, std::int64_t layer, auto& b) {
    using Buffer = std::remove_cvref_t<decltype(b)>;
    if constexpr (std::is_same_v<Buffer, AlignedBuffer<B>>) {
      load_blocks(b, sources[i], name, layer);
    } else {
      std::memcpy(b.data(), sources[i].data(), sources[i].size());
    }
    ++i;
  });
  return to;
}

TEST(QuantizedWeightsTest, StoredBlocksLoadAsTheyAre) {
  const ModelConfig c = quant_config();
  const Weights<Q4_0> q4 = quantize_weights<Q4_0>(random_weights<float>(c, 2));
  const Weights<Q4_0> loaded = reload_as_bytes(q4);
  EXPECT_EQ(
      std::memcmp(loaded.layers[1].w2.data(), q4.layers[1].w2.data(), q4.layers[1].w2.bytes()), 0);
  const Model<float, Q4_0> a(quantize_weights<Q4_0>(random_weights<float>(c, 2)));
  const Model<float, Q4_0> b(reload_as_bytes(q4));
  ContiguousStore<float> sa(c), sb(c);
  Activations<float> aa(c), ab(c);
  const auto tokens = testing_util::random_tokens(9, c.vocab_size, 4);
  const auto la = a.prefill(tokens, sa, aa);
  const auto lb = b.prefill(tokens, sb, ab);
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0);

  Weights<Q4_0> target(c);
  const std::vector<std::byte> short_bytes(q4.layers[0].wk.bytes() - 18);
  try {
    load_blocks(target.layers[0].wk, short_bytes, "wk", 0);
    FAIL() << "no Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tensor wk of layer 0 has 1134 bytes of q4_0 blocks, expected 64 blocks of 18 "
                     "= 1152 bytes"),
              std::string::npos)
        << m;
  }
  for (std::size_t i = 0; i < target.layers[0].wk.size(); ++i)
    EXPECT_EQ(target.layers[0].wk[i].d, 0) << "unchanged";
}

/// Logits of a quantized model and of the f32 model of its dequantized weights: the only
/// difference is the input quantization of every projection (half a step of 1/127 of each
/// block's range, ~0.4 % RMS of a projection's input, 15 projections on the way to a logit).
/// The bound on the relative RMS difference of the logits is measured, not derived (the error
/// passes through attention and SwiGLU): 1.2-2.1 % per step on these shapes, worst of 20 steps
/// 3.0 % (q8_0) and 3.7 % (q4_0), the same in every set; the bound is 6 %.
template <class B>
void expect_close_to_dequantized(std::uint64_t seed) {
  const ModelConfig c = quant_config();
  Weights<B> qw = quantize_weights<B>(random_weights<float>(c, seed));
  const Model<float> ref(dequantize_weights(qw));
  const Model<float, B> model(std::move(qw));
  ContiguousStore<float> s_ref(c), s_q(c);
  Activations<float> a_ref(c), a_q(c);
  const auto tokens = testing_util::random_tokens(20, c.vocab_size, seed);
  double worst = 0;
  for (const std::int32_t t : tokens) {
    const auto lr = ref.decode(t, s_ref, a_ref);
    const auto lq = model.decode(t, s_q, a_q);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < lr.size(); ++i) {
      num += (lq[i] - lr[i]) * (lq[i] - lr[i]);
      den += lr[i] * lr[i];
    }
    worst = std::max(worst, std::sqrt(num / den));
  }
  EXPECT_LE(worst, 0.06) << block_format_name<B>() << " " << active_kernel_set_name();
}

TEST(QuantizedModelTest, DecodeNearTheDequantizedF32Model) {
  for (const KernelSet ks : kKernelSets) {
    if (!cpu_supports(ks)) continue;
    force_kernel_set(ks);
    expect_close_to_dequantized<Q8_0>(11);
    expect_close_to_dequantized<Q4_0>(12);
  }
  force_kernel_set(best_kernel_set());
}

// decode_batch with B sequences gives each sequence decode()'s logits bit for bit (the
// projections are the same per-token dot products), and prefill's last logits match decoding
// the prompt token by token within f32 attention differences.
TEST(QuantizedModelTest, BatchAndPrefillAgreeWithDecode) {
  const ModelConfig c = quant_config();
  const Model<float, Q8_0> model(quantize_weights<Q8_0>(random_weights<float>(c, 21)));
  ThreadPool pool(2);
  const auto prompt = testing_util::random_tokens(12, c.vocab_size, 22);
  ContiguousStore<float> one(c);
  Activations<float> act(c, {.max_chunk = 1, .thread_pool = &pool});
  std::span<const float> last;
  for (const std::int32_t t : prompt) last = model.decode(t, one, act);
  const std::vector<float> decoded(last.begin(), last.end());

  ContiguousStore<float> pre(c);
  Activations<float> pact(c, {.max_chunk = 5, .thread_pool = &pool});
  const auto lp = model.prefill(prompt, pre, pact);
  EXPECT_LE(testing_util::max_abs_diff(lp, decoded), 1e-4);

  ContiguousStore<float> a(c), b(c);
  Activations<float> bact(c, {.max_batch = 2, .thread_pool = &pool});
  Activations<float> sact(c, {.thread_pool = &pool});
  ContiguousStore<float> a1(c), b1(c);
  for (std::size_t i = 0; i < 6; ++i) {
    const std::int32_t ta = prompt[i], tb = prompt[11 - i];
    const std::vector<ContiguousStore<float>*> stores = {&a, &b};
    const std::int32_t toks[2] = {ta, tb};
    const auto lb = model.decode_batch(toks, stores, bact);
    const auto la1 = model.decode(ta, a1, sact);
    EXPECT_EQ(std::memcmp(lb.data(), la1.data(), la1.size() * sizeof(float)), 0) << i;
    const auto lb1 = model.decode(tb, b1, sact);
    EXPECT_EQ(std::memcmp(lb.data() + la1.size(), lb1.data(), lb1.size() * sizeof(float)), 0) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Agreement with the f32 model: teacher-forced top-1 agreement and KL(f32 ‖ quantized) per
// position, and how long a greedy continuation stays the f32 model's. The bounds are the
// measured values (docs/QUANTIZATION.md, weights section) with margin, and the figures are
// printed for that table.
// ---------------------------------------------------------------------------------------------

struct Agreement {
  double top1 = 0;     // share of positions whose argmax is the f32 model's
  double mean_kl = 0;  // mean over positions of KL(p_f32 ‖ p_q), nats
  double max_kl = 0;
};

std::vector<double> softmax(std::span<const float> logits) {
  std::vector<double> p(logits.size());
  const double m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp(logits[i] - m);
  for (double& v : p) v /= sum;
  return p;
}

template <class W>
Agreement teacher_forced(const Model<float>& ref, const Model<float, W>& q,
                         std::span<const std::int32_t> tokens) {
  const ModelConfig& c = ref.config();
  ContiguousStore<float> s_ref(c), s_q(c);
  Activations<float> a_ref(c), a_q(c);
  Agreement a;
  for (const std::int32_t t : tokens) {
    const auto lr = ref.decode(t, s_ref, a_ref);
    const auto lq = q.decode(t, s_q, a_q);
    a.top1 += std::max_element(lr.begin(), lr.end()) ==
              lr.begin() + (std::max_element(lq.begin(), lq.end()) - lq.begin());
    const auto pr = softmax(lr);
    const auto pq = softmax(lq);
    double kl = 0;
    for (std::size_t i = 0; i < pr.size(); ++i)
      if (pr[i] > 0) kl += pr[i] * std::log(pr[i] / pq[i]);
    a.mean_kl += kl;
    a.max_kl = std::max(a.max_kl, kl);
  }
  a.top1 /= static_cast<double>(tokens.size());
  a.mean_kl /= static_cast<double>(tokens.size());
  return a;
}

/// Tokens a greedy continuation of n tokens agrees with the f32 model's before the first
/// difference.
template <class B>
std::size_t greedy_prefix(const Model<float>& ref, const Model<float, B>& q,
                          std::span<const std::int32_t> prompt, std::size_t n) {
  const ModelConfig& c = ref.config();
  ContiguousStore<float> s_ref(c), s_q(c);
  Activations<float> a_ref(c), a_q(c);
  auto lr = ref.prefill(prompt, s_ref, a_ref);
  auto lq = q.prefill(prompt, s_q, a_q);
  for (std::size_t i = 0; i < n; ++i) {
    const auto tr = static_cast<std::int32_t>(std::max_element(lr.begin(), lr.end()) - lr.begin());
    const auto tq = static_cast<std::int32_t>(std::max_element(lq.begin(), lq.end()) - lq.begin());
    if (tr != tq) return i;
    lr = ref.decode(tr, s_ref, a_ref);
    lq = q.decode(tq, s_q, a_q);
  }
  return n;
}

constexpr const char* kKjvText =
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face "
    "of the waters. And God said, Let there be light: and there was light. And God saw the light, "
    "that it was good: and God divided the light from the darkness. And God called the light Day, "
    "and the darkness he called Night. And the evening and the morning were the first day. And "
    "God said, Let there be a firmament in the midst of the waters, and let it divide the waters "
    "from the waters.";

constexpr const char* kKjvPrompts[] = {"And it came to pass", "The LORD is my shepherd",
                                       "Blessed are the", "And Jesus said unto them"};

template <class B>
void report_kjv(const Model<float>& ref, const Tokenizer& tok, double min_top1, double max_kl,
                std::size_t min_prefix_sum) {
  Weights<B> qw = quantize_weights<B>(convert_weights<float>(ref.weights()));
  const Model<float> weights_only(dequantize_weights(qw));  // f32 inputs, quantized weights
  const Model<float, B> q(std::move(qw));
  const auto text = tok.encode(kKjvText, true);
  const Agreement a = teacher_forced(ref, q, text);
  const Agreement wo = teacher_forced(ref, weights_only, text);
  std::cout << "kjv_tiny " << block_format_name<B>() << " weights, f32 inputs: top-1 agreement "
            << wo.top1 << ", mean KL " << wo.mean_kl << ", max KL " << wo.max_kl << "\n";
  std::size_t prefix_sum = 0;
  std::cout << "kjv_tiny " << block_format_name<B>() << " (" << active_kernel_set_name()
            << "): teacher-forced " << text.size() << " tokens, top-1 agreement " << a.top1
            << ", mean KL " << a.mean_kl << ", max KL " << a.max_kl << "; greedy 64-token prefix";
  for (const char* p : kKjvPrompts) {
    const std::size_t k = greedy_prefix(ref, q, tok.encode(p, true), 64);
    prefix_sum += k;
    std::cout << " " << k;
  }
  std::cout << "\n";
  EXPECT_GE(a.top1, min_top1);
  EXPECT_LE(a.mean_kl, max_kl);
  EXPECT_GE(prefix_sum, min_prefix_sum);
}

TEST(QuantizedModelTest, KjvAgreementWithF32) {
  const std::filesystem::path models =
      std::filesystem::path(KVDECODE_TEST_DATA_DIR) / ".." / ".." / "models";
  const Model<float> ref(load_checkpoint(models / "kjv_tiny.bin"));
  const Tokenizer tok = Tokenizer::load(models / "tokenizer.bin", ref.config().vocab_size);
  report_kjv<Q8_0>(ref, tok, 0.95, 0.002, 100);
  report_kjv<Q4_0>(ref, tok, 0.8, 0.06, 10);
}

template <class B>
void report_random(const ModelConfig& c, const char* name) {
  const Weights<float> w = random_weights<float>(c, 5);
  const Model<float, B> q(quantize_weights<B>(w));
  const Model<float> ref(convert_weights<float>(w));
  const auto tokens = testing_util::random_tokens(32, c.vocab_size, 6);
  const Agreement a = teacher_forced(ref, q, tokens);
  const Agreement wo =
      teacher_forced(ref, Model<float>(dequantize_weights(quantize_weights<B>(w))), tokens);
  std::cout << name << " random " << block_format_name<B>() << " weights, f32 inputs: top-1 "
            << wo.top1 << ", mean KL " << wo.mean_kl << "\n";
  std::cout << name << " random " << block_format_name<B>() << ": top-1 agreement " << a.top1
            << ", mean KL " << a.mean_kl << ", max KL " << a.max_kl << "\n";
}

TEST(QuantizedModelTest, RandomShapesAgreementReport) {
  report_random<Q8_0>(quant_config(), "dim 64");
  report_random<Q4_0>(quant_config(), "dim 64");
  ModelConfig c15;  // the 15M shape, fewer layers and a smaller vocabulary to stay quick
  c15.dim = 288;
  c15.hidden_dim = 768;
  c15.n_layers = 2;
  c15.n_heads = 6;
  c15.n_kv_heads = 6;
  c15.vocab_size = 512;
  c15.seq_len = 64;
  report_random<Q8_0>(c15, "dim 288");
  report_random<Q4_0>(c15, "dim 288");
}

}  // namespace
}  // namespace kvdecode
