// The steps the bf16 and fp8 backwards share (layer_backward.hpp): staging the inputs, the
// shared expert's gradients when there is no token, the dispatch of x and dy rows, the arguments'
// checks, and the launch choices both make.
#include <algorithm>

#include <cuda_runtime.h>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/layer_backward.hpp"

namespace mok {
namespace {

__global__ void fill_kernel(float* values, int64_t count, float value) {
  for (int64_t index = blockIdx.x * blockDim.x + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    values[index] = value;
  }
}

}  // namespace

void stage_backward_inputs(CommWorkspace& workspace, const bf16* x, const int32_t* topk_idx,
                           const float* topk_w, const bf16* dy, int64_t num_tokens,
                           cudaStream_t stream) {
  if (workspace.num_ranks() > 1) {
    stage_tokens(workspace, x, num_tokens, stream);
    MOK_CUDA_CHECK(cudaMemcpyAsync(workspace.dy(), dy,
                                   static_cast<size_t>(num_tokens * workspace.layout().row_bytes()),
                                   cudaMemcpyDeviceToDevice, stream));
  }
  // The router weights beside the ids, in the schedule's kernel.
  schedule(workspace, topk_idx, num_tokens, stream, topk_w);
}

void zero_shared_gradients(const LayerShape& shape, const DeviceLayerGradients& grads,
                           cudaStream_t stream) {
  if (!shape.has_shared() || grads.output == gemm::WgradOutput::kAccumulateFp32) return;
  const size_t element_bytes = grads.output == gemm::WgradOutput::kBf16 ? 2 : 4;
  const size_t elements = static_cast<size_t>(shape.shared_intermediate * shape.hidden);
  MOK_CUDA_CHECK(cudaMemsetAsync(grads.shared_gate_up, 0, 2 * elements * element_bytes, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(grads.shared_down, 0, elements * element_bytes, stream));
}

float* make_ones(int64_t count, int device) {
  float* ones = device_alloc<float>(count);
  MOK_CUDA_CHECK(cudaSetDevice(device));
  fill_kernel<<<static_cast<unsigned>(std::clamp<int64_t>((count + 255) / 256, 1, 1024)), 256>>>(
      ones, count, 1.0f);
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  return ones;
}

gemm::LaunchOptions wgrads_for_ranks_on_device(const Communicator& comm, gemm::LaunchOptions gemm) {
  // NOTE: ranks emulated on one GPU rely on every rank's kernels finding SMs while the others'
  // wait on them; a CTA cluster needs SMs side by side in one GPC, which the waiting kernels can
  // hold (EP 8 emulated hung so): single CTAs there, unless the caller chose.
  if (comm.ranks_on_device() > 1 && gemm.wgrad_cluster == 0) gemm.wgrad_cluster = 1;
  return gemm;
}

int backward_shared_sms_beside_copy(const LayerBackwardOptions& options, int num_sms,
                                    int num_ranks) {
  if (!options.overlap_shared_with_dispatch) return 0;
  // One rank: the dispatch copies local rows on every SM in a fraction of the shared expert's
  // time; beside it, its CTAs would hold SMs from the shared GEMMs for all of it.
  if (options.local_dispatch_on_every_sm && num_ranks == 1) return 0;
  return gemm_sms_beside_copy(num_sms, options.copy.num_ctas, options.gemm.num_sms);
}

void dispatch_x_and_dy(CommWorkspace& workspace, const LayerBackwardOptions& options,
                       cudaStream_t stream, bool beside, const bf16* x, const bf16* dy) {
  if (workspace.num_ranks() > 1) {
    dispatch(workspace, options.copy, stream, comm::DispatchTensor::kX);
    dispatch(workspace, options.copy, stream, comm::DispatchTensor::kDy);
    return;
  }
  // One rank alone: by token, from the caller's x and dy (nothing was staged).
  CopyConfig copy = options.copy;
  if (!beside && options.local_dispatch_on_every_sm) copy.num_ctas = 0;
  dispatch_tokens(workspace, copy, stream, x, dy);
}

void check_backward_arguments(const LayerShape& shape, int64_t tokens_max, int64_t num_tokens,
                              const void* x, const int32_t* topk_idx, const float* topk_w,
                              const void* dy, const void* dx, const float* d_topk_w,
                              const DeviceLayerGradients& grads) {
  MOK_CHECK_ARG(num_tokens >= 0 && num_tokens <= tokens_max, "num_tokens", num_tokens,
                " out of range [0, ", tokens_max, "]");
  MOK_CHECK_ARG(num_tokens == 0 || (x != nullptr && topk_idx != nullptr && topk_w != nullptr &&
                                    dy != nullptr && dx != nullptr && d_topk_w != nullptr),
                "x", "null tensor pointer for ", num_tokens, " tokens");
  MOK_CHECK_ARG(grads.gate_up != nullptr && grads.down != nullptr, "grads",
                "null routed expert gradients");
  MOK_CHECK_ARG(
      !shape.has_shared() || (grads.shared_gate_up != nullptr && grads.shared_down != nullptr),
      "grads", "null shared expert gradients (I_s = ", shape.shared_intermediate, ")");
}

const char* phase_name(BackwardPhase phase) {
  switch (phase) {
    case BackwardPhase::kSchedule:
      return "schedule";
    case BackwardPhase::kSharedExpert:
      return "shared-expert";
    case BackwardPhase::kDispatch:
      return "dispatch";
    case BackwardPhase::kDispatchX:
      return "dispatch-x";
    case BackwardPhase::kGateUp:
      return "gate-up";
    case BackwardPhase::kDownDgrad:
      return "down-dgrad";
    case BackwardPhase::kSwiGluBackward:
      return "swiglu-backward";
    case BackwardPhase::kGateUpDgrad:
      return "gate-up-dgrad";
    case BackwardPhase::kCombinePush:
      return "combine-push";
    case BackwardPhase::kWgradDown:
      return "wgrad-down";
    case BackwardPhase::kWgradGateUp:
      return "wgrad-gate-up";
    case BackwardPhase::kCombineReduce:
      return "combine-reduce";
  }
  return "?";
}

}  // namespace mok
