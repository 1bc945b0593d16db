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
  // A gap of 40 cycles, but one side spread wider than it: not two clean clusters.
  std::vector<double> ragged = two_clusters({5, 6, 7, 8}, 30, 300, 400, 2, 3);
  ragged[1] = 200;  // the near side now spans 100 cycles
  runtime::classify_l2_partitions(ragged, 30, &partitions);
  EXPECT_EQ(partitions, 1);
  // Too few CTAs to tell.
  runtime::classify_l2_partitions({0.0, 300.0}, 30, &partitions);
  EXPECT_EQ(partitions, 1);
}

}  // namespace
}  // namespace mok
