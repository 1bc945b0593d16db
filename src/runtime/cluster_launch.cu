#include "runtime/cluster_launch.hpp"

#include <map>
#include <mutex>
#include <utility>

namespace mok::runtime {

cudaLaunchConfig_t cluster_launch_config(int num_ctas, int num_threads, uint32_t smem_bytes,
                                         int cluster_size, cudaStream_t stream,
                                         cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(num_ctas));
  config.blockDim = dim3(static_cast<unsigned>(num_threads));
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(cluster_size);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

int max_active_clusters(const void* kernel, int num_threads, uint32_t smem_bytes,
                        int cluster_size) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> known;
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({kernel, device});
  if (found != known.end()) return found->second;
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem_bytes)));
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config = cluster_launch_config(cluster_size, num_threads, smem_bytes,
                                                          cluster_size, nullptr, &attribute);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it, and go without clusters
    clusters = 0;
  }
  known[{kernel, device}] = clusters;
  return clusters;
}

}  // namespace mok::runtime
