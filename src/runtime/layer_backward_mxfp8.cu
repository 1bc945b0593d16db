// The GPU layer backward in mxfp8 (layer_backward_mxfp8.hpp): buffers sized from shapes and one
// enqueue of the whole composition per call.
#include "runtime/layer_backward_mxfp8.hpp"

#include <algorithm>

#include <cuda_runtime.h>

#include "kernels/comm/flags.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

// backward_workspace with no padding rows: the bf16 GEMMs read an expert's rows wherever they
// start, and the 32 x 1 blocks start at each expert's first row whatever the layout.
WorkspaceOptions mxfp8_backward_workspace(const LayerBackwardOptions& options) {
  WorkspaceOptions workspace = backward_workspace(options);
  workspace.block_m = 1;
  return workspace;
}

}  // namespace

LayerBackwardMxfp8::Operands LayerBackwardMxfp8::alloc_operands(int64_t rows, int64_t hidden,
                                                                int64_t inter) {
  Operands out;
  out.rows = device_alloc<bf16>(rows * hidden);
  out.gate_up = device_alloc<bf16>(rows * 2 * inter);
  out.grad_hidden = device_alloc<float>(rows * inter);
  out.d_gate_up_rows = device_alloc<bf16>(rows * 2 * inter);
  out.d_gate_up_columns = device_alloc<bf16>(rows * 2 * inter);
  out.hidden_columns = device_alloc<bf16>(rows * inter);
  return out;
}

void LayerBackwardMxfp8::free_operands(Operands& operands) {
  for (void* memory :
       {static_cast<void*>(operands.rows), static_cast<void*>(operands.gate_up),
        static_cast<void*>(operands.grad_hidden), static_cast<void*>(operands.d_gate_up_rows),
        static_cast<void*>(operands.d_gate_up_columns),
        static_cast<void*>(operands.hidden_columns)}) {
    cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
  }
  operands = {};
}

int64_t LayerBackwardMxfp8::operand_bytes(int64_t rows, int64_t hidden, int64_t inter) {
  // rows, gate_up, grad_hidden, d_gate_up_rows, d_gate_up_columns, hidden_columns
  return rows * (hidden * 2 + inter * (2 * 2 + 4 + 2 * 2 + 2 * 2 + 2));
}

megakernel::SwiGluBackwardMxRows LayerBackwardMxfp8::swiglu_rows(
    const Operands& op, const bf16* gate_up, bool saved_by_source, int inter,
    const quantize::MxColumnGroups& groups) {
  return {reinterpret_cast<const __nv_bfloat16*>(gate_up),
          saved_by_source,
          op.grad_hidden,
          reinterpret_cast<uint16_t*>(op.d_gate_up_rows),
          reinterpret_cast<uint16_t*>(op.d_gate_up_columns),
          reinterpret_cast<uint16_t*>(op.hidden_columns),
          inter,
          groups};
}

dim3 LayerBackwardMxfp8::swiglu_grid(int64_t rows, int groups) const {
  // Groups on y; on x, the blocks of a group whose rows were spread evenly, at least enough CTAs
  // to fill the GPU (a skewed group's blocks are strided over them).
  const int groups_y = std::clamp(groups, 1, 65535);
  const int64_t even = (rows / groups_y + quantize::kMxBlock - 1) / quantize::kMxBlock;
  const int64_t ctas_x =
      std::clamp<int64_t>(std::max<int64_t>(even, num_sms_ * 8 / groups_y), 1, 65535);
  return dim3(static_cast<unsigned>(ctas_x), static_cast<unsigned>(groups_y));
}

LayerBackwardMxfp8::LayerBackwardMxfp8(const Communicator& comm, const LayerShape& shape,
                                       int64_t tokens_max, const LayerBackwardOptions& options)
    : shape_(shape), tokens_max_(tokens_max), options_(options), workspace_([&] {
        shape.validate(comm.num_ranks());
        validate_precision(shape, Precision::kMxfp8);
        return CommWorkspace(comm, shape, tokens_max, mxfp8_backward_workspace(options));
      }()) {
  const int64_t rows = checked_int(workspace_.layout().rows_capacity(), "rows capacity");
  routed_ = alloc_operands(rows, shape.hidden, shape.intermediate);
  if (shape.has_shared()) {
    shared_ = alloc_operands(tokens_max, shape.hidden, shape.shared_intermediate);
    shared_dx_ = device_alloc<float>(tokens_max * shape.hidden);
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  ones_ = make_ones(tokens_max * shape.top_k, comm.device());
  num_sms_ = workspace_.num_sms();  // (a share of the GPU when ranks are emulated on it)
  options_.gemm = wgrads_for_ranks_on_device(comm, options_.gemm);
}

LayerBackwardMxfp8::~LayerBackwardMxfp8() {
  free_operands(routed_);
  free_operands(shared_);
  for (void* memory : {static_cast<void*>(ones_), static_cast<void*>(shared_dx_),
                       static_cast<void*>(shared_offsets_)}) {
    cudaFree(memory);
  }
}

int64_t LayerBackwardMxfp8::buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                         const LayerBackwardOptions& options) {
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, num_ranks, tokens_max, mxfp8_backward_workspace(options));
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  bytes += operand_bytes(layout.rows_capacity(), shape.hidden, shape.intermediate);
  bytes += tokens_max * shape.top_k * 4;  // ones
  if (shape.has_shared()) {
    bytes += operand_bytes(tokens_max, shape.hidden, shape.shared_intermediate) +
             tokens_max * shape.hidden * 4 + 8;
  }
  return bytes;
}

int64_t LayerBackwardMxfp8::buffer_bytes() const {
  return buffer_bytes(shape_, workspace_.num_ranks(), tokens_max_, options_);
}

void LayerBackwardMxfp8::run_shared_expert(const MxWeightCache& weights, const bf16* x,
                                           const bf16* dy, const DeviceLayerGradients& grads,
                                           int tokens, cudaStream_t stream,
                                           const gemm::LaunchOptions& gemm_options,
                                           const bf16* saved_gate_up) {
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.shared_intermediate);
  const DeviceLayerWeights& forward = weights.forward();
  const DeviceLayerWeights& dgrad = weights.dgrad();
  const Operands& op = shared_;
  const int sms = gemm_options.num_sms > 0 ? gemm_options.num_sms : num_sms_;
  write_single_group_offsets(shared_offsets_, tokens, stream);
  quantize::MxColumnGroups tokens_group;  // the tokens in order, one group
  tokens_group.offsets = shared_offsets_;
  tokens_group.num_groups = 1;
  if (saved_gate_up == nullptr) {
    mx_rows(x, op.rows, tokens, hidden, nullptr, sms, stream);
    gemm::grouped_forward({1, tokens, 2 * inter, hidden}, op.rows, forward.shared_gate_up,
                          shared_offsets_, op.gate_up, gemm::ForwardOutput::kBf16, stream,
                          gemm_options);
  }
  mx_rows(dy, op.rows, tokens, hidden, nullptr, sms, stream);
  gemm::grouped_dgrad({1, tokens, hidden, inter}, op.rows, dgrad.shared_down, shared_offsets_,
                      op.grad_hidden, gemm::DgradOutput::kFp32, stream, gemm_options);
  const megakernel::SwiGluBackwardMxRows rows = swiglu_rows(
      op, saved_gate_up != nullptr ? saved_gate_up : op.gate_up, false, inter, tokens_group);
  megakernel::swiglu_backward_mx_shared_kernel<<<swiglu_grid(tokens, 1),
                                                 megakernel::kSwiGluBackwardMxThreads, 0, stream>>>(
      rows);
  MOK_CUDA_CHECK_LAUNCH();
  // dx_shared (T, H) fp32, added by the combine's reduce.
  gemm::grouped_dgrad({1, tokens, 2 * inter, hidden}, op.d_gate_up_rows, dgrad.shared_gate_up,
                      shared_offsets_, shared_dx_, gemm::DgradOutput::kFp32, stream, gemm_options);
  // The wgrads over the tokens in order, their operands 32 x 1 down the tokens.
  mx_columns(dy, op.rows, hidden, tokens_group, sms, stream);
  gemm::grouped_wgrad({1, tokens, hidden, inter}, op.rows, op.hidden_columns, shared_offsets_,
                      grads.shared_down, grads.output, stream, gemm_options);
  mx_columns(x, op.rows, hidden, tokens_group, sms, stream);
  gemm::grouped_wgrad({1, tokens, 2 * inter, hidden}, op.d_gate_up_columns, op.rows,
                      shared_offsets_, grads.shared_gate_up, grads.output, stream, gemm_options);
}

template <class Mark>
void LayerBackwardMxfp8::run_routed_experts(const MxWeightCache& weights,
                                            const DeviceLayerGradients& grads,
                                            const bf16* saved_gate_up, cudaStream_t stream,
                                            const Mark& mark) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(layout.rows_capacity());
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  const int* offsets = workspace_.expert_offsets();
  const int* counts = workspace_.expert_counts();
  const int32_t* row_bound = offsets + experts;  // the dispatched rows' end
  const gemm::LaunchOptions& gemm_options = options_.gemm;
  const DeviceLayerWeights& forward = weights.forward();
  const DeviceLayerWeights& dgrad = weights.dgrad();
  const Operands& op = routed_;
  quantize::MxColumnGroups expert_groups;  // each expert's rows, from its first
  expert_groups.offsets = offsets;
  expert_groups.counts = counts;
  expert_groups.num_groups = experts;
  gemm::GroupedShape gate_up{experts, rows, 2 * inter, hidden, counts};
  gemm::GroupedShape down{experts, rows, hidden, inter, counts};
  if (saved_gate_up == nullptr) {
    mx_rows(workspace_.expert_x(), op.rows, rows, hidden, row_bound, num_sms_, stream);
    gemm::grouped_forward(gate_up, op.rows, forward.gate_up, offsets, op.gate_up,
                          gemm::ForwardOutput::kBf16, stream, gemm_options);
  }
  mark();
  // g = dy · W_down on the unscaled dy rows, fp32.
  mx_rows(workspace_.expert_dy(), op.rows, rows, hidden, row_bound, num_sms_, stream);
  gemm::grouped_dgrad(down, op.rows, dgrad.down, offsets, op.grad_hidden, gemm::DgradOutput::kFp32,
                      stream, gemm_options);
  mark();
  const megakernel::SwiGluBackwardMxRows swiglu =
      swiglu_rows(op, saved_gate_up != nullptr ? saved_gate_up : op.gate_up,
                  saved_gate_up != nullptr, inter, expert_groups);
  megakernel::swiglu_backward_mx_routed_kernel<<<swiglu_grid(rows, experts),
                                                 megakernel::kSwiGluBackwardMxThreads, 0, stream>>>(
      workspace_.view(), swiglu);
  MOK_CUDA_CHECK_LAUNCH();
  mark();
  // dx rows (bf16) into expert_y for the push.
  gemm::grouped_dgrad(gate_up, op.d_gate_up_rows, dgrad.gate_up, offsets, workspace_.expert_y(),
                      gemm::DgradOutput::kBf16, stream, gemm_options);
  mark();
  combine_push(workspace_, options_.copy, stream);
  mark();
  // While the peers' dx rows arrive: dW_down = dyᵀ · (w·h), dW_gate_up = d_gate_upᵀ · x, their
  // operands 32 x 1 down each expert's rows.
  mx_columns(workspace_.expert_dy(), op.rows, hidden, expert_groups, num_sms_, stream);
  gemm::grouped_wgrad(down, op.rows, op.hidden_columns, offsets, grads.down, grads.output, stream,
                      gemm_options);
  mark();
  mx_columns(workspace_.expert_x(), op.rows, hidden, expert_groups, num_sms_, stream);
  gemm::grouped_wgrad(gate_up, op.d_gate_up_columns, op.rows, offsets, grads.gate_up, grads.output,
                      stream, gemm_options);
  mark();
}

void LayerBackwardMxfp8::backward(const MxWeightCache& weights, const bf16* x,
                                  const int32_t* topk_idx, const float* topk_w, const bf16* dy,
                                  bf16* dx, float* d_topk_w, const DeviceLayerGradients& grads,
                                  int64_t num_tokens, cudaStream_t stream,
                                  const cudaEvent_t* phase_events, const SavedContext* saved) {
  MOK_CHECK_ARG(weights.has_weights(), "weights",
                "the mxfp8 backward reads round-tripped weights: the cache has none yet (quantize "
                "it first)");
  MOK_CHECK_ARG(weights.has_dgrad() && weights.fits(shape_, workspace_.layout().experts_per_rank()),
                "weights", "the mxfp8 backward needs a cache of this layer's ", shape_.describe(),
                " with the dgrad copy");
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
  const bool shared = shape_.has_shared() && tokens > 0;
  shared_expert_and_dispatch(
      side_, stream, shared,
      shared ? backward_shared_sms_beside_copy(options_, num_sms_, workspace_.num_ranks()) : 0,
      options_.gemm,
      [&](const gemm::LaunchOptions& gemm_options) {
        run_shared_expert(weights, x, dy, grads, tokens, stream, gemm_options,
                          saved_shared_gate_up);
      },
      [&](cudaStream_t rows_stream, bool beside) {
        dispatch_x_and_dy(workspace_, options_, rows_stream, beside, x, dy);
      },
      mark);
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
