// The comparison helpers of test_util.hpp fail on what they must not let through.
#include "test_util.hpp"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace kvdecode::testing_util {
namespace {

TEST(TestUtilTest, MaxAbsDiffIsTheLargestDifference) {
  const std::vector<float> a = {1.0f, -2.0f, 3.0f}, b = {1.5f, -2.0f, 1.0f};
  EXPECT_EQ(max_abs_diff(a, b), 2.0);
  EXPECT_EQ(max_abs_diff(b, a), 2.0);
}

// std::max(worst, NaN) keeps worst: a NaN anywhere must still fail the comparison.
TEST(TestUtilTest, MaxAbsDiffFailsOnNaN) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (std::size_t at = 0; at < 3; ++at) {
    std::vector<double> a = {1.0, 2.0, 3.0};
    const std::vector<double> b = {1.0, 2.0, 3.5};
    a[at] = nan;
    double d = 0;
    EXPECT_NONFATAL_FAILURE(d = max_abs_diff(a, b), "NaN at index");
    EXPECT_EQ(d, std::numeric_limits<double>::infinity()) << at;
    EXPECT_NONFATAL_FAILURE(d = max_abs_diff(b, a), "NaN at index");
    EXPECT_FALSE(d <= 1e300);
  }
}

}  // namespace
}  // namespace kvdecode::testing_util
