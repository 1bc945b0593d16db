// The GPU layer forward in fp8 (layer_forward_fp8.hpp): buffers sized from shapes, the weight
// cache, and one enqueue of the whole composition per call.
#include "runtime/layer_forward_fp8.hpp"

#include <algorithm>
#include <functional>

#include <cuda_runtime.h>

#include "kernels/quantize/layer_kernels.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/gemm_fp8.hpp"
#include "mok/precision.hpp"
#include "mok/quantize.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

// A grid of `per_sm` CTAs per SM for the loops over rows (any grid covers any size).
unsigned loop_grid(int num_sms, int per_sm) { return static_cast<unsigned>(num_sms * per_sm); }

WorkspaceOptions fp8_forward_workspace(const LayerForwardFp8Options& options) {
  WorkspaceOptions workspace = options.layer.workspace;
  // The routed rows arrive as E4M3 rows in routed_x_ (dispatch_fp8), not in expert_x: one row
  // block of it, the least a layout takes, instead of every row.
  workspace.expert_rows = workspace.block_m;
  workspace.expert_y = true;
  return workspace;
}

}  // namespace

LayerForwardFp8::LayerForwardFp8(const Communicator& comm, const LayerShape& shape,
                                 int64_t tokens_max, const LayerForwardFp8Options& options)
    : shape_(shape),
      tokens_max_(tokens_max),
      options_(options.layer),
      swiglu_(options.swiglu),
      pipeline_(options.pipeline),
      workspace_([&] {
        shape.validate(comm.num_ranks());
        validate_precision(shape, Precision::kFp8);
        return CommWorkspace(comm, shape, tokens_max, fp8_forward_workspace(options));
      }()),
      weights_(shape, workspace_.layout().experts_per_rank(), options.transposed_weights) {
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  const int64_t rows = checked_int(workspace_.layout().rows_capacity(), "rows capacity");
  routed_x_ = alloc_fp8_operand(rows, hidden, rows);
  if (swiglu_ == Fp8SwiGlu::kSeparate) {
    routed_gate_up_ = device_alloc<float>(rows * 2 * inter);
    // The SwiGLU quantization runs over the padding rows between experts too, which no GEMM
    // writes: zeros, not uninitialised memory (their bytes never reach a result).
    MOK_CUDA_CHECK(cudaMemset(routed_gate_up_, 0, static_cast<size_t>(rows * 2 * inter) * 4));
  }
  routed_hidden_ = alloc_fp8_operand(rows, inter, rows);
  token_x_ = alloc_fp8_operand(tokens_max, hidden, tokens_max);
  if (shape.has_shared()) {
    if (swiglu_ == Fp8SwiGlu::kSeparate) {
      shared_gate_up_ = device_alloc<float>(tokens_max * 2 * shared_inter);
    }
    shared_hidden_ = alloc_fp8_operand(tokens_max, shared_inter, tokens_max);
    shared_output_ = device_alloc<float>(tokens_max * hidden);
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  num_sms_ = workspace_.num_sms();          // (a share of the GPU when ranks are emulated on it)
  MOK_CUDA_CHECK(cudaDeviceSynchronize());  // the memset above, before any caller's stream
}

LayerForwardFp8::~LayerForwardFp8() {
  for (Fp8Operand* operand : {&routed_x_, &routed_hidden_, &token_x_, &shared_hidden_}) {
    free_fp8_operand(*operand);
  }
  for (void* memory : {static_cast<void*>(routed_gate_up_), static_cast<void*>(shared_gate_up_),
                       static_cast<void*>(shared_output_), static_cast<void*>(shared_offsets_)}) {
    cudaFree(memory);
  }
}

int64_t LayerForwardFp8::buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                      const LayerForwardFp8Options& options) {
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, num_ranks, tokens_max, fp8_forward_workspace(options));
  const int64_t rows = layout.rows_capacity(), hidden = shape.hidden;
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  const int64_t sums = options.swiglu == Fp8SwiGlu::kSeparate ? 2 * 4 : 0;  // fp32 gate/up sums
  bytes += fp8_operand_bytes(rows, hidden, rows) + rows * inter * sums +
           fp8_operand_bytes(rows, inter, rows) + fp8_operand_bytes(tokens_max, hidden, tokens_max);
  if (shape.has_shared()) {
    bytes += tokens_max * shared_inter * sums +
             fp8_operand_bytes(tokens_max, shared_inter, tokens_max) + tokens_max * hidden * 4 + 8;
  }
  return bytes;
}

int64_t LayerForwardFp8::buffer_bytes() const {
  LayerForwardFp8Options options;
  options.layer = options_;
  options.swiglu = swiglu_;
  return buffer_bytes(shape_, workspace_.num_ranks(), tokens_max_, options);
}

void LayerForwardFp8::gate_up_swiglu(const gemm::GroupedShape& shape, const Fp8Operand& x,
                                     const Fp8Operand& w, const int32_t* offsets, float* sums,
                                     const Fp8Operand& h, const int32_t* row_bound,
                                     cudaStream_t stream, const gemm::LaunchOptions& gemm_options,
                                     bf16* saved, const int32_t* saved_rows) {
  if (swiglu_ == Fp8SwiGlu::kInGemm) {
    gemm::grouped_swiglu_fp8(shape, x.data, x.scales, w.data, w.scales, offsets, h.data, h.scales,
                             stream, gemm_options, pipeline_, saved, saved_rows);
    return;
  }
  gemm::grouped_forward_fp8(shape, x.data, x.scales, w.data, w.scales, offsets, sums,
                            gemm::ForwardOutput::kFp32, stream, gemm_options, pipeline_);
  quantize::swiglu_quantize_kernel<<<loop_grid(num_sms_, 4), quantize::kLayerQuantizeThreads, 0,
                                     stream>>>(sums, h.data, h.scales, shape.capacity_rows,
                                               shape.n / 2, row_bound);
  MOK_CUDA_CHECK_LAUNCH();
}

void LayerForwardFp8::run_shared_expert(int64_t num_tokens, cudaStream_t stream,
                                        const gemm::LaunchOptions& gemm_options,
                                        bf16* saved_gate_up) {
  const int tokens = checked_int(num_tokens, "num_tokens");
  const int hidden = static_cast<int>(shape_.hidden);
  const int shared_inter = static_cast<int>(shape_.shared_intermediate);
  write_single_group_offsets(shared_offsets_, tokens, stream);
  gate_up_swiglu({1, tokens, 2 * shared_inter, hidden}, token_x_, weights_.forward().shared_gate_up,
                 shared_offsets_, shared_gate_up_, shared_hidden_, nullptr, stream, gemm_options,
                 saved_gate_up, nullptr);
  gemm::grouped_forward_fp8({1, tokens, hidden, shared_inter}, shared_hidden_.data,
                            shared_hidden_.scales, weights_.forward().shared_down.data,
                            weights_.forward().shared_down.scales, shared_offsets_, shared_output_,
                            gemm::ForwardOutput::kFp32, stream, gemm_options, pipeline_);
}

void LayerForwardFp8::forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
                              int64_t num_tokens, cudaStream_t stream,
                              const cudaEvent_t* phase_events, const SavedContext* save) {
  MOK_CHECK_ARG(weights_.has_weights(), "weights",
                "the fp8 forward reads the quantized weights: call quantize_weights first");
  check_forward_arguments(num_tokens, tokens_max_, x, topk_idx, topk_w, y);
  if (save != nullptr && num_tokens > 0) {
    MOK_CHECK_ARG(swiglu_ == Fp8SwiGlu::kInGemm, "save",
                  "save mode keeps the gate/up GEMM's sums from its epilogue: it needs "
                  "Fp8SwiGlu::kInGemm");
  }
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

  phase_done();
  // This rank's tokens 1 x 128 (the shared expert's operand, and the bytes every dispatched copy
  // of them gets), staged as packed rows for the pulls (half the bf16 rows' bytes).
  if (num_tokens > 0) {
    const quantize::Layout layout =
        quantize::describe(quantize::Format::kFp8, 1, num_tokens, shape_.hidden, 1, 128, false);
    quantize::quantize_gpu(layout, x, quantize::InputType::kBf16, token_x_.data, token_x_.scales,
                           stream);
  }
  stage_fp8_tokens(workspace_, token_x_.data, token_x_.scales, num_tokens, stream);
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
      [&](cudaStream_t rows_stream, bool) {
        dispatch_fp8(workspace_, options_.copy, rows_stream, routed_x_.data, routed_x_.scales);
      },
      phase_done);
  phase_done();  // kDispatch (the E4M3 rows came with the shared expert's phase)
  // Only each expert's real rows: the padding rows are neither computed nor quantized.
  gemm::GroupedShape gate_up{experts, rows, 2 * inter, hidden};
  gate_up.expert_counts = workspace_.expert_counts();
  gate_up_swiglu(gate_up, routed_x_, weights_.forward().gate_up, workspace_.expert_offsets(),
                 routed_gate_up_, routed_hidden_, row_bound, stream, options_.gemm,
                 save != nullptr ? save->gate_up : nullptr, workspace_.row_source());
  phase_done();  // kGateUp
  gemm::GroupedShape down{experts, rows, hidden, inter};
  down.expert_counts = workspace_.expert_counts();
  gemm::grouped_forward_fp8(down, routed_hidden_.data, routed_hidden_.scales,
                            weights_.forward().down.data, weights_.forward().down.scales,
                            workspace_.expert_offsets(), workspace_.expert_y(),
                            gemm::ForwardOutput::kBf16, stream, options_.gemm, pipeline_);
  phase_done();  // kDown
  combine_push(workspace_, options_.copy, stream);
  phase_done();
  combine_reduce(workspace_, topk_w, has_shared ? shared_output_ : nullptr, y, num_tokens, stream);
  phase_done();
}

}  // namespace mok
