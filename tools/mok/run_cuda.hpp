// The CUDA backend of `mok run`: the fused GPU layer forward (src/runtime/layer_forward.hpp)
// on one GPU per rank, all ranks in this process. Forward only: backward runs on the CPU backend.
#pragma once

#include <string>

#include "mok/synthetic.hpp"
#include "report.hpp"

namespace mok::cli {

// Empty when the CUDA backend can run this configuration here, else the reason.
std::string cuda_backend_unfit_reason(const RunConfig& config);

// "2 x NVIDIA H200 (sm_90, 132 SMs)", or why there is no GPU.
std::string cuda_device_description();

// Runs, times and prints the forward; with config.check compares y on a token sample with the
// CPU reference and, for EP > 1, bitwise with an EP=1 GPU run. Returns whether the check passed.
bool run_cuda(const RunConfig& config, const Problem& problem, RunResult& result);

}  // namespace mok::cli
