// The CUDA backend of `mok run`: the GPU layer forward and backward (mok/layer_runner.hpp) on one
// GPU per rank, all ranks in this process.
#pragma once

#include <string>

#include "mok/synthetic.hpp"
#include "report.hpp"

namespace mok::cli {

// Empty when the CUDA backend can run this configuration here, else the reason.
std::string cuda_backend_unfit_reason(const RunConfig& config);

// "2 x NVIDIA H200 (sm_90, 132 SMs)", or why there is no GPU.
std::string cuda_device_description();

// Runs, times and prints forward and backward; with config.check compares y, dx and d_topk_w on a
// token sample with the CPU reference (the weight gradients too where the whole CPU backward is
// quick) and, for EP > 1, every EP-invariant output bitwise with an EP=1 GPU run. Returns whether
// the check passed.
bool run_cuda(const RunConfig& config, const Problem& problem, RunResult& result);

}  // namespace mok::cli
