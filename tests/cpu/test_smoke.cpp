#include <gtest/gtest.h>

#include "mok/bf16.hpp"

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(mok::bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(mok::bf16(1.0f + 0x1.0p-8f).bits, 0x3f80);  // tie: stays even
  EXPECT_EQ(mok::bf16(1.0f + 0x1.8p-8f).bits, 0x3f81);  // above the tie: rounds up
}
