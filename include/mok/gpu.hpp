// Which GPUs this process can use: for choosing a backend, sizing runs, and the reason a GPU test
// skips.
#pragma once

#include <string>

namespace mok {

struct GpuSummary {
  int num_gpus = 0;         // visible CUDA devices
  int num_hopper_gpus = 0;  // of those, compute capability 9.x (what the sm_90a kernels run on)
  std::string description;  // "2 x NVIDIA H200 (sm_90, 132 SMs)" or why there is none
};

GpuSummary query_gpus();

}  // namespace mok
