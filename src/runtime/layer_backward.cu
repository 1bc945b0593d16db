// The GPU layer backward: buffers sized from shapes and one enqueue of the composition per call
// (see layer_backward.hpp).
#include "runtime/layer_backward.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/comm/flags.cuh"
#include "kernels/megakernel/expert_chunks.cuh"
#include "kernels/megakernel/swiglu_backward.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/device_memory.hpp"

namespace mok {
namespace {

__global__ void __launch_bounds__(megakernel::kSwiGluBackwardThreads)
    swiglu_backward_routed_kernel(comm::WorkspaceView view, megakernel::SwiGluBackwardRows rows,
                                  megakernel::RoutedRowSet set) {
  if (comm::cta_sees_error(view)) return;
  megakernel::swiglu_backward_routed(view, rows, set);
}

__global__ void __launch_bounds__(megakernel::kSwiGluBackwardThreads)
    swiglu_backward_shared_kernel(megakernel::SwiGluBackwardRows rows, int32_t num_rows) {
  megakernel::swiglu_backward_shared(rows, num_rows);
}

// Every chunk's tables of a chunked backward of up to tokens_max tokens and `rows` a chunk.
int64_t chunk_table_ints(const comm::WorkspaceLayout& layout, int64_t tokens_max, int64_t rows) {
  const int64_t experts = layout.experts_per_rank();
  return megakernel::expert_chunk_bound(tokens_max, layout.top_k, experts, rows) *
         megakernel::ExpertChunk::ints(experts, rows);
}

}  // namespace

int routed_group_rows(const comm::WorkspaceLayout& layout, int64_t num_tokens) {
  const int64_t experts = std::max<int64_t>(layout.experts_per_rank(), 1);
  return static_cast<int>(std::max<int64_t>(1, num_tokens * layout.top_k / experts));
}

WorkspaceOptions backward_workspace(const LayerBackwardOptions& options) {
  WorkspaceOptions workspace = options.workspace;
  workspace.expert_rows = 0;  // every row at once
  workspace.backward = true;
  return workspace;
}

WorkspaceOptions bf16_backward_workspace(const LayerBackwardOptions& options, int num_ranks) {
  WorkspaceOptions workspace = backward_workspace(options);
  workspace.block_m = 1;
  const bool one_rank = num_ranks == 1;
  workspace.expert_y = !one_rank;  // the dx rows before the combine push
  workspace.rows_in_expert_dy = one_rank;
  return workspace;
}

void LayerBackward::swiglu_backward_routed(const CommWorkspace& workspace,
                                           const megakernel::SwiGluBackwardRows& rows,
                                           const megakernel::RoutedRowSet& set,
                                           cudaStream_t stream) const {
  swiglu_backward_routed_kernel<<<num_sms_ * 4, megakernel::kSwiGluBackwardThreads, 0, stream>>>(
      workspace.view(), rows, set);
  MOK_CUDA_CHECK_LAUNCH();
}

bool shared_dx_in_weighted_hidden(const LayerShape& shape, const comm::WorkspaceLayout& layout) {
  return layout.rows_in_expert_dy && shape.has_shared() &&
         layout.rows_capacity() * shape.intermediate * 2 >= layout.tokens_max * shape.hidden * 4;
}

LayerBackward::LayerBackward(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                             const LayerBackwardOptions& options)
    : shape_(shape),
      tokens_max_(tokens_max),
      options_(options),
      workspace_(comm, shape, tokens_max, bf16_backward_workspace(options, comm.num_ranks())) {
  MOK_CHECK_ARG(shape.intermediate % 8 == 0, "intermediate",
                "the GPU layer needs a multiple of 8, got ", shape.intermediate);
  MOK_CHECK_ARG(shape.shared_intermediate % 8 == 0, "shared_intermediate",
                "the GPU layer needs a multiple of 8, got ", shape.shared_intermediate);
  MOK_CHECK_ARG(shape.hidden % 8 == 0, "hidden", "the GPU layer needs a multiple of 8, got ",
                shape.hidden);
  MOK_CHECK_ARG(
      options.chunk_rows == 0 ||
          (comm.num_ranks() == 1 && options.chunk_rows >= std::max<int64_t>(tokens_max, 1)),
      "chunk_rows",
      "a chunked backward needs one rank and at least tokens_max rows (an expert gets up "
      "to T rows), got ",
      options.chunk_rows, " rows on ", comm.num_ranks(), " ranks, tokens_max ", tokens_max);
  const int64_t rows = routed_buffer_rows();
  checked_int(workspace_.layout().rows_capacity(), "rows capacity");
  checked_int(rows, "chunk_rows");
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  // d_gate_up in g's bytes: a row of each takes 4I bytes, and the SwiGLU backward reads every
  // 32-byte block of g (8 fp32) before it writes the block's 8 gate and 8 up gradients (16 bf16)
  // over it; no kernel reads g after (megakernel/swiglu_backward.cuh).
  if (options.chunk_rows > 0) {
    const ChunkBuffers layout = ChunkBuffers::make(shape, rows);
    chunk_buffers_ = device_alloc<char>(layout.bytes);
    // Rows past a chunk's that a GEMM tile reads (and drops) are then never uninitialised memory.
    MOK_CUDA_CHECK(cudaMemset(chunk_buffers_, 0, static_cast<size_t>(layout.bytes)));
    chunk_rows_ = reinterpret_cast<bf16*>(chunk_buffers_ + layout.rows_offset);
    grad_hidden_ = reinterpret_cast<float*>(chunk_buffers_ + layout.grad_hidden_offset);
    weighted_hidden_ = reinterpret_cast<bf16*>(chunk_buffers_ + layout.weighted_hidden_offset);
    chunk_tables_ = device_alloc<int32_t>(chunk_table_ints(workspace_.layout(), tokens_max, rows));
  } else {
    grad_hidden_ = device_alloc<float>(rows * inter);
    weighted_hidden_ = device_alloc<bf16>(rows * inter);
  }
  d_gate_up_ = reinterpret_cast<bf16*>(grad_hidden_);
  ones_ = make_ones(tokens_max * shape.top_k, comm.device());
  if (shape.has_shared()) {
    shared_grad_hidden_ = device_alloc<float>(tokens_max * shared_inter);
    shared_d_gate_up_ = reinterpret_cast<bf16*>(shared_grad_hidden_);
    shared_hidden_ = device_alloc<bf16>(tokens_max * shared_inter);
    // One rank alone, with room: in w·h's bytes (or a chunk's buffers), dead once the (last)
    // down wgrad has read them.
    if (shared_dx_after_wgrad_down()) {
      shared_dx_ = chunk_buffers_ != nullptr ? reinterpret_cast<float*>(chunk_buffers_)
                                             : reinterpret_cast<float*>(weighted_hidden_);
    } else {
      shared_dx_ = device_alloc<float>(tokens_max * hidden);
    }
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  num_sms_ = workspace_.num_sms();  // (a share of the GPU when ranks are emulated on it)
  options_.gemm = wgrads_for_ranks_on_device(comm, options_.gemm);
}

LayerBackward::~LayerBackward() {
  // (d_gate_up_ and shared_d_gate_up_ live in the g buffers, shared_dx_ may live in w·h's: not
  // freed twice.)
  // A chunked backward's g and w·h live in chunk_buffers_.
  void* shared_dx = shared_dx_after_wgrad_down() ? nullptr : shared_dx_;
  const bool chunked = chunk_buffers_ != nullptr;
  for (void* memory :
       {static_cast<void*>(gate_up_), chunked ? nullptr : static_cast<void*>(grad_hidden_),
        chunked ? nullptr : static_cast<void*>(weighted_hidden_), static_cast<void*>(ones_),
        static_cast<void*>(shared_gate_up_), static_cast<void*>(shared_grad_hidden_),
        static_cast<void*>(shared_hidden_), shared_dx, static_cast<void*>(shared_offsets_),
        static_cast<void*>(chunk_buffers_), static_cast<void*>(chunk_tables_)}) {
    cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
  }
}

int64_t LayerBackward::buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                    const LayerBackwardOptions& options, bool recompute) {
  const comm::WorkspaceLayout layout =
      workspace_layout(shape, num_ranks, tokens_max, bf16_backward_workspace(options, num_ranks));
  const bool chunked = options.chunk_rows > 0;
  const int64_t rows = chunked ? options.chunk_rows : layout.rows_capacity();
  const int64_t inter = shape.intermediate, shared_inter = shape.shared_intermediate;
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  if (chunked) {
    bytes += ChunkBuffers::make(shape, rows).bytes;  // the chunk's rows, g, w·h
    bytes += chunk_table_ints(layout, tokens_max, rows) * 4;
  } else {
    bytes += rows * inter * (4 + 2);  // g (then d_gate_up in its bytes), w·h
  }
  bytes += tokens_max * shape.top_k * 4;  // ones
  if (shape.has_shared()) {
    bytes += tokens_max * shared_inter * (4 + 2);  // g (then d_gate_up), h
    if (!shared_dx_deferred(shape, layout, options)) bytes += tokens_max * shape.hidden * 4;
  }
  if (recompute) bytes += recompute_bytes(shape, rows, tokens_max);
  return bytes;
}

int64_t LayerBackward::recompute_bytes(const LayerShape& shape, int64_t rows, int64_t tokens_max) {
  return (rows * shape.intermediate + tokens_max * shape.shared_intermediate) * 2 * 2;
}

int64_t LayerBackward::buffer_bytes() const {
  return buffer_bytes(shape_, workspace_.num_ranks(), tokens_max_, options_,
                      /*recompute=*/gate_up_ != nullptr);
}

megakernel::SwiGluBackwardRows LayerBackward::routed_swiglu_rows(const bf16* saved_gate_up) const {
  const bool saved = saved_gate_up != nullptr;
  return {reinterpret_cast<const __nv_bfloat16*>(saved ? saved_gate_up : gate_up_),
          saved,
          grad_hidden_,
          reinterpret_cast<__nv_bfloat16*>(d_gate_up_),
          reinterpret_cast<__nv_bfloat16*>(weighted_hidden_),
          static_cast<int>(shape_.intermediate)};
}

int64_t LayerBackward::routed_buffer_rows() const {
  return options_.chunk_rows > 0 ? options_.chunk_rows : workspace_.layout().rows_capacity();
}

bool LayerBackward::shared_dx_deferred(const LayerShape& shape, const comm::WorkspaceLayout& layout,
                                       const LayerBackwardOptions& options) {
  if (options.chunk_rows > 0)
    return shared_dx_in_chunk(shape, layout.tokens_max, options.chunk_rows);
  return shared_dx_in_weighted_hidden(shape, layout);
}

void LayerBackward::allocate_recompute_buffers() {
  if (gate_up_ != nullptr) return;
  const int64_t rows = routed_buffer_rows();
  gate_up_ = device_alloc<bf16>(rows * 2 * shape_.intermediate);
  if (shape_.has_shared()) {
    shared_gate_up_ = device_alloc<bf16>(tokens_max_ * 2 * shape_.shared_intermediate);
  }
}

void LayerBackward::run_shared_expert(const DeviceLayerWeights& weights, const bf16* x,
                                      const bf16* dy, const bf16* saved_gate_up,
                                      const DeviceLayerGradients& grads, int tokens,
                                      cudaStream_t stream,
                                      const gemm::LaunchOptions& gemm_options) {
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.shared_intermediate);
  write_single_group_offsets(shared_offsets_, tokens, stream);
  if (saved_gate_up == nullptr) {
    // (T, H) -> (T, 2I_s) bf16: the gate/up pre-activations again.
    gemm::grouped_forward({1, tokens, 2 * inter, hidden}, x, weights.shared_gate_up,
                          shared_offsets_, shared_gate_up_, gemm::ForwardOutput::kBf16, stream,
                          gemm_options);
  }
  // g = dy · W_sd: (T, H) -> (T, I_s) fp32.
  gemm::grouped_dgrad({1, tokens, hidden, inter}, dy, weights.shared_down, shared_offsets_,
                      shared_grad_hidden_, gemm::DgradOutput::kFp32, stream, gemm_options);
  const megakernel::SwiGluBackwardRows rows{
      reinterpret_cast<const __nv_bfloat16*>(saved_gate_up != nullptr ? saved_gate_up
                                                                      : shared_gate_up_),
      /*saved_by_source=*/false,
      shared_grad_hidden_,
      reinterpret_cast<__nv_bfloat16*>(shared_d_gate_up_),
      reinterpret_cast<__nv_bfloat16*>(shared_hidden_),
      inter};
  const int warps_per_cta = megakernel::kSwiGluBackwardThreads / 32;
  const int sms = gemm_options.num_sms > 0 ? gemm_options.num_sms : num_sms_;
  const int ctas = static_cast<int>(
      std::clamp<int64_t>((tokens + warps_per_cta - 1) / warps_per_cta, 1, int64_t{sms} * 8));
  swiglu_backward_shared_kernel<<<ctas, megakernel::kSwiGluBackwardThreads, 0, stream>>>(rows,
                                                                                         tokens);
  MOK_CUDA_CHECK_LAUNCH();
  if (!shared_dx_after_wgrad_down()) shared_dx_dgrad(weights, tokens, stream, gemm_options);
  // dW_sd = dyᵀ · h, dW_sgu = d_gate_upᵀ · x, over the tokens in order.
  gemm::grouped_wgrad({1, tokens, hidden, inter}, dy, shared_hidden_, shared_offsets_,
                      grads.shared_down, grads.output, stream, gemm_options);
  gemm::grouped_wgrad({1, tokens, 2 * inter, hidden}, shared_d_gate_up_, x, shared_offsets_,
                      grads.shared_gate_up, grads.output, stream, gemm_options);
}

void LayerBackward::shared_dx_dgrad(const DeviceLayerWeights& weights, int tokens,
                                    cudaStream_t stream, const gemm::LaunchOptions& gemm_options) {
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.shared_intermediate);
  // dx_shared = d_gate_up · W_sgu: (T, 2I_s) -> (T, H) fp32, added by the combine's reduce.
  gemm::grouped_dgrad({1, tokens, 2 * inter, hidden}, shared_d_gate_up_, weights.shared_gate_up,
                      shared_offsets_, shared_dx_, gemm::DgradOutput::kFp32, stream, gemm_options);
}

void LayerBackward::recompute_gate_up(const DeviceLayerWeights& weights, int group_rows,
                                      cudaStream_t stream) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  // (rows, H) -> (rows, 2I) bf16: the gate/up pre-activations again. kAuto picks the engine by
  // the rows an expert gets in this call, as for the down dgrad: ping-pong tiles over short
  // experts, cooperative over long ones (docs/perf-notes/backward.md).
  gemm::LaunchOptions recompute_options = options_.gemm;
  recompute_options.group_rows = group_rows;
  gemm::grouped_forward(
      {static_cast<int>(layout.experts_per_rank()), static_cast<int>(layout.rows_capacity()),
       static_cast<int>(2 * shape_.intermediate), static_cast<int>(shape_.hidden),
       workspace_.expert_counts()},
      workspace_.expert_x(), weights.gate_up, workspace_.expert_offsets(), gate_up_,
      gemm::ForwardOutput::kBf16, stream, recompute_options);
}

template <class SharedDx, class Reduce, class Mark>
void LayerBackward::run_routed_experts(const DeviceLayerWeights& weights, const bf16* x,
                                       int group_rows, const bf16* saved_gate_up,
                                       const DeviceLayerGradients& grads, const SharedDx& shared_dx,
                                       const Reduce& reduce, cudaStream_t stream,
                                       const Mark& mark) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(layout.rows_capacity());
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  const int* offsets = workspace_.expert_offsets();
  const int* counts = workspace_.expert_counts();
  const gemm::LaunchOptions& gemm_options = options_.gemm;
  // One rank alone: dy's, the dx and x's rows take expert_dy's bytes in turn
  // (kOneRankBackwardPhaseOrder).
  const bool one_rank = layout.rows_in_expert_dy;
  // g = dy · W_down: (rows, H) -> (rows, I) fp32, on the unscaled dy rows; kAuto picks its engine
  // by the rows an expert gets in this call.
  gemm::LaunchOptions down_options = gemm_options;
  down_options.group_rows = group_rows;
  gemm::grouped_dgrad({experts, rows, hidden, inter, counts}, workspace_.expert_dy(), weights.down,
                      offsets, grad_hidden_, gemm::DgradOutput::kFp32, stream, down_options);
  mark();
  const megakernel::SwiGluBackwardRows swiglu_rows = routed_swiglu_rows(saved_gate_up);
  swiglu_backward_routed(workspace_, swiglu_rows, megakernel::every_routed_row(workspace_.view()),
                         stream);
  mark();
  // dW_down = dyᵀ · (w·h).
  const auto wgrad_down = [&] {
    gemm::grouped_wgrad({experts, rows, hidden, inter, counts}, workspace_.expert_dy(),
                        weighted_hidden_, offsets, grads.down, grads.output, stream, gemm_options);
    mark();
  };
  // dW_gate_up = d_gate_upᵀ · x.
  const auto wgrad_gate_up = [&] {
    gemm::grouped_wgrad({experts, rows, 2 * inter, hidden, counts}, d_gate_up_,
                        workspace_.expert_x(), offsets, grads.gate_up, grads.output, stream,
                        gemm_options);
    mark();
  };
  // dx rows = d_gate_up · W_gate_up: (rows, 2I) -> (rows, H) bf16, into expert_y for the push;
  // one rank alone, straight into its slots (row t · k + j, the row's source), where the reduce
  // reads each token's k rows side by side: over dy's rows, so the down wgrad reads them first.
  if (one_rank) {
    wgrad_down();
    shared_dx();  // (when it waited for w·h's bytes)
  }
  gemm::GroupedShape gate_up_dgrad{experts, rows, 2 * inter, hidden, counts};
  if (one_rank) gate_up_dgrad.output_rows = workspace_.row_source();
  gemm::grouped_dgrad(gate_up_dgrad, d_gate_up_, weights.gate_up, offsets,
                      one_rank ? workspace_.slots() : workspace_.expert_y(),
                      gemm::DgradOutput::kBf16, stream, gemm_options);
  mark();
  combine_push(workspace_, options_.copy, stream);
  mark();
  if (one_rank) {
    // The reduce reads the dx rows before x's rows go over them, for the gate/up wgrad.
    reduce();
    mark();
    dispatch_x_and_dy(workspace_, options_, stream, /*beside=*/false, x, /*dy=*/nullptr);
    mark();
    wgrad_gate_up();
  } else {
    // While the peers' dx rows arrive: both wgrads, then the reduce.
    wgrad_down();
    wgrad_gate_up();
    reduce();
    mark();
  }
}

void LayerBackward::backward(const DeviceLayerWeights& weights, const bf16* x,
                             const int32_t* topk_idx, const float* topk_w, const bf16* dy, bf16* dx,
                             float* d_topk_w, const DeviceLayerGradients& grads, int64_t num_tokens,
                             cudaStream_t stream, const cudaEvent_t* phase_events,
                             const SavedContext* saved) {
  check_backward_arguments(shape_, tokens_max_, num_tokens, x, topk_idx, topk_w, dy, dx, d_topk_w,
                           grads);
  MOK_CHECK_ARG(weights.gate_up != nullptr && weights.down != nullptr, "weights",
                "null routed expert weights");
  MOK_CHECK_ARG(
      !shape_.has_shared() || (weights.shared_gate_up != nullptr && weights.shared_down != nullptr),
      "weights", "null shared expert weights (I_s = ", shape_.shared_intermediate, ")");
  check_saved_context(shape_, num_tokens, saved, "saved");
  if (saved == nullptr) allocate_recompute_buffers();
  const bf16* saved_gate_up = saved != nullptr ? saved->gate_up : nullptr;
  const bf16* saved_shared_gate_up = saved != nullptr ? saved->shared_gate_up : nullptr;
  const int tokens = static_cast<int>(num_tokens);
  const bool one_rank = workspace_.layout().rows_in_expert_dy;
  const int group_rows = routed_group_rows(workspace_.layout(), num_tokens);
  const bool shared = shape_.has_shared() && tokens > 0;
  // dx = Σ_j slot_j (weights of 1: exact) + shared dx, one rounding; d_topk_w beside it.
  const auto reduce = [&] {
    combine_reduce(workspace_, ones_, shared ? shared_dx_ : nullptr, dx, num_tokens, stream,
                   d_topk_w);
  };
  if (options_.chunk_rows > 0) {
    MOK_CHECK_ARG(phase_events == nullptr, "phase_events",
                  "a chunked backward (chunk_rows > 0) takes no phase marks");
    stage_backward_inputs(workspace_, x, topk_idx, topk_w, dy, num_tokens, stream);
    if (shared) {
      run_shared_expert(weights, x, dy, saved_shared_gate_up, grads, tokens, stream, options_.gemm);
    } else {
      zero_shared_gradients(shape_, grads, stream);
    }
    run_routed_chunks(weights, x, dy, saved_gate_up, grads, num_tokens, stream);
    if (shared && shared_dx_after_wgrad_down()) {
      shared_dx_dgrad(weights, tokens, stream, options_.gemm);
    }
    reduce();
    return;
  }
  const PhaseMarks mark(phase_events, stream);
  mark();
  // This rank's x, dy and router weights into its window, for the expert ranks (one rank alone
  // dispatches its rows from x and dy in place).
  stage_backward_inputs(workspace_, x, topk_idx, topk_w, dy, num_tokens, stream);
  mark();
  // The routed gate/up pre-activations again (recompute mode), on x's expert rows: one rank alone
  // dispatches them first, before dy's rows go over them; elsewhere they came with dy's.
  const auto gate_up = [&] {
    if (saved_gate_up == nullptr) {
      if (one_rank) {
        dispatch_x_and_dy(workspace_, options_, stream, /*beside=*/false, x, /*dy=*/nullptr);
      }
      recompute_gate_up(weights, group_rows, stream);
    }
    mark();
  };
  if (one_rank) gate_up();
  shared_expert_and_dispatch(
      side_, stream, shared,
      shared ? backward_shared_sms_beside_copy(options_, num_sms_, workspace_.num_ranks()) : 0,
      options_.gemm,
      [&](const gemm::LaunchOptions& gemm_options) {
        run_shared_expert(weights, x, dy, saved_shared_gate_up, grads, tokens, stream,
                          gemm_options);
      },
      [&](cudaStream_t rows_stream, bool beside) {
        dispatch_x_and_dy(workspace_, options_, rows_stream, beside, one_rank ? nullptr : x, dy);
      },
      mark);
  mark();
  if (!one_rank) {
    mark();  // (kDispatchX: x's rows came with dy's)
    gate_up();
  }
  if (tokens == 0) zero_shared_gradients(shape_, grads, stream);
  // One rank alone, with room: the shared dx into w·h's bytes, after the down wgrad.
  const auto shared_dx = [&] {
    if (shared && shared_dx_after_wgrad_down()) {
      shared_dx_dgrad(weights, tokens, stream, options_.gemm);
    }
  };
  run_routed_experts(weights, x, group_rows, saved_gate_up, grads, shared_dx, reduce, stream, mark);
}

}  // namespace mok
