// The L2 partition probe's reading (runtime/l2_partitions.hpp), on made-up latencies.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "runtime/l2_partitions.hpp"

namespace mok {
namespace {

// CTA 0 is the reference (no measurement); the others' mean latencies come from two clusters.
std::vector<double> two_clusters(const std::vector<int>& far, int ctas, double near_mean,
                                 double far_mean, double spread, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> noise(-spread / 2, spread / 2);
  std::vector<double> latency(ctas, 0.0);
  for (int cta = 1; cta < ctas; ++cta) latency[cta] = near_mean + noise(rng);
  for (int cta : far) latency[cta] = far_mean + noise(rng);
  return latency;
}

TEST(L2Partitions, TwoClustersSplitWithTheReferenceOnTheNearSide) {
  // As measured on an H200: near 282-308 cycles, far 360-395.
  const std::vector<int> far = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59};
  const std::vector<double> latency = two_clusters(far, 60, 295, 377, 30, 1);
  int partitions = 0;
  const std::vector<uint8_t> split = runtime::classify_l2_partitions(latency, 30, &partitions);
  ASSERT_EQ(partitions, 2);
  ASSERT_EQ(split.size(), latency.size());
  EXPECT_EQ(split[0], 0) << "the reference SM is near itself";
  for (int cta = 1; cta < 60; ++cta) {
    const bool is_far = std::find(far.begin(), far.end(), cta) != far.end();
    EXPECT_EQ(split[cta], is_far ? 1 : 0) << "CTA " << cta;
  }
}

TEST(L2Partitions, AnH100sMeasurementSplitsInHalves) {
  // One H100's first probe (2026-12-06), by CTA, the reference (SM 124) first: near 278-315
  // cycles, far 357-401. The far side's range (44) is wider than the gap (42); its deviation is
  // ~10. The rule of ranges read it as one partition.
  const std::vector<double> latency = {
      0,   301, 301, 295, 296, 380, 380, 375, 382, 390, 382, 288, 285, 375, 379, 295, 291, 301, 300,
      301, 300, 391, 395, 382, 395, 386, 390, 291, 292, 380, 367, 290, 295, 311, 315, 306, 307, 401,
      398, 391, 385, 375, 390, 293, 293, 381, 381, 301, 303, 295, 291, 290, 291, 380, 382, 370, 367,
      367, 373, 285, 283, 366, 370, 282, 285, 293, 292, 386, 388, 377, 380, 377, 374, 287, 285, 375,
      372, 286, 286, 305, 303, 380, 386, 387, 387, 375, 371, 290, 287, 393, 382, 296, 295, 284, 284,
      367, 362, 370, 384, 362, 373, 279, 281, 357, 357, 278, 281, 291, 290, 369, 368, 386, 383, 369,
      376, 281, 285, 369, 361, 282, 282, 362, 389, 288, 295, 295, 308, 310, 289, 285, 289, 291};
  ASSERT_EQ(latency.size(), 132u);
  int partitions = 0;
  const std::vector<uint8_t> split = runtime::classify_l2_partitions(latency, 30, &partitions);
  ASSERT_EQ(partitions, 2);
  int far = 0;
  for (size_t cta = 1; cta < latency.size(); ++cta) {
    EXPECT_EQ(split[cta], latency[cta] > 336 ? 1 : 0) << "CTA " << cta;
    far += split[cta];
  }
  EXPECT_EQ(split[0], 0);
  EXPECT_EQ(far, 66);
}

TEST(L2Partitions, OneClusterOrANarrowGapIsOnePartition) {
  int partitions = 0;
  // Latencies spread evenly: no gap stands out.
  std::vector<double> even(40, 0.0);
  for (int cta = 1; cta < 40; ++cta) even[cta] = 280 + 2.5 * cta;
  for (uint8_t partition : runtime::classify_l2_partitions(even, 30, &partitions)) {
    EXPECT_EQ(partition, 0);
  }
  EXPECT_EQ(partitions, 1);
  // Two clusters, but 20 cycles apart: under the minimum gap.
  const std::vector<double> close = two_clusters({4, 9, 16}, 30, 300, 325, 4, 2);
  runtime::classify_l2_partitions(close, 30, &partitions);
  EXPECT_EQ(partitions, 1);
  // Clusters 60 cycles apart, each 100 cycles wide (deviation ~29): no gap three deviations wide.
  const std::vector<double> ragged =
      two_clusters({5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, 30, 300, 360, 100, 3);
  runtime::classify_l2_partitions(ragged, 30, &partitions);
  EXPECT_EQ(partitions, 1);
  // A gap of 100 cycles, but one CTA beyond it (a straggler, not a partition).
  std::vector<double> straggler = two_clusters({}, 30, 300, 0, 4, 4);
  straggler[7] = 400;
  runtime::classify_l2_partitions(straggler, 30, &partitions);
  EXPECT_EQ(partitions, 1);
  // Too few CTAs to tell.
  runtime::classify_l2_partitions({0.0, 300.0}, 30, &partitions);
  EXPECT_EQ(partitions, 1);
}

}  // namespace
}  // namespace mok
