// Launching persistent kernels on thread-block clusters (the grouped GEMMs' CTA pairs that share
// a tile's loads by TMA multicast): the launch configuration, and how many clusters of a kernel
// fit on the current device at once. Host side; for .cu files (cudaLaunchKernelEx's template).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "mok/cuda_check.hpp"

namespace mok::runtime {

// A 1-D grid of num_ctas CTAs in clusters of cluster_size along x; `attribute` holds the cluster
// dimension and must outlive the returned configuration.
cudaLaunchConfig_t cluster_launch_config(int num_ctas, int num_threads, uint32_t smem_bytes,
                                         int cluster_size, cudaStream_t stream,
                                         cudaLaunchAttribute* attribute);

// Clusters of `cluster_size` CTAs of `kernel` (smem_bytes of dynamic shared memory each) that fit
// on the current device at once: a cluster's CTAs share a GPC, so this can be fewer than the SMs
// over cluster_size. Asked once per kernel and device. 0 where the device or driver cannot say (a
// partitioned GPU, say): the caller then runs single CTAs.
int max_active_clusters(const void* kernel, int num_threads, uint32_t smem_bytes, int cluster_size);

// kernel<<<num_ctas, num_threads, smem_bytes, stream>>>(args...) on clusters of cluster_size.
template <class... Params, class... Args>
void launch_on_clusters(void (*kernel)(Params...), int num_ctas, int num_threads,
                        uint32_t smem_bytes, int cluster_size, cudaStream_t stream,
                        Args&&... args) {
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config =
      cluster_launch_config(num_ctas, num_threads, smem_bytes, cluster_size, stream, &attribute);
  MOK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace mok::runtime
