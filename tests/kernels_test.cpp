// The optimised kernels of every kernel set this CPU supports against naive loops written here:
// GEMV (f32, bf16), the few-token GEMMs (gemm_few also against each token's GEMV; gemm_lanes of
// batched steps also against its fma chain and the same token alone), the packed GEMM and its
// panel pack (f32 panels and bf16 pairs), attention's softmax exp, the projection scheduler
// (linear_group) at 1/2/3 threads, SwiGLU, the int8 and 4-bit dequantization, the kernel-set
// choice, the thread pool, bf16 rounding and threaded attention. Odd sizes (columns 1..70 and 95,
// 129, 295; rows not multiples of any block; 1..16 tokens) cover every tail path. A set the CPU
// lacks is skipped by name.
//
// f32 bound: a sum of n products computed in f32 in any order is within γ_n·Σ|w_i x_i| of the
// exact sum, γ_n ≈ n·2^-24 (Higham, Accuracy and Stability, §3.1); the naive loop sums in double.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/f16.hpp"
#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/detail/gemm_lanes.hpp"
#include "kvdecode/detail/gemv.hpp"
#include "kvdecode/detail/linear.hpp"
#include "kvdecode/detail/quantize.hpp"
#include "kvdecode/detail/rotation.hpp"
#include "kvdecode/detail/softmax_exp.hpp"
#include "kvdecode/detail/swiglu.hpp"
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

// Columns 1..70 (every tail of 8-, 16-, 32- and 64-column steps) and a few longer odd rows.
std::vector<std::size_t> odd_cols() {
  std::vector<std::size_t> c;
  for (std::size_t i = 1; i <= 70; ++i) c.push_back(i);
  for (const std::size_t i : {95, 129, 295}) c.push_back(i);
  return c;
}
const std::vector<std::size_t> kRows = {1, 3, 17, 33};

/// Each test runs once per kernel set; a set this CPU cannot run is skipped, by name.
class KernelSetTest : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << kernel_set_name(GetParam()) << " kernels";
  }
  KernelSet ks() const { return GetParam(); }
};

double x_exact(float v) { return static_cast<double>(v); }
double x_bf16(float v) { return static_cast<double>(static_cast<float>(bf16(v))); }

TEST_P(KernelSetTest, GemvF32MatchesNaive) {
  for (const std::size_t rows : kRows)
    for (const std::size_t cols : odd_cols()) {
      const auto w = random_vector<float>(rows * cols, rows * 1000 + cols);
      const auto x = random_vector<float>(cols, cols);
      std::vector<double> ref, mag;
      naive_gemv(w, x, rows, cols, x_exact, ref, mag);
      std::vector<float> y(rows, std::numeric_limits<float>::quiet_NaN());
      detail::gemv_rows(ks(), y.data(), w.data(), x.data(), 0, rows, cols);
      for (std::size_t r = 0; r < rows; ++r)
        ASSERT_LE(std::abs(y[r] - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
            << rows << "×" << cols << " row " << r;
    }
}

TEST_P(KernelSetTest, GemmFewMatchesNaiveAndEachTokensGemv) {
  for (std::size_t n = 1; n <= detail::kMaxFewTokens; ++n)
    for (const std::size_t rows : {1, 2, 3, 17})
      for (const std::size_t cols : {1, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 95, 129, 295}) {
        const auto w = random_vector<float>(rows * cols, rows * 1000 + cols);
        const auto x = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        // Columns [1, rows) only when rows > 1: the slice a thread gets; column 0 stays NaN.
        const std::size_t c0 = rows > 1 ? 1 : 0;
        std::vector<float> y(n * rows, std::numeric_limits<float>::quiet_NaN());  // [n][rows]
        detail::gemm_few(ks(), y.data(), x.data(), w.data(), n, cols, rows, c0, rows,
                         static_cast<float*>(nullptr));
        for (std::size_t t = 0; t < n; ++t) {
          const std::vector<float> xt(x.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                      x.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
          std::vector<double> ref, mag;
          naive_gemv(w, xt, rows, cols, x_exact, ref, mag);
          std::vector<float> gemv(rows);
          detail::gemv_rows(ks(), gemv.data(), w.data(), xt.data(), 0, rows, cols);
          for (std::size_t r = 0; r < rows; ++r) {
            const float got = y[t * rows + r];
            if (r < c0) {
              ASSERT_TRUE(std::isnan(got)) << "column outside the slice was written";
              continue;
            }
            ASSERT_LE(std::abs(got - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
                << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
            // With a few-token kernel a token's outputs are its GEMV's, bit for bit.
            if (detail::has_gemm_few<float, float>(ks())) {
              ASSERT_EQ(got, gemv[r]) << n << " tokens " << rows << "×" << cols << " token " << t;
            }
          }
        }
      }
}

// bf16 weights: gemm_few over x rounded once (as linear_group passes it) gives each token's
// GEMV (which rounds x itself) bit for bit, in every set, and the naive loop's value within the
// f32 bound; inputs longer than kMaxStackCols compare against the GEMV that rounds in its loop.
TEST_P(KernelSetTest, GemmFewBf16EqualsEachTokensGemv) {
  for (std::size_t n = 1; n <= detail::kMaxFewTokens; ++n)
    for (const std::size_t rows : {1, 2, 3, 17})
      for (const std::size_t cols :
           {std::size_t{1}, std::size_t{9}, std::size_t{17}, std::size_t{33}, std::size_t{63},
            std::size_t{65}, std::size_t{95}, std::size_t{129}, detail::kMaxStackCols + 37}) {
        if (cols > detail::kMaxStackCols && (n > 3 || rows > 3)) continue;
        const auto w = random_vector<bf16>(rows * cols, rows * 1000 + cols);
        const auto x = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        std::vector<float> xr(n * cols);
        detail::round_to_bf16(x.data(), xr.data(), n * cols);
        std::vector<float> y(n * rows);  // [n][rows]
        detail::gemm_few(ks(), y.data(), xr.data(), w.data(), n, cols, rows, 0, rows,
                         static_cast<float*>(nullptr));
        for (std::size_t t = 0; t < n; ++t) {
          const std::vector<float> xt(x.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                      x.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
          std::vector<double> ref, mag;
          naive_gemv(w, xt, rows, cols, x_bf16, ref, mag);
          std::vector<float> gemv(rows);
          detail::gemv_rows(ks(), gemv.data(), w.data(), xt.data(), 0, rows, cols);
          for (std::size_t r = 0; r < rows; ++r) {
            ASSERT_EQ(y[t * rows + r], gemv[r]) << n << " tokens " << rows << "×" << cols;
            ASSERT_LE(std::abs(gemv[r] - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r]);
          }
        }
      }
}

// gemm_packed (prefill-sized projections where Eigen is narrower than the set): every output
// within the f32 bound of a sum of `cols` products, f32 and bf16 weights (x rounded as
// linear_group passes it), on a thread's slice of rows that spans panels and their tails (last
// panels of 1, 16, 32, 39 and 64 rows: each tile width), tokens in tiles and their tails;
// columns outside the slice are not written.
template <class W>
void check_gemm_packed(KernelSet ks) {
  for (const std::size_t n : {17, 18, 23, 64})
    for (const std::size_t rows : {1, 17, 40, 64, 65, 97, 130})
      for (const std::size_t cols : {1, 9, 16, 33, 129, 295}) {
        const auto w = random_vector<W>(rows * cols, rows * 1000 + cols);
        auto x = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        if constexpr (!std::is_same_v<W, float>)
          detail::round_to_bf16(x.data(), x.data(), x.size());
        const std::size_t c0 = rows > 1 ? 1 : 0;
        AlignedBuffer<float> panel(detail::kPanelRows * cols);
        std::vector<float> y(n * rows, std::numeric_limits<float>::quiet_NaN());  // [n][rows]
        detail::gemm_packed(ks, y.data(), x.data(), w.data(), n, cols, rows, c0, rows,
                            panel.data());
        for (std::size_t t = 0; t < n; ++t) {
          const std::vector<float> xt(x.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                      x.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
          std::vector<double> ref, mag;
          naive_gemv(w, xt, rows, cols, x_exact, ref, mag);
          for (std::size_t r = 0; r < rows; ++r) {
            const float got = y[t * rows + r];
            if (r < c0) {
              ASSERT_TRUE(std::isnan(got)) << "column outside the slice was written";
              continue;
            }
            ASSERT_LE(std::abs(got - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
                << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
          }
        }
      }
}

/// The lane kernel's order, written out: one f32 fma chain over k in order from zero.
template <class W>
float fma_chain(const W* w, const float* x, std::size_t cols) {
  float s = 0;
  for (std::size_t c = 0; c < cols; ++c) s = std::fma(static_cast<float>(w[c]), x[c], s);
  return s;
}

/// gemm_lanes over rows [1, rows) of every token count: each output within the f32 bound of the
/// naive loop and equal bit for bit to the same token run alone (a sequence's outputs do not
/// depend on its batch); with a lane kernel and without vdpbf16ps (whose pair sums have their
/// own order) also to fma_chain, the order the header promises. Rows 1..97 cover tiles of 64,
/// 32 and 16 rows and their tails; columns past 256 cover several transposed chunks. With a
/// panel, f32 weights on AVX-512 take the token-lane tiles from kTokenLanesMin tokens and bf16
/// weights in avx512bf16 from kTokenPairLanesMin (the token run alone, without a panel, takes the
/// weight-lane tiles: the two agree bit for bit); odd column counts take the bf16 token tiles'
/// lone last column.
template <class W>
void check_gemm_lanes(KernelSet ks, bool with_panel) {
  const bool chain = detail::has_gemm_lanes<float, W>(ks) &&
                     !(std::is_same_v<W, bf16> && ks == KernelSet::kAvx512Bf16);
  for (std::size_t n = 1; n <= detail::kMaxFewTokens; ++n)
    for (const std::size_t rows : {2, 17, 33, 66, 97})
      for (const std::size_t cols : {1, 7, 16, 17, 31, 33, 65, 129, 295, 600}) {
        const auto w = random_vector<W>(rows * cols, rows * 1000 + cols);
        const auto x0 = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        std::vector<float> x(n * cols);  // as linear_group passes it: rounded for bf16 weights
        if constexpr (std::is_same_v<W, bf16>) {
          detail::round_to_bf16(x0.data(), x.data(), n * cols);
        } else {
          x = x0;
        }
        std::vector<float> y(n * rows, std::numeric_limits<float>::quiet_NaN());  // [n][rows]
        std::vector<float> panel(with_panel ? detail::kPanelRows * cols : 0);
        detail::gemm_lanes(ks, y.data(), x.data(), w.data(), n, cols, rows, 1, rows,
                           with_panel ? panel.data() : nullptr);
        for (std::size_t t = 0; t < n; ++t) {
          const float* xt = x.data() + t * cols;
          std::vector<double> ref, mag;
          naive_gemv(w, std::vector<float>(xt, xt + cols), rows, cols, x_exact, ref, mag);
          std::vector<float> alone(rows, std::numeric_limits<float>::quiet_NaN());
          detail::gemm_lanes(ks, alone.data(), xt, w.data(), 1, cols, rows, 1, rows,
                             static_cast<float*>(nullptr));
          ASSERT_TRUE(std::isnan(y[t * rows])) << "row outside the slice was written";
          for (std::size_t r = 1; r < rows; ++r) {
            const float got = y[t * rows + r];
            ASSERT_LE(std::abs(got - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
                << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
            if (detail::has_gemm_lanes<float, W>(ks)) {
              ASSERT_EQ(got, alone[r]) << n << " tokens " << rows << "×" << cols << " token " << t;
            }
            if (chain) {
              ASSERT_EQ(got, fma_chain(w.data() + r * cols, xt, cols))
                  << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
            }
          }
        }
      }
}

TEST_P(KernelSetTest, GemmLanesIsOneFmaChainPerOutputWhateverTheBatch) {
  check_gemm_lanes<float>(ks(), /*with_panel=*/false);
}

TEST_P(KernelSetTest, GemmLanesTokenTilesAreTheSameChains) {
  check_gemm_lanes<float>(ks(), /*with_panel=*/true);
}

TEST_P(KernelSetTest, GemmLanesBf16IsBatchIndependent) {
  check_gemm_lanes<bf16>(ks(), /*with_panel=*/false);
  check_gemm_lanes<bf16>(ks(), /*with_panel=*/true);
}

TEST_P(KernelSetTest, GemmPackedMatchesNaive) {
  if (!detail::has_gemm_packed<float, float>(ks()))
    GTEST_SKIP() << kernel_set_name(ks()) << " has no packed GEMM (Eigen's GEMM serves it)";
  check_gemm_packed<float>(ks());
  check_gemm_packed<bf16>(ks());
}

// gemm_packed_pairs (bf16 weights times x rounded to bf16 rows, a pair of products per
// instruction) as check_gemm_packed checks gemm_packed, against the naive loop over x rounded by
// bf16.hpp: the rows it takes hold bf16(x) and a zero pad (also the AMX path's wider rows, the
// same rounding function), the pair panel holds the weights in pairs, every output is within the
// f32 bound of a sum of `cols` products, columns outside the slice [c0, c1) are not written.
TEST_P(KernelSetTest, GemmPackedPairsMatchesNaive) {
  if (!detail::has_gemm_packed_pairs<float, bf16>(ks()))
    GTEST_SKIP() << kernel_set_name(ks()) << " has no bf16-pair GEMM (the f32 panels serve it)";
  for (const std::size_t n : {17, 18, 23, 64})
    for (const std::size_t rows : {1, 17, 40, 64, 65, 97, 130})
      for (const std::size_t cols : {1, 2, 9, 16, 33, 64, 129, 295}) {
        const auto w = random_vector<bf16>(rows * cols, rows * 1000 + cols);
        const auto x = random_vector<float>(n * cols, n * 7 + cols);  // [n][cols]
        const std::size_t ld = detail::pair_depth(cols);
        ASSERT_EQ(ld % 2, 0u);
        ASSERT_LE(ld - cols, 1u);
        const auto expect_rows = [&](const std::vector<bf16>& rounded, std::size_t lda) {
          ASSERT_EQ(rounded.size(), n * lda + 1);
          for (std::size_t t = 0; t < n; ++t)
            for (std::size_t c = 0; c < lda; ++c) {
              const float want = c < cols ? static_cast<float>(bf16(x[t * cols + c])) : 0.0f;
              ASSERT_EQ(std::bit_cast<std::uint32_t>(static_cast<float>(rounded[t * lda + c])),
                        std::bit_cast<std::uint32_t>(want))
                  << "x row " << t << " column " << c << " of " << cols << ", rows of " << lda;
            }
          ASSERT_TRUE(std::isnan(static_cast<float>(rounded.back()))) << "written past the rows";
        };
        std::vector<bf16> xb(n * ld + 1, bf16(std::numeric_limits<float>::quiet_NaN()));
        detail::round_rows_to_pairs(xb.data(), x.data(), n, cols);
        expect_rows(xb, ld);
#if KVDECODE_AMX_KERNELS
        std::vector<bf16> xa(n * detail::amx_lda(cols) + 1,
                             bf16(std::numeric_limits<float>::quiet_NaN()));
        detail::pack_x_amx(xa.data(), x.data(), n, cols);
        expect_rows(xa, detail::amx_lda(cols));
#endif
        xb.pop_back();
        const std::size_t c0 = rows > 1 ? 1 : 0;
        const std::size_t c1 = rows > 2 ? rows - 1 : rows;
        AlignedBuffer<bf16> panel(detail::kPanelRows * ld);
        std::vector<float> y(n * rows, std::numeric_limits<float>::quiet_NaN());  // [n][rows]
        detail::gemm_packed_pairs(y.data(), xb.data(), w.data(), n, cols, rows, c0, c1,
                                  panel.data());
        if (c1 - c0 <= detail::kPanelRows) {  // one panel: the last one packed
          for (std::size_t p = 0; p < ld / 2; ++p)
            for (std::size_t j = 0; j < c1 - c0; ++j)
              for (std::size_t h = 0; h < 2; ++h) {
                const std::size_t k = 2 * p + h;
                const float want = k < cols ? static_cast<float>(w[(c0 + j) * cols + k]) : 0.0f;
                ASSERT_EQ(static_cast<float>(panel.data()[2 * (p * detail::kPanelRows + j) + h]),
                          want)
                    << rows << "×" << cols << " weight row " << c0 + j << " depth " << k;
              }
        }
        for (std::size_t t = 0; t < n; ++t) {
          const std::vector<float> xt(x.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                      x.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
          std::vector<double> ref, mag;
          naive_gemv(w, xt, rows, cols, x_bf16, ref, mag);
          for (std::size_t r = 0; r < rows; ++r) {
            const float got = y[t * rows + r];
            if (r < c0 || r >= c1) {
              ASSERT_TRUE(std::isnan(got)) << "column outside the slice was written";
              continue;
            }
            ASSERT_LE(std::abs(got - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
                << n << " tokens " << rows << "×" << cols << " token " << t << " row " << r;
          }
        }
      }
}

/// The panel pack of every set against the transpose written here: panel[k][j] = w[j][k]
/// exactly (widening bf16 is exact), for row counts and depths that leave tails of the 16 × 16
/// and 8 × 8 blocks; columns past rows are never read by the kernels, so they are not checked.
template <class W>
void check_pack_panel(KernelSet ks) {
  for (const std::size_t rows : {1, 7, 8, 15, 16, 17, 40, 64})
    for (const std::size_t in : {1, 5, 8, 15, 16, 17, 33, 288}) {
      const auto w = random_vector<W>(rows * in, rows * 100 + in);
      AlignedBuffer<float> panel(detail::kPanelRows * in);
      std::fill_n(panel.data(), panel.size(), std::numeric_limits<float>::quiet_NaN());
      detail::pack_panel(ks, panel.data(), w.data(), rows, in);
      for (std::size_t k = 0; k < in; ++k)
        for (std::size_t j = 0; j < rows; ++j)
          ASSERT_EQ(panel.data()[k * detail::kPanelRows + j], static_cast<float>(w[j * in + k]))
              << rows << "×" << in << " weight row " << j << " depth " << k;
    }
}

TEST_P(KernelSetTest, PackPanelTransposesExactly) {
  check_pack_panel<float>(ks());
  check_pack_panel<bf16>(ks());
}

// softmax_exp against exp in double: within 4 · 2^-24 relative for results at or above
// exp(kExpFloorArg) (measured over 2^20 arguments in [-87, 0]: at most 1.4 · 2^-24 for the x86
// sets' polynomial, 2.0 · 2^-24 for the portable set's SSE2 Eigen exp). Below that every set
// returns 0 or, where the result is still a normal float, a value within the bound. The sum is
// within the f32 bound of a sum of cols terms (cols · 2^-24 relative, all terms positive) plus the
// terms' own error.
TEST_P(KernelSetTest, SoftmaxExpMatchesExpInDouble) {
  const double floor_value = std::exp(static_cast<double>(detail::kExpFloorArg));
  detail::SplitMix64 rng(11);
  for (const std::size_t cols : {1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 256}) {
    std::vector<float> row(cols);  // scores spread over [shift − 100, shift], a few masked
    const float shift = 3.5f;
    for (std::size_t c = 0; c < cols; ++c)
      row[c] = shift - static_cast<float>(50.0 * (rng.symmetric() + 1.0));
    row[0] = shift;  // the row's max: exp(0) = 1
    if (cols > 2) row[cols / 2] = -std::numeric_limits<float>::infinity();
    if (cols > 3) row[cols - 1] = shift + detail::kExpFloorArg + 0.25f;  // just above the floor
    if (cols > 4) row[1] = shift + detail::kExpFloorArg - 0.25f;         // just below it
    const std::vector<float> in = row;
    const float sum = detail::softmax_exp(ks(), row.data(), cols, shift);
    double ref_sum = 0;
    for (std::size_t c = 0; c < cols; ++c) {
      const double x = static_cast<double>(in[c]) - static_cast<double>(shift);
      const double ref = std::exp(x);
      ref_sum += ref;
      const double got = row[c];
      if (ref >= floor_value) {
        ASSERT_LE(std::abs(got - ref), 4 * 0x1p-24 * ref) << cols << " cols, x = " << x;
      } else if (ref < static_cast<double>(std::numeric_limits<float>::min())) {
        ASSERT_EQ(got, 0.0) << cols << " cols, x = " << x << ": no subnormal";
      } else {
        ASSERT_TRUE(got == 0.0 || std::abs(got - ref) <= 4 * 0x1p-24 * ref)
            << cols << " cols, x = " << x;
      }
    }
    ASSERT_LE(std::abs(static_cast<double>(sum) - ref_sum),
              (static_cast<double>(cols) + 4) * 0x1p-24 * ref_sum)
        << cols << " cols";
  }
}

// swiglu against a / (1 + exp(−a)) · b in double: the exp within 4 · 2^-24 relative (the bound
// above), which 1 + e carries at most unchanged, and one rounding each for the add, the divide and
// the multiply: within 7 · 2^-24 relative. Below a = −87 the vector sets' exp is clamped (libm's
// overflows to inf), so there the result is only required to be negligible: below 1e-35 · |b|.
// Lengths cover every vector tail; a NaN gate stays NaN.
TEST_P(KernelSetTest, SwigluMatchesFormulaInDouble) {
  detail::SplitMix64 rng(13);
  for (const std::size_t count : {1, 7, 8, 9, 15, 16, 17, 33, 100, 1000}) {
    std::vector<float> a(count), b(count);
    for (std::size_t i = 0; i < count; ++i) {
      a[i] = static_cast<float>(30.0 * rng.symmetric());
      b[i] = static_cast<float>(4.0 * rng.symmetric());
    }
    const float specials[] = {0.0f, -0.0f, 87.5f, 100.0f, -86.5f, -88.5f, -100.0f, 1e-30f};
    for (std::size_t i = 0; i < std::size(specials) && i < count; ++i)
      a[(i * 7) % count] = specials[i];
    const std::vector<float> in = a;
    detail::swiglu(ks(), a.data(), b.data(), count);
    for (std::size_t i = 0; i < count; ++i) {
      const double g = in[i], up = b[i];
      const double ref = g / (1.0 + std::exp(-g)) * up;
      if (g < -87.0) {
        ASSERT_LE(std::abs(static_cast<double>(a[i])), 1e-35 * std::abs(up)) << "a = " << g;
      } else {
        ASSERT_LE(std::abs(a[i] - ref), 7 * 0x1p-24 * std::abs(ref))
            << count << " elements, a = " << g << ", b = " << up;
      }
    }
  }
  std::vector<float> a = {1.0f, std::numeric_limits<float>::quiet_NaN(), -1.0f}, b(3, 1.0f);
  detail::swiglu(ks(), a.data(), b.data(), a.size());
  EXPECT_TRUE(std::isnan(a[1]));
  EXPECT_FALSE(std::isnan(a[0]) || std::isnan(a[2]));
}

TEST_P(KernelSetTest, SoftmaxExpPassesNaN) {
  std::vector<float> row = {0.0f, std::numeric_limits<float>::quiet_NaN(), -1.0f};
  const float sum = detail::softmax_exp(ks(), row.data(), row.size(), 0.0f);
  EXPECT_TRUE(std::isnan(row[1]));
  EXPECT_TRUE(std::isnan(sum));
}

TEST_P(KernelSetTest, GemvRowRangeTouchesOnlyItsRows) {
  const std::size_t rows = 37, cols = 45;
  const auto w = random_vector<float>(rows * cols, 5);
  const auto wb = random_vector<bf16>(rows * cols, 5);
  const auto x = random_vector<float>(cols, 6);
  std::vector<float> whole(rows), part(rows, -7.0f), whole_b(rows), part_b(rows, -7.0f);
  detail::gemv_rows(ks(), whole.data(), w.data(), x.data(), 0, rows, cols);
  detail::gemv_rows(ks(), part.data(), w.data(), x.data(), 5, 22, cols);
  detail::gemv_rows(ks(), whole_b.data(), wb.data(), x.data(), 0, rows, cols);
  detail::gemv_rows(ks(), part_b.data(), wb.data(), x.data(), 5, 22, cols);
  for (std::size_t r = 0; r < rows; ++r) {
    if (r >= 5 && r < 22) {
      EXPECT_EQ(part[r], whole[r]) << "row " << r;  // same per-row arithmetic, bit for bit
      EXPECT_EQ(part_b[r], whole_b[r]) << "row " << r;
    } else {
      EXPECT_EQ(part[r], -7.0f) << "row " << r;
      EXPECT_EQ(part_b[r], -7.0f) << "row " << r;
    }
  }
}

// bf16: the kernel multiplies bf16 weights by x rounded to bf16 (exact products) and sums in
// f32, so against the naive loop over the same rounded values the f32 bound holds. Inputs longer
// than kMaxStackCols take the path that rounds inside the row loop.
TEST_P(KernelSetTest, GemvBf16MatchesNaiveOverRoundedInput) {
  std::vector<std::size_t> cols_list = odd_cols();
  cols_list.push_back(detail::kMaxStackCols + 37);
  for (const std::size_t rows : kRows)
    for (const std::size_t cols : cols_list) {
      const auto w = random_vector<bf16>(rows * cols, rows * 77 + cols);
      const auto x = random_vector<float>(cols, cols + 1);
      std::vector<double> ref, mag;
      naive_gemv(w, x, rows, cols, x_bf16, ref, mag);
      std::vector<float> y(rows, std::numeric_limits<float>::quiet_NaN());
      detail::gemv_rows(ks(), y.data(), w.data(), x.data(), 0, rows, cols);
      for (std::size_t r = 0; r < rows; ++r)
        ASSERT_LE(std::abs(y[r] - ref[r]), static_cast<double>(cols) * 0x1p-24 * mag[r])
            << rows << "×" << cols << " row " << r;
    }
}

/// Inputs on and around bf16 rounding ties, weights 1: every sum below is exact in f32, so a
/// path that truncates x, rounds ties away from zero, or keeps x in f32 gets another value.
std::vector<float> tie_inputs(std::size_t cols) {
  const float pattern[] = {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f),
                           2.0f + 0x1p-7f,  1.0f + 0x1p-9f,     -(1.0f + 3 * 0x1p-9f),
                           0.5f + 0x1p-10f, 4.0f - 0x1p-7f};
  std::vector<float> x(cols);
  for (std::size_t c = 0; c < cols; ++c) x[c] = pattern[c % 8];
  return x;
}

TEST_P(KernelSetTest, Bf16PathsRoundInputsToNearestEven) {
  const std::size_t rows = 19;
  for (const std::size_t cols : {1, 7, 9, 17, 33, 65, 70, 129}) {
    std::vector<bf16> w(rows * cols, bf16(1.0f));
    for (std::size_t r = 0; r < rows; ++r) w[r * cols + r % cols] = bf16(-2.0f);
    // GEMV, gemm_few, gemm_few, the set's GEMM (Eigen's, packed panels, bf16 pairs, AMX)
    for (const std::size_t n : {1, 3, 16, 17}) {
      std::vector<float> x;
      for (std::size_t t = 0; t < n; ++t) {
        std::vector<float> xt = tie_inputs(cols);
        for (float& v : xt) v *= static_cast<float>(t + 1);
        x.insert(x.end(), xt.begin(), xt.end());
      }
      std::vector<float> y(n * rows), panels(detail::kPanelRows * cols), rounded(n * cols);
      detail::linear_group<float, bf16>({{y.data(), w.data(), rows}}, x.data(), n, cols, nullptr,
                                        {panels.data(), 0, rounded.data()}, ks());
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t r = 0; r < rows; ++r) {
          double expected = 0;
          for (std::size_t c = 0; c < cols; ++c)
            expected +=
                static_cast<double>(static_cast<float>(w[r * cols + c])) * x_bf16(x[t * cols + c]);
          ASSERT_EQ(y[t * rows + r], expected) << n << " tokens, " << cols << " columns, row " << r;
        }
    }
  }
}

/// linear_group at 1, 2 and 3 threads, one token (GEMV), a few (gemm_few, or gemm_lanes for
/// FewTokenOrder::kLanes) and more than kMaxFewTokens (the set's GEMM; bf16 pairs in avx512bf16):
/// within the f32 bound of the naive loop over x rounded as the weight type's rule says; one
/// token, and a few in lanes, bit-identical at every thread count.
template <class W>
void check_linear_group(KernelSet ks, detail::FewTokenOrder order) {
  const std::size_t in = 70;
  const bool lanes = order == detail::FewTokenOrder::kLanes && detail::has_gemm_lanes<float, W>(ks);
  for (const std::size_t out : {1, 17, 130, 600})
    for (const std::size_t n : {1, 2, 5, 17}) {
      const auto w = random_vector<W>(out * in, out + n);
      const auto x = random_vector<float>(n * in, 3 * n);
      std::vector<float> one(n * out);
      for (const std::size_t threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        std::vector<float> panels(threads * detail::kPanelRows * in), rounded(n * in);
        std::vector<float> y(n * out, std::numeric_limits<float>::quiet_NaN());
        detail::linear_group<float, W>({{y.data(), w.data(), out}}, x.data(), n, in, &pool,
                                       {panels.data(), detail::kPanelRows * in, rounded.data()}, ks,
                                       order);
        if (threads == 1) one = y;
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t o = 0; o < out; ++o) {
            double ref = 0, mag = 0;
            for (std::size_t c = 0; c < in; ++c) {
              const double xv =
                  std::is_same_v<W, float> ? x_exact(x[i * in + c]) : x_bf16(x[i * in + c]);
              const double p = static_cast<double>(static_cast<float>(w[o * in + c])) * xv;
              ref += p;
              mag += std::abs(p);
            }
            const float got = y[i * out + o];
            ASSERT_LE(std::abs(got - ref), static_cast<double>(in) * 0x1p-24 * mag)
                << "n " << n << " out " << out << " threads " << threads;
            if (n == 1 || (lanes && n <= detail::kMaxFewTokens)) {
              ASSERT_EQ(got, one[i * out + o]) << "out " << out << " threads " << threads;
            }
          }
      }
    }
}

TEST_P(KernelSetTest, LinearGroupF32AtOneTwoThreeThreads) {
  check_linear_group<float>(ks(), detail::FewTokenOrder::kGemv);
  check_linear_group<float>(ks(), detail::FewTokenOrder::kLanes);
}
TEST_P(KernelSetTest, LinearGroupBf16AtOneTwoThreeThreads) {
  check_linear_group<bf16>(ks(), detail::FewTokenOrder::kGemv);
  check_linear_group<bf16>(ks(), detail::FewTokenOrder::kLanes);
}

TEST_P(KernelSetTest, LinearGroupLargeGemvSplitsAcrossPoolBitIdentically) {
  const std::size_t in = 333, out = 1001;  // above kMinParallelWeights, odd sizes
  static_assert(333 * 1001 >= detail::kMinParallelWeights);
  const auto w = random_vector<float>(out * in, 8);
  const auto x = random_vector<float>(in, 9);
  std::vector<float> one(out), three(out);
  detail::linear_group<float, float>({{one.data(), w.data(), out}}, x.data(), 1, in, nullptr, {},
                                     ks());
  ThreadPool pool(3);
  detail::linear_group<float, float>({{three.data(), w.data(), out}}, x.data(), 1, in, &pool, {},
                                     ks());
  EXPECT_EQ(one, three);
}

// Dequantization: 8-bit, 4-bit keys and values are min + code·step, checked against that
// formula in double within two f32 roundings (the multiply and the add, or one for a fused
// multiply-add).
bool near_min_code_step(float got, double min, double code, double step) {
  const double exact = min + code * step;
  return std::abs(got - exact) <= 0x1p-23 * (std::abs(min) + std::abs(code * step));
}

TEST_P(KernelSetTest, DequantizeInt8MatchesFormula) {
  for (const std::size_t hs : {1, 8, 15, 16, 17, 31, 32, 33, 48, 64, 65, 128}) {
    const std::size_t n = 5;
    std::vector<std::uint8_t> q(n * hs);
    detail::SplitMix64 rng(hs);
    for (auto& v : q) v = static_cast<std::uint8_t>(rng.next());
    std::vector<std::uint16_t> mn(n), step(n);  // f16
    const auto m = random_vector<float>(n, hs + 1), s = random_vector<float>(n, hs + 2);
    for (std::size_t r = 0; r < n; ++r) {
      mn[r] = detail::f16_from_float(m[r]);
      step[r] = detail::f16_from_float(std::abs(s[r]) / 255);
    }
    std::vector<float> got(n * hs);
    detail::dequantize_int8(ks(), q.data(), mn.data(), step.data(), n, hs, got.data());
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t c = 0; c < hs; ++c)
        ASSERT_TRUE(near_min_code_step(got[r * hs + c], detail::f16_to_float(mn[r]), q[r * hs + c],
                                       detail::f16_to_float(step[r])))
            << "head size " << hs << " row " << r << " channel " << c;
  }
}

TEST_P(KernelSetTest, DequantizeQ4MatchesFormula) {
  for (const std::size_t hs : {2, 6, 8, 14, 16, 18, 30, 32, 34, 48, 64, 66, 128}) {
    const std::size_t n = 5;
    std::vector<std::uint8_t> kq(n * hs / 2), vq(n * hs / 2);
    detail::SplitMix64 rng(hs);
    for (auto& v : kq) v = static_cast<std::uint8_t>(rng.next() & 0xFF);
    for (auto& v : vq) v = static_cast<std::uint8_t>(rng.next() & 0xFF);
    const auto kmin = random_vector<float>(hs, 1), kstep = random_vector<float>(hs, 2);
    const auto vmin = random_vector<float>(n, 3), vstep = random_vector<float>(n, 4);
    std::vector<float> keys(n * hs), values(n * hs);
    detail::dequantize_q4(ks(), kq.data(), kmin.data(), kstep.data(), vq.data(), vmin.data(),
                          vstep.data(), n, hs, keys.data(), values.data());
    const auto near = near_min_code_step;
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t c = 0; c < hs; ++c) {
        const std::uint8_t kb = kq[r * hs / 2 + c / 2], vb = vq[r * hs / 2 + c / 2];
        const int kc = c % 2 == 0 ? kb & 0xF : kb >> 4;
        const int vc = c % 2 == 0 ? vb & 0xF : vb >> 4;
        ASSERT_TRUE(near(keys[r * hs + c], kmin[c], kc, kstep[c]))
            << "head size " << hs << " key " << r << "," << c;
        ASSERT_TRUE(near(values[r * hs + c], vmin[r], vc, vstep[r]))
            << "head size " << hs << " value " << r << "," << c;
      }
  }
}

INSTANTIATE_TEST_SUITE_P(EverySet, KernelSetTest, ::testing::ValuesIn(kKernelSets),
                         [](const ::testing::TestParamInfo<KernelSet>& set) {
                           return std::string(kernel_set_name(set.param));
                         });

TEST(KernelSetChoiceTest, NamesRoundTripAndBestIsSupported) {
  for (const KernelSet s : kKernelSets) EXPECT_EQ(parse_kernel_set(kernel_set_name(s)), s);
  EXPECT_FALSE(parse_kernel_set("sse9").has_value());
  EXPECT_TRUE(cpu_supports(KernelSet::kPortable));
  EXPECT_TRUE(cpu_supports(best_kernel_set()));
  for (const KernelSet s : kKernelSets) {  // each set needs the instructions of the ones before
    if (cpu_supports(s)) {
      EXPECT_LE(static_cast<int>(s), static_cast<int>(best_kernel_set()));
    }
  }
}

TEST(KernelSetChoiceTest, ForceSwitchesSupportedSetsAndRefusesOthers) {
  const KernelSet before = active_kernel_set();
  for (const KernelSet s : kKernelSets) {
    if (cpu_supports(s)) {
      force_kernel_set(s);
      EXPECT_EQ(active_kernel_set(), s);
      EXPECT_STREQ(active_kernel_set_name(), kernel_set_name(s));
    } else {
      const KernelSet now = active_kernel_set();
      EXPECT_THROW(force_kernel_set(s), Error) << kernel_set_name(s);
      EXPECT_EQ(active_kernel_set(), now);
    }
  }
  force_kernel_set(before);
  if (best_kernel_set() == KernelSet::kAvx512Bf16)
    GTEST_SKIP() << "this CPU runs every set, so no refusal could be checked";
}

TEST(KernelSetChoiceTest, EnvironmentVariableChoosesOrIsAnError) {
  const char* old = std::getenv("KVDECODE_ISA");
  const std::string saved = old == nullptr ? "" : old;
  ::setenv("KVDECODE_ISA", "portable", 1);
  EXPECT_EQ(detail::kernel_set_from_environment(), KernelSet::kPortable);
  ::setenv("KVDECODE_ISA", "", 1);
  EXPECT_EQ(detail::kernel_set_from_environment(), best_kernel_set());
  ::setenv("KVDECODE_ISA", "avx1024", 1);
  try {
    detail::kernel_set_from_environment();
    ADD_FAILURE() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KVDECODE_ISA=avx1024 names no kernel set"),
              std::string::npos)
        << e.what();
  }
  for (const KernelSet s : kKernelSets)
    if (!cpu_supports(s)) {
      ::setenv("KVDECODE_ISA", kernel_set_name(s), 1);
      EXPECT_THROW(detail::kernel_set_from_environment(), Error) << kernel_set_name(s);
    }
  if (old == nullptr) {
    ::unsetenv("KVDECODE_ISA");
  } else {
    ::setenv("KVDECODE_ISA", saved.c_str(), 1);
  }
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

// The low-bit stores' rotation: rotate_rows equals the matrix (1/√b) H D per block of b
// channels, written out here with H[i][j] = (-1)^popcount(i & j), and that matrix is
// orthogonal, so q·k and the attention output are unchanged once rows are rotated back.
TEST(RotationTest, RowsRotateByAnOrthogonalBlockHadamardMatrix) {
  for (const std::size_t hs : {2u, 16u, 48u, 64u, 80u, 128u}) {
    std::size_t b = 1;
    while (hs % (2 * b) == 0) b *= 2;
    EXPECT_EQ(detail::rotation_block(hs), b) << hs;
    std::vector<float> signs(hs);
    detail::rotation_signs(hs, signs.data());
    std::vector<double> m(hs * hs, 0.0);  // [hs][hs]
    for (std::size_t i = 0; i < hs; ++i)
      for (std::size_t j = i / b * b; j < i / b * b + b; ++j)
        m[i * hs + j] = (std::popcount((i % b) & (j % b)) % 2 == 0 ? 1.0 : -1.0) * signs[j] /
                        std::sqrt(static_cast<double>(b));
    for (std::size_t i = 0; i < hs; ++i)
      for (std::size_t j = 0; j < hs; ++j) {
        double dot = 0;
        for (std::size_t c = 0; c < hs; ++c) dot += m[i * hs + c] * m[j * hs + c];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-12) << hs;
      }
    const auto x = random_vector<double>(3 * hs, hs);
    std::vector<double> y = x;
    detail::rotate_rows(y.data(), 3, hs, signs.data(), /*inverse=*/false);
    for (std::size_t r = 0; r < 3; ++r)
      for (std::size_t i = 0; i < hs; ++i) {
        double want = 0;
        for (std::size_t c = 0; c < hs; ++c) want += m[i * hs + c] * x[r * hs + c];
        ASSERT_NEAR(y[r * hs + i], want, 1e-12) << hs;
      }
    detail::rotate_rows(y.data(), 3, hs, signs.data(), /*inverse=*/true);
    for (std::size_t i = 0; i < 3 * hs; ++i) ASSERT_NEAR(y[i], x[i], 1e-12) << hs;
  }
}

// f16 conversions: round to nearest even, exact back, the directed roundings on the right side,
// against the binary16 grid computed here with ldexp.
TEST(F16Test, ConversionsFollowTheBinary16Grid) {
  const auto value = [](std::uint16_t h) {
    const int e = (h >> 10) & 0x1F, man = h & 0x3FF;
    const double v = e == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, e - 25);
    return (h & 0x8000) != 0 ? -v : v;
  };
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1F) == 0x1F) continue;  // inf, NaN
    const auto bits = static_cast<std::uint16_t>(h);
    ASSERT_EQ(static_cast<double>(detail::f16_to_float(bits)), value(bits)) << h;
    if (value(bits) != 0) {
      ASSERT_EQ(detail::f16_from_float(detail::f16_to_float(bits)), bits) << h;
    }
  }
  detail::SplitMix64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const auto x =
        static_cast<float>(std::ldexp(rng.symmetric(), static_cast<int>(rng.next() % 30) - 22));
    const double near = detail::f16_to_float(detail::f16_from_float(x));
    const double lo = detail::f16_to_float(detail::f16_at_most(x));
    ASSERT_LE(lo, x);
    // one f16 unit: 2^-10 relative for normals, 2^-24 below them
    ASSERT_LE(x - lo, std::max(std::abs(double{x}) * 0x1p-10, 0x1p-24)) << x;
    ASSERT_LE(std::abs(near - x), std::max(std::abs(double{x}) * 0x1p-11, 0x1p-25)) << x;
    if (x >= 0) {
      const double hi = detail::f16_to_float(detail::f16_at_least(x));
      ASSERT_GE(hi, x);
      ASSERT_LE(hi - x, std::max(double{x} * 0x1p-10, 0x1p-24)) << x;
    }
  }
}

}  // namespace
}  // namespace kvdecode
