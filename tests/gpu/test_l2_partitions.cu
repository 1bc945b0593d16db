// The L2 partition map the fused forward's tickets use (runtime/l2_partitions.hpp).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu/layer_test_support.cuh"
#include "runtime/l2_partitions.hpp"

namespace mok {
namespace {

TEST(L2PartitionMap, SplitsTheSmsOfAHopperGpuInTwoAndIsProbedOnce) {
  MOK_REQUIRE_HOPPER_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const runtime::L2PartitionMap& map = runtime::l2_partition_map();
  std::string latencies;
  for (int id = 0; id < runtime::kMaxSmIds; ++id) {
    if (map.probe_latency[id] != 0)
      latencies += std::to_string(id) + ":" + std::to_string(map.probe_latency[id]) + " ";
  }
  // H100 and H200 have two L2 partitions; the probe must find both, each with a fair share.
  ASSERT_EQ(map.num_partitions, 2) << "mean probe latency by SM: " << latencies;
  ASSERT_NE(map.device_table, nullptr);
  EXPECT_EQ(map.sms_per_partition[0] + map.sms_per_partition[1], sms);
  EXPECT_GT(map.sms_per_partition[0], sms / 4);
  EXPECT_GT(map.sms_per_partition[1], sms / 4);
  std::vector<uint8_t> table(runtime::kMaxSmIds);
  ASSERT_EQ(cudaMemcpy(table.data(), map.device_table, table.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int ones = 0;
  for (uint8_t partition : table) {
    ASSERT_LE(partition, 1);
    ones += partition;
  }
  EXPECT_EQ(ones, map.sms_per_partition[1]);
  EXPECT_EQ(&runtime::l2_partition_map(), &map) << "probed again";
}

}  // namespace
}  // namespace mok
