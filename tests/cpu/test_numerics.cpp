#include <gtest/gtest.h>

#include <cmath>

#include "mok/bf16.hpp"
#include "mok/detail/numerics.hpp"

namespace mok {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16(1.0f + 0x1.0p-8f).bits, 0x3f80);  // a tie stays even
  EXPECT_EQ(bf16(1.0f + 0x1.8p-8f).bits, 0x3f81);  // above the tie rounds up
  EXPECT_EQ(bf16(0x1.03p0f).bits, 0x3f82);         // a tie from odd rounds up to even
  EXPECT_EQ(bf16(-2.5f).to_float(), -2.5f);
}

TEST(Bf16, KeepsSpecialValues) {
  EXPECT_TRUE(std::isnan(bf16(std::nanf("")).to_float()));
  EXPECT_TRUE(std::isinf(bf16(INFINITY).to_float()));
  EXPECT_EQ(bf16(3.4e38f).bits, 0x7f80);  // rounds past the largest bf16: +inf, as on the GPU
}

TEST(Numerics, DeterministicExpIsAccurate) {
  double worst = 0;
  for (float x = -86.0f; x < 88.0f; x += 0.0173f) {
    const double exact = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(numerics::exp_deterministic(x) - exact) / exact);
  }
  EXPECT_LT(worst, 7 * 0x1.0p-24);  // within 7 ulp (6.7 at most over every float, numerics.hpp)
  EXPECT_EQ(numerics::exp_deterministic(0.0f), 1.0f);
  EXPECT_EQ(numerics::exp_deterministic(-100.0f), 0.0f);
  EXPECT_TRUE(std::isinf(numerics::exp_deterministic(100.0f)));
}

// 1 + exp(t) rounded once from exp's two parts: within 6 ulp of the fp64 sum (5.54 ulp at most
// over every float up to 88.5, measured exhaustively), exactly 1 once exp(t) < 2^-24.
TEST(Numerics, OnePlusExpIsAccurate) {
  double worst_ulps = 0;
  for (float t = -87.0f; t < 88.0f; t += 0.0173f) {
    const double exact = 1.0 + std::exp(static_cast<double>(t));
    const float sum = numerics::one_plus_exp(t);
    const double ulp = std::ldexp(1.0, std::ilogb(sum) - 23);
    worst_ulps = std::max(worst_ulps, std::fabs(sum - exact) / ulp);
  }
  EXPECT_LE(worst_ulps, 6.0);
  for (float t : {-17.0f, -30.0f, -86.9f, -87.0f, -100.0f, -1e30f, -INFINITY}) {
    EXPECT_EQ(numerics::one_plus_exp(t), 1.0f) << t;
  }
  EXPECT_EQ(numerics::one_plus_exp(0.0f), 2.0f);
  EXPECT_TRUE(std::isinf(numerics::one_plus_exp(100.0f)));
  EXPECT_TRUE(std::isnan(numerics::one_plus_exp(std::nanf(""))));
}

TEST(Numerics, SigmoidSaturatesCleanly) {
  EXPECT_EQ(numerics::sigmoid(0.0f), 0.5f);
  EXPECT_EQ(numerics::sigmoid(200.0f), 1.0f);
  EXPECT_EQ(numerics::sigmoid(-200.0f), 0.0f);
}

TEST(Numerics, SwiGluBackwardMatchesDifferences) {
  // fp32 formulas against central differences of the fp64 forward.
  for (double gate : {-6.0, -1.3, -0.2, 0.0, 0.7, 2.5, 9.0}) {
    for (double up : {-1.1, 0.4, 2.0}) {
      const double step = 1e-6;
      const double d_gate =
          (numerics::swiglu(gate + step, up) - numerics::swiglu(gate - step, up)) / (2 * step);
      const double d_up =
          (numerics::swiglu(gate, up + step) - numerics::swiglu(gate, up - step)) / (2 * step);
      const auto grad =
          numerics::swiglu_backward(static_cast<float>(gate), static_cast<float>(up), 1.0f);
      EXPECT_NEAR(grad.d_gate, d_gate, 1e-5 * (1 + std::fabs(d_gate))) << gate << " " << up;
      EXPECT_NEAR(grad.d_up, d_up, 1e-5 * (1 + std::fabs(d_up))) << gate << " " << up;
      EXPECT_NEAR(numerics::swiglu(static_cast<float>(gate), static_cast<float>(up)),
                  numerics::swiglu(gate, up), 1e-6 * (1 + std::fabs(numerics::swiglu(gate, up))));
    }
  }
}

}  // namespace
}  // namespace mok
