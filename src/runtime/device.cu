#include "mok/gpu.hpp"

#include <cuda_runtime.h>

#include "mok/error.hpp"

namespace mok {

GpuSummary query_gpus() {
  GpuSummary summary;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    summary.description =
        status == cudaSuccess || status == cudaErrorNoDevice ? "no CUDA device visible"
        : status == cudaErrorInsufficientDriver
            ? "no CUDA driver on this machine"
            : detail::concat("no usable CUDA device (", cudaGetErrorString(status), ")");
    return summary;
  }
  summary.num_gpus = count;
  cudaDeviceProp properties{};
  for (int device = 0; device < count; ++device) {
    if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) continue;
    if (properties.major == 9) ++summary.num_hopper_gpus;
  }
  cudaGetDeviceProperties(&properties, 0);
  summary.description =
      detail::concat(count, " x ", properties.name, " (sm_", properties.major, properties.minor,
                     ", ", properties.multiProcessorCount, " SMs)");
  if (summary.num_hopper_gpus == 0)
    summary.description += "; mok's kernels need a Hopper GPU (sm_90)";
  return summary;
}

}  // namespace mok
