// The GPU layer forward in mxfp8 (layer_forward_mxfp8.hpp): buffers sized from shapes, the weight
// cache, and one enqueue of the whole composition per call.
#include "runtime/layer_forward_mxfp8.hpp"

#include <functional>

#include <cuda_runtime.h>

#include "kernels/megakernel/swiglu_mxfp8.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

// The unfused bf16 forward's workspace: every routed row in expert_x, the bf16 rows in expert_y;
// no padding rows (the bf16 GEMMs read an expert's rows wherever they start).
WorkspaceOptions mxfp8_forward_workspace(const LayerForwardMxfp8Options& options) {
  WorkspaceOptions workspace = options.layer.workspace;
  workspace.block_m = 1;
  workspace.expert_rows = 0;
  workspace.expert_y = true;
  return workspace;
}

}  // namespace

LayerForwardMxfp8::LayerForwardMxfp8(const Communicator& comm, const LayerShape& shape,
                                     int64_t tokens_max, const LayerForwardMxfp8Options& options)
    : shape_(shape),
      tokens_max_(tokens_max),
      options_(options.layer),
      workspace_([&] {
        shape.validate(comm.num_ranks());
        validate_precision(shape, Precision::kMxfp8);
        return CommWorkspace(comm, shape, tokens_max, mxfp8_forward_workspace(options));
      }()),
      weights_(shape, workspace_.layout().experts_per_rank(), options.dgrad_weights) {
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  const int64_t rows = checked_int(workspace_.layout().rows_capacity(), "rows capacity");
  token_x_ = device_alloc<bf16>(tokens_max * hidden);
  routed_sums_ = device_alloc<float>(rows * 2 * inter);
  routed_hidden_ = device_alloc<bf16>(rows * inter);
  if (shape.has_shared()) {
    shared_sums_ = device_alloc<float>(tokens_max * 2 * shared_inter);
    shared_hidden_ = device_alloc<bf16>(tokens_max * shared_inter);
    shared_output_ = device_alloc<float>(tokens_max * hidden);
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  num_sms_ = workspace_.num_sms();  // (a share of the GPU when ranks are emulated on it)
}

LayerForwardMxfp8::~LayerForwardMxfp8() {
  for (void* memory : {static_cast<void*>(token_x_), static_cast<void*>(routed_sums_),
                       static_cast<void*>(routed_hidden_), static_cast<void*>(shared_sums_),
                       static_cast<void*>(shared_hidden_), static_cast<void*>(shared_output_),
                       static_cast<void*>(shared_offsets_)}) {
    cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
  }
}

int64_t LayerForwardMxfp8::buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                        const LayerForwardMxfp8Options& options) {
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, num_ranks, tokens_max, mxfp8_forward_workspace(options));
  const int64_t rows = layout.rows_capacity(), hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  bytes += tokens_max * hidden * 2 + rows * inter * (2 * 4 + 2);
  if (shape.has_shared()) {
    bytes += tokens_max * (shared_inter * (2 * 4 + 2) + hidden * 4) + 8;
  }
  return bytes;
}

int64_t LayerForwardMxfp8::buffer_bytes() const {
  LayerForwardMxfp8Options options;
  options.layer = options_;
  return buffer_bytes(shape_, workspace_.num_ranks(), tokens_max_, options);
}

void LayerForwardMxfp8::swiglu(const float* sums, bf16* hidden, int64_t rows, int64_t inter,
                               const int32_t* row_bound, const int32_t* row_source, bf16* saved,
                               cudaStream_t stream) const {
  if (rows == 0) return;
  megakernel::mx_swiglu_kernel<<<static_cast<unsigned>(num_sms_ * 4), megakernel::kMxSwiGluThreads,
                                 0, stream>>>(sums, reinterpret_cast<uint16_t*>(hidden),
                                              reinterpret_cast<uint16_t*>(saved), row_source, rows,
                                              inter, row_bound);
  MOK_CUDA_CHECK_LAUNCH();
}

void LayerForwardMxfp8::run_shared_expert(int64_t num_tokens, cudaStream_t stream,
                                          const gemm::LaunchOptions& gemm_options,
                                          bf16* saved_gate_up) {
  const int tokens = checked_int(num_tokens, "num_tokens");
  const int hidden = static_cast<int>(shape_.hidden);
  const int shared_inter = static_cast<int>(shape_.shared_intermediate);
  const DeviceLayerWeights& weights = weights_.forward();
  write_single_group_offsets(shared_offsets_, tokens, stream);
  gemm::grouped_forward({1, tokens, 2 * shared_inter, hidden}, token_x_, weights.shared_gate_up,
                        shared_offsets_, shared_sums_, gemm::ForwardOutput::kFp32, stream,
                        gemm_options);
  swiglu(shared_sums_, shared_hidden_, tokens, shared_inter, nullptr, nullptr, saved_gate_up,
         stream);
  // (T, I_s) -> (T, H) fp32: the combine adds it before its one bf16 rounding.
  gemm::grouped_forward({1, tokens, hidden, shared_inter}, shared_hidden_, weights.shared_down,
                        shared_offsets_, shared_output_, gemm::ForwardOutput::kFp32, stream,
                        gemm_options);
}

void LayerForwardMxfp8::forward(const bf16* x, const int32_t* topk_idx, const float* topk_w,
                                bf16* y, int64_t num_tokens, cudaStream_t stream,
                                const cudaEvent_t* phase_events, const SavedContext* save) {
  MOK_CHECK_ARG(weights_.has_weights(), "weights",
                "the mxfp8 forward reads the round-tripped weights: call quantize_weights first");
  check_forward_arguments(num_tokens, tokens_max_, x, topk_idx, topk_w, y);
  check_saved_context(shape_, num_tokens, save, "save");
  int recorded = 0;
  const std::function<void()> phase_done = [&] {
    if (phase_events != nullptr) MOK_CUDA_CHECK(cudaEventRecord(phase_events[recorded++], stream));
  };
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(layout.rows_capacity());
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  const int32_t* row_bound = workspace_.expert_offsets() + experts;  // the dispatched rows' end
  const DeviceLayerWeights& weights = weights_.forward();

  phase_done();
  // This rank's tokens round-tripped 1 x 32: the shared expert's operand, and the rows every
  // dispatched copy of them gets.
  mx_rows(x, token_x_, num_tokens, hidden, nullptr, num_sms_, stream);
  stage_tokens(workspace_, token_x_, num_tokens, stream);
  schedule(workspace_, topk_idx, num_tokens, stream);
  phase_done();  // kSchedule
  phase_done();  // kFused: not run
  const bool has_shared = shape_.has_shared() && num_tokens > 0;
  shared_expert_and_dispatch(
      side_, stream, has_shared,
      has_shared ? forward_shared_sms_beside_copy(options_, num_sms_) : 0, options_.gemm,
      [&](const gemm::LaunchOptions& gemm_options) {
        run_shared_expert(num_tokens, stream, gemm_options,
                          save != nullptr ? save->shared_gate_up : nullptr);
      },
      [&](cudaStream_t rows_stream, bool) { dispatch(workspace_, options_.copy, rows_stream); },
      phase_done);
  phase_done();  // kDispatch
  // Only each expert's real rows: the padding rows are neither computed nor round-tripped.
  gemm::GroupedShape gate_up{experts, rows, 2 * inter, hidden};
  gate_up.expert_counts = workspace_.expert_counts();
  gemm::grouped_forward(gate_up, workspace_.expert_x(), weights.gate_up,
                        workspace_.expert_offsets(), routed_sums_, gemm::ForwardOutput::kFp32,
                        stream, options_.gemm);
  swiglu(routed_sums_, routed_hidden_, rows, inter, row_bound, workspace_.row_source(),
         save != nullptr ? save->gate_up : nullptr, stream);
  phase_done();  // kGateUp
  gemm::GroupedShape down{experts, rows, hidden, inter};
  down.expert_counts = workspace_.expert_counts();
  gemm::grouped_forward(down, routed_hidden_, weights.down, workspace_.expert_offsets(),
                        workspace_.expert_y(), gemm::ForwardOutput::kBf16, stream, options_.gemm);
  phase_done();  // kDown
  combine_push(workspace_, options_.copy, stream);
  phase_done();
  combine_reduce(workspace_, topk_w, has_shared ? shared_output_ : nullptr, y, num_tokens, stream);
  phase_done();
}

}  // namespace mok
