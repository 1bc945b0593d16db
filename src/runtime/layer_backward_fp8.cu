// The GPU layer backward in fp8 (layer_backward_fp8.hpp): buffers sized from shapes and one enqueue
// of the whole composition per call.
#include "runtime/layer_backward_fp8.hpp"

#include <algorithm>

#include <cuda_runtime.h>

#include "kernels/comm/flags.cuh"
#include "kernels/megakernel/expert_rows_fp8.cuh"
#include "kernels/megakernel/swiglu_backward_fp8.cuh"
#include "kernels/quantize/layer_kernels.cuh"
#include "kernels/quantize/transposed_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

constexpr int64_t kBlock = 128;  // the recipe's activation blocks: 1 x 128, and 128 x 1

int64_t round_up_to_block(int64_t rows) { return (rows + kBlock - 1) / kBlock * kBlock; }

// The SwiGLU backward with its outputs' quantizations, a CTA per 128-row block
// (swiglu_backward_fp8.cuh).
__global__ void __launch_bounds__(megakernel::kSwiGluBackwardFp8Threads, 1)
    swiglu_backward_fp8_routed_kernel(comm::WorkspaceView view,
                                      megakernel::SwiGluBackwardFp8Rows rows) {
  if (comm::cta_sees_error(view)) return;
  extern __shared__ float4 staged[];
  megakernel::swiglu_backward_fp8_routed(view, rows, reinterpret_cast<float*>(staged));
}

__global__ void __launch_bounds__(megakernel::kSwiGluBackwardFp8Threads, 1)
    swiglu_backward_fp8_shared_kernel(megakernel::SwiGluBackwardFp8Rows rows) {
  extern __shared__ float4 staged[];
  megakernel::swiglu_backward_fp8_shared(rows, reinterpret_cast<float*>(staged));
}

// One rank alone: the expert rows of x and dy gathered from the tokens and quantized both ways
// (expert_rows_fp8.cuh).
__global__ void __launch_bounds__(megakernel::kExpertRowsThreads, megakernel::kExpertRowsCtasPerSm)
    quantize_expert_rows_kernel(comm::WorkspaceView view, megakernel::ExpertRowsFp8 rows) {
  if (comm::cta_sees_error(view)) return;
  extern __shared__ uint4 tiles[];
  megakernel::quantize_expert_rows(view, rows, reinterpret_cast<uint32_t*>(tiles));
}

void allow_large_shared_memory() {
  for (const void* kernel : {reinterpret_cast<const void*>(swiglu_backward_fp8_routed_kernel),
                             reinterpret_cast<const void*>(swiglu_backward_fp8_shared_kernel)}) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        megakernel::kSwiGluBackwardFp8SharedBytes));
  }
  MOK_CUDA_CHECK(cudaFuncSetAttribute(quantize_expert_rows_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      megakernel::kExpertRowsSharedBytes));
}

// rows.padded_rows / 128 CTAs: one per 128-row block of the transposed operands.
unsigned swiglu_backward_ctas(const megakernel::SwiGluBackwardFp8Rows& rows) {
  return static_cast<unsigned>(rows.padded_rows / megakernel::kSwiGluFp8Block);
}

// x (padded_rows, cols) bf16 -> out (cols, padded_rows), 128 x 1 down the rows of each group of
// `groups` (expert_offsets on 128-row boundaries, counts or null), the rows past a group's count
// as zeros.
void quantize_along_rows(const bf16* x, const Fp8Operand& out, int64_t padded_rows, int64_t cols,
                         const int32_t* offsets, const int32_t* counts, int groups,
                         cudaStream_t stream) {
  if (padded_rows == 0) return;
  const auto* input = reinterpret_cast<const uint16_t*>(x);  // bf16 as its 16-bit pattern
  const int64_t tiles = quantize::TransposedTile<uint16_t>::tiles_per_matrix(padded_rows, cols);
  MOK_CHECK_ARG(tiles < (int64_t{1} << 31), "rows", "too many tiles: ", tiles);
  quantize::quantize_transposed_kernel<uint16_t, quantize::Format::kFp8, 128, quantize::ExpertRows>
      <<<static_cast<unsigned>(tiles), quantize::kTransposedThreads, 0, stream>>>(
          input, out.data, out.scales, padded_rows, cols, /*vector_loads=*/true,
          quantize::ExpertRows{offsets, counts, groups});
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

LayerBackwardFp8::Operands LayerBackwardFp8::alloc_operands(int64_t rows, int64_t padded_rows,
                                                            int64_t hidden, int64_t inter) {
  Operands out;
  out.x = alloc_fp8_operand(rows, hidden, rows);
  out.dy = alloc_fp8_operand(rows, hidden, rows);
  out.gate_up = device_alloc<bf16>(rows * 2 * inter);
  out.grad_hidden = device_alloc<float>(rows * inter);
  out.d_gate_up_rows = alloc_fp8_operand(rows, 2 * inter, rows);
  // (features, padded_rows) with a scale per (feature, 128 rows): scale_rows features.
  const auto transposed = [&](int64_t features) {
    return Fp8Operand{device_alloc<uint8_t>(features * padded_rows),
                      device_alloc<float>(features * (padded_rows / kBlock))};
  };
  out.x_t = transposed(hidden);
  out.dy_t = transposed(hidden);
  out.d_gate_up_t = transposed(2 * inter);
  out.hidden_t = transposed(inter);
  return out;
}

void LayerBackwardFp8::free_operands(Operands& operands) {
  for (Fp8Operand* operand : {&operands.x, &operands.dy, &operands.d_gate_up_rows, &operands.x_t,
                              &operands.dy_t, &operands.d_gate_up_t, &operands.hidden_t}) {
    free_fp8_operand(*operand);
  }
  for (void* memory :
       {static_cast<void*>(operands.gate_up), static_cast<void*>(operands.grad_hidden)}) {
    cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
  }
  operands = {};
}

int64_t LayerBackwardFp8::operand_bytes(int64_t rows, int64_t padded_rows, int64_t hidden,
                                        int64_t inter) {
  const int64_t row_operands = 2 * fp8_operand_bytes(rows, hidden, rows) +
                               rows * inter * (2 * 2 + 4) +
                               fp8_operand_bytes(rows, 2 * inter, rows);
  const int64_t features = 2 * hidden + 3 * inter;  // x_t, dy_t, d_gate_up_t, hidden_t
  return row_operands + features * padded_rows + features * (padded_rows / kBlock) * 4;
}

LayerBackwardFp8::LayerBackwardFp8(const Communicator& comm, const LayerShape& shape,
                                   int64_t tokens_max, const LayerBackwardFp8Options& options)
    : shape_(shape),
      tokens_max_(tokens_max),
      options_(options.layer),
      pipeline_(options.pipeline),
      workspace_([&] {
        shape.validate(comm.num_ranks());
        validate_precision(shape, Precision::kFp8);
        MOK_CHECK_ARG(options.layer.workspace.block_m % kBlock == 0, "workspace.block_m",
                      "the fp8 wgrads need experts on 128-row boundaries, got ",
                      options.layer.workspace.block_m);
        return CommWorkspace(comm, shape, tokens_max, backward_workspace(options.layer));
      }()) {
  const int64_t rows = checked_int(workspace_.layout().rows_capacity(), "rows capacity");
  routed_padded_rows_ = round_up_to_block(rows);
  checked_int(routed_padded_rows_, "rows capacity");
  routed_ = alloc_operands(rows, routed_padded_rows_, shape.hidden, shape.intermediate);
  if (shape.has_shared()) {
    shared_ = alloc_operands(tokens_max, round_up_to_block(tokens_max), shape.hidden,
                             shape.shared_intermediate);
    shared_dx_ = device_alloc<float>(tokens_max * shape.hidden);
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  ones_ = make_ones(tokens_max * shape.top_k, comm.device());
  num_sms_ = workspace_.num_sms();  // (a share of the GPU when ranks are emulated on it)
  allow_large_shared_memory();
}

LayerBackwardFp8::~LayerBackwardFp8() {
  free_operands(routed_);
  free_operands(shared_);
  for (void* memory : {static_cast<void*>(ones_), static_cast<void*>(shared_dx_),
                       static_cast<void*>(shared_offsets_)}) {
    cudaFree(memory);
  }
}

int64_t LayerBackwardFp8::buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                       const LayerBackwardOptions& options) {
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, num_ranks, tokens_max, backward_workspace(options));
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  bytes += operand_bytes(layout.rows_capacity(), round_up_to_block(layout.rows_capacity()),
                         shape.hidden, shape.intermediate);
  bytes += tokens_max * shape.top_k * 4;  // ones
  if (shape.has_shared()) {
    bytes += operand_bytes(tokens_max, round_up_to_block(tokens_max), shape.hidden,
                           shape.shared_intermediate) +
             tokens_max * shape.hidden * 4 + 8;
  }
  return bytes;
}

int64_t LayerBackwardFp8::buffer_bytes() const {
  return buffer_bytes(shape_, workspace_.num_ranks(), tokens_max_, options_);
}

void LayerBackwardFp8::run_shared_expert(const Fp8WeightCache& weights, const bf16* x,
                                         const bf16* dy, const DeviceLayerGradients& grads,
                                         int tokens, cudaStream_t stream,
                                         const gemm::LaunchOptions& gemm_options,
                                         const bf16* saved_gate_up) {
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.shared_intermediate);
  const Fp8LayerWeights& forward = weights.forward();
  const Fp8LayerWeights& transposed = weights.transposed();
  const Operands& op = shared_;
  write_single_group_offsets(shared_offsets_, tokens, stream);
  // This rank's own tokens and their dy, 1 x 128: the bytes the dispatched copies get too.
  const gemm::GroupedShape gate_up{1, tokens, 2 * inter, hidden};
  const gemm::GroupedShape down{1, tokens, hidden, inter};
  if (saved_gate_up == nullptr) {
    quantize_fp8_rows(x, op.x, tokens, hidden, nullptr, num_sms_, stream);
    gemm::grouped_forward_fp8(gate_up, op.x.data, op.x.scales, forward.shared_gate_up.data,
                              forward.shared_gate_up.scales, shared_offsets_, op.gate_up,
                              gemm::ForwardOutput::kBf16, stream, gemm_options, pipeline_);
  }
  quantize_fp8_rows(dy, op.dy, tokens, hidden, nullptr, num_sms_, stream);
  gemm::grouped_dgrad_fp8(down, op.dy.data, op.dy.scales, transposed.shared_down.data,
                          transposed.shared_down.scales, shared_offsets_, op.grad_hidden,
                          gemm::DgradOutput::kFp32, stream, gemm_options, pipeline_);
  // The tokens as one group, their 128 x 1 blocks down the tokens.
  const megakernel::SwiGluBackwardFp8Rows rows =
      swiglu_rows(op, saved_gate_up != nullptr ? saved_gate_up : op.gate_up, false, inter,
                  round_up_to_block(tokens), quantize::ExpertRows{shared_offsets_, nullptr, 1});
  swiglu_backward_fp8_shared_kernel<<<swiglu_backward_ctas(rows),
                                      megakernel::kSwiGluBackwardFp8Threads,
                                      megakernel::kSwiGluBackwardFp8SharedBytes, stream>>>(rows);
  MOK_CUDA_CHECK_LAUNCH();
  // dx_shared (T, H) fp32, added by the combine's reduce.
  gemm::grouped_dgrad_fp8(gate_up, op.d_gate_up_rows.data, op.d_gate_up_rows.scales,
                          transposed.shared_gate_up.data, transposed.shared_gate_up.scales,
                          shared_offsets_, shared_dx_, gemm::DgradOutput::kFp32, stream,
                          gemm_options, pipeline_);
  // The wgrads over the tokens in order, their operands 128 x 1 down the tokens.
  weight_gradients(op, x, dy, 1, static_cast<int>(round_up_to_block(tokens)), inter,
                   shared_offsets_, nullptr, grads.shared_gate_up, grads.shared_down, grads.output,
                   stream, gemm_options, [] {});
}

template <class Between>
void LayerBackwardFp8::weight_gradients(const Operands& op, const bf16* x, const bf16* dy,
                                        int groups, int padded_rows, int inter,
                                        const int32_t* offsets, const int32_t* counts,
                                        void* grad_gate_up, void* grad_down,
                                        gemm::WgradOutput output, cudaStream_t stream,
                                        const gemm::LaunchOptions& gemm_options,
                                        const Between& between) {
  const int hidden = static_cast<int>(shape_.hidden);
  // (hidden_t and d_gate_up_t come from the SwiGLU backward; x_t and dy_t from
  // quantize_expert_rows when x and dy are null)
  if (dy != nullptr) {
    quantize_along_rows(dy, op.dy_t, padded_rows, hidden, offsets, counts, groups, stream);
  }
  gemm::GroupedShape down{groups, padded_rows, hidden, inter};
  down.expert_counts = counts;
  gemm::grouped_wgrad_fp8(down, op.dy_t.data, op.dy_t.scales, op.hidden_t.data, op.hidden_t.scales,
                          offsets, grad_down, output, stream, gemm_options);
  between();
  if (x != nullptr) {
    quantize_along_rows(x, op.x_t, padded_rows, hidden, offsets, counts, groups, stream);
  }
  gemm::GroupedShape gate_up{groups, padded_rows, 2 * inter, hidden};
  gate_up.expert_counts = counts;
  gemm::grouped_wgrad_fp8(gate_up, op.d_gate_up_t.data, op.d_gate_up_t.scales, op.x_t.data,
                          op.x_t.scales, offsets, grad_gate_up, output, stream, gemm_options);
}

template <class Mark>
void LayerBackwardFp8::run_routed_experts(const Fp8WeightCache& weights,
                                          const DeviceLayerGradients& grads,
                                          const bf16* saved_gate_up, cudaStream_t stream,
                                          const Mark& mark) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(layout.rows_capacity());
  const int padded = static_cast<int>(routed_padded_rows_);
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  const int* offsets = workspace_.expert_offsets();
  const int* counts = workspace_.expert_counts();
  const gemm::LaunchOptions& gemm_options = options_.gemm;
  const Fp8LayerWeights& forward = weights.forward();
  const Fp8LayerWeights& transposed = weights.transposed();
  const Operands& op = routed_;
  // Only each expert's real rows: the padding rows are neither computed nor summed.
  gemm::GroupedShape gate_up{experts, rows, 2 * inter, hidden};
  gate_up.expert_counts = counts;
  gemm::GroupedShape down{experts, rows, hidden, inter};
  down.expert_counts = counts;
  if (saved_gate_up == nullptr) {
    gemm::grouped_forward_fp8(gate_up, op.x.data, op.x.scales, forward.gate_up.data,
                              forward.gate_up.scales, offsets, op.gate_up,
                              gemm::ForwardOutput::kBf16, stream, gemm_options, pipeline_);
  }
  mark();
  // g = dy · W_down on the unscaled dy rows, fp32.
  gemm::grouped_dgrad_fp8(down, op.dy.data, op.dy.scales, transposed.down.data,
                          transposed.down.scales, offsets, op.grad_hidden, gemm::DgradOutput::kFp32,
                          stream, gemm_options, pipeline_);
  mark();
  const megakernel::SwiGluBackwardFp8Rows swiglu = swiglu_rows(
      op, saved_gate_up != nullptr ? saved_gate_up : op.gate_up, saved_gate_up != nullptr, inter,
      padded, quantize::ExpertRows{offsets, counts, experts});
  swiglu_backward_fp8_routed_kernel<<<swiglu_backward_ctas(swiglu),
                                      megakernel::kSwiGluBackwardFp8Threads,
                                      megakernel::kSwiGluBackwardFp8SharedBytes, stream>>>(
      workspace_.view(), swiglu);
  MOK_CUDA_CHECK_LAUNCH();
  mark();
  // dx rows (bf16) into expert_y for the push.
  gemm::grouped_dgrad_fp8(gate_up, op.d_gate_up_rows.data, op.d_gate_up_rows.scales,
                          transposed.gate_up.data, transposed.gate_up.scales, offsets,
                          workspace_.expert_y(), gemm::DgradOutput::kBf16, stream, gemm_options,
                          pipeline_);
  mark();
  combine_push(workspace_, options_.copy, stream);
  mark();
  // While the peers' dx rows arrive: dW_down = dyᵀ · (w·h), dW_gate_up = d_gate_upᵀ · x, their
  // operands 128 x 1 down each expert's rows.
  const bool gathered = gathers_expert_rows();  // x_t, dy_t from quantize_expert_rows
  weight_gradients(op, gathered ? nullptr : workspace_.expert_x(),
                   gathered ? nullptr : workspace_.expert_dy(), experts, padded, inter, offsets,
                   counts, grads.gate_up, grads.down, grads.output, stream, gemm_options, mark);
  mark();
}

void LayerBackwardFp8::quantize_expert_rows(const bf16* x, const bf16* dy, bool x_rows,
                                            cudaStream_t stream) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const Operands& op = routed_;
  megakernel::ExpertRowsFp8 rows;
  rows.x = reinterpret_cast<const __nv_bfloat16*>(x);
  rows.dy = reinterpret_cast<const __nv_bfloat16*>(dy);
  rows.hidden = static_cast<int>(shape_.hidden);
  rows.padded_rows = routed_padded_rows_;
  rows.experts = quantize::ExpertRows{workspace_.expert_offsets(), workspace_.expert_counts(),
                                      static_cast<int>(layout.experts_per_rank())};
  rows.dy_rows = {op.dy.data, op.dy.scales};
  rows.x_rows = x_rows ? megakernel::Fp8Codes{op.x.data, op.x.scales} : megakernel::Fp8Codes{};
  rows.dy_t = {op.dy_t.data, op.dy_t.scales};
  rows.x_t = {op.x_t.data, op.x_t.scales};
  const int64_t ctas = routed_padded_rows_ / kBlock * (shape_.hidden / kBlock);
  if (ctas == 0) return;
  MOK_CHECK_ARG(ctas < (int64_t{1} << 31), "rows", "too many tiles: ", ctas);
  quantize_expert_rows_kernel<<<static_cast<unsigned>(ctas), megakernel::kExpertRowsThreads,
                                megakernel::kExpertRowsSharedBytes, stream>>>(workspace_.view(),
                                                                              rows);
  MOK_CUDA_CHECK_LAUNCH();
}

void LayerBackwardFp8::backward(const Fp8WeightCache& weights, const bf16* x,
                                const int32_t* topk_idx, const float* topk_w, const bf16* dy,
                                bf16* dx, float* d_topk_w, const DeviceLayerGradients& grads,
                                int64_t num_tokens, cudaStream_t stream,
                                const cudaEvent_t* phase_events, const SavedContext* saved) {
  MOK_CHECK_ARG(weights.has_weights(), "weights",
                "the fp8 backward reads quantized weights: the cache has none yet (quantize it "
                "first)");
  MOK_CHECK_ARG(
      weights.has_transposed() && weights.fits(shape_, workspace_.layout().experts_per_rank()),
      "weights", "the fp8 backward needs a cache of this layer's ", shape_.describe(),
      " with the transposed layout");
  check_backward_arguments(shape_, tokens_max_, num_tokens, x, topk_idx, topk_w, dy, dx, d_topk_w,
                           grads);
  check_saved_context(shape_, num_tokens, saved, "saved");
  const bf16* saved_gate_up = saved != nullptr ? saved->gate_up : nullptr;
  const bf16* saved_shared_gate_up = saved != nullptr ? saved->shared_gate_up : nullptr;
  const int tokens = static_cast<int>(num_tokens);
  const PhaseMarks mark(phase_events, stream);
  mark();
  stage_backward_inputs(workspace_, x, topk_idx, topk_w, dy, num_tokens, stream);
  mark();
  const int experts = static_cast<int>(workspace_.layout().experts_per_rank());
  const int32_t* row_bound = workspace_.expert_offsets() + experts;  // the dispatched rows' end
  const int64_t rows = workspace_.layout().rows_capacity();
  const bool shared = shape_.has_shared() && tokens > 0;
  // One rank alone: no dispatch; its expert rows are gathered from x and dy and quantized in
  // one pass (quantize_expert_rows) instead of copied and then read by three quantizers.
  const bool one_rank = gathers_expert_rows();
  shared_expert_and_dispatch(
      side_, stream, shared,
      shared && !one_rank
          ? backward_shared_sms_beside_copy(options_, num_sms_, workspace_.num_ranks())
          : 0,
      options_.gemm,
      [&](const gemm::LaunchOptions& gemm_options) {
        run_shared_expert(weights, x, dy, grads, tokens, stream, gemm_options,
                          saved_shared_gate_up);
      },
      [&](cudaStream_t rows_stream, bool beside) {
        if (!one_rank) dispatch_x_and_dy(workspace_, options_, rows_stream, beside, x, dy);
      },
      mark);
  if (one_rank) {
    quantize_expert_rows(x, dy, /*x_rows=*/saved_gate_up == nullptr, stream);
  } else {
    // (the x rows 1 x 128 feed the gate/up recompute only)
    if (saved_gate_up == nullptr) {
      quantize_fp8_rows(workspace_.expert_x(), routed_.x, rows, shape_.hidden, row_bound, num_sms_,
                        stream);
    }
    quantize_fp8_rows(workspace_.expert_dy(), routed_.dy, rows, shape_.hidden, row_bound, num_sms_,
                      stream);
  }
  mark();
  mark();  // (x's rows came with dy's: kDispatchX)
  run_routed_experts(weights, grads, saved_gate_up, stream, mark);
  if (tokens == 0) zero_shared_gradients(shape_, grads, stream);
  // dx = Σ_j slot_j (weights of 1: exact) + shared dx, one rounding; d_topk_w beside it.
  combine_reduce(workspace_, ones_, shared ? shared_dx_ : nullptr, dx, num_tokens, stream,
                 d_topk_w);
  mark();
}

}  // namespace mok
