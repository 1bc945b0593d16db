// The chunked backward's routed chain (LayerBackwardOptions::chunk_rows): the routed experts a
// chunk of whole experts at a time, so that the routed buffers hold one chunk's rows instead of
// every row's. Per chunk, on the stream, after the schedule and the shared expert:
//
//   (before the first)  every chunk's tables: which experts it holds, their offsets in its rows,
//                       the rows' sources (megakernel/expert_chunk_plan.hpp, expert_chunks.cuh)
//   x's rows            recompute mode: the chunk's rows of x, then its gate/up pre-activations
//   dy's rows           the chunk's rows of dy (over x's)
//   down dgrad          g (fp32)
//   SwiGLU backward     d_topk_w into the window; d_gate_up over g; w·h
//   down wgrad          the chunk's experts' dW_down (the others' are left alone: count -1)
//   gate/up dgrad       the dx rows straight into their slots (the combine's, whole)
//   x's rows            over dy's
//   gate/up wgrad       the chunk's experts' dW_gate_up
//
// and after the last chunk the shared dx (into the chunk's bytes, where they hold it), the
// combine's push (its flag, which the reduce waits for) and the reduce (LayerBackward::backward).
// No sum is split: the bits are the unchunked backward's. The host does not know the routing, so it
// enqueues the most chunks the packing can make (megakernel::expert_chunk_bound); a chunk past the
// last is empty, and its GEMMs find no tile.
#include <algorithm>

#include <cuda_runtime.h>

#include "kernels/megakernel/expert_chunks.cuh"
#include "kernels/megakernel/swiglu_backward.cuh"
#include "mok/cuda_check.hpp"
#include "runtime/layer_backward.hpp"

namespace mok {
namespace {

// Every chunk's tables, CTA c chunk c's (megakernel::ExpertChunk::at).
__global__ void __launch_bounds__(megakernel::kExpertChunkThreads)
    write_expert_chunks_kernel(comm::WorkspaceView view, int32_t* tables, int32_t capacity) {
  extern __shared__ int32_t staged_counts[];  // E_l
  const int64_t experts = view.layout.experts_per_rank();
  const auto index = static_cast<int32_t>(blockIdx.x);
  megakernel::write_expert_chunk(view,
                                 megakernel::ExpertChunk::at(tables, experts, capacity, index),
                                 index, capacity, staged_counts);
}

}  // namespace

ChunkBuffers ChunkBuffers::make(const LayerShape& shape, int64_t rows) {
  const auto aligned = [](int64_t bytes) { return comm::align_up(bytes, comm::kRegionAlignment); };
  ChunkBuffers buffers;
  buffers.rows_offset = 0;
  buffers.grad_hidden_offset = aligned(rows * shape.hidden * 2);
  buffers.weighted_hidden_offset =
      buffers.grad_hidden_offset + aligned(rows * shape.intermediate * 4);
  buffers.bytes = buffers.weighted_hidden_offset + aligned(rows * shape.intermediate * 2);
  return buffers;
}

bool shared_dx_in_chunk(const LayerShape& shape, int64_t tokens_max, int64_t chunk_rows) {
  return shape.has_shared() &&
         ChunkBuffers::make(shape, chunk_rows).bytes >= tokens_max * shape.hidden * 4;
}

void LayerBackward::run_routed_chunks(const DeviceLayerWeights& weights, const bf16* x,
                                      const bf16* dy, const bf16* saved_gate_up,
                                      const DeviceLayerGradients& grads, int64_t num_tokens,
                                      cudaStream_t stream) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(routed_buffer_rows());
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  // The rows one rank copies are local: on every SM, as the unchunked backward's by default.
  CopyConfig copy = options_.copy;
  if (options_.local_dispatch_on_every_sm) copy.num_ctas = 0;
  gemm::LaunchOptions gemm_options = options_.gemm;
  // (kAuto's engine by the rows an expert gets in this call, as the unchunked backward's)
  gemm_options.group_rows = routed_group_rows(layout, num_tokens);
  const bool saved = saved_gate_up != nullptr;
  const megakernel::SwiGluBackwardRows swiglu_rows = routed_swiglu_rows(saved_gate_up);
  const int chunks =
      static_cast<int>(megakernel::expert_chunk_bound(num_tokens, layout.top_k, experts, rows));
  // Every chunk's tables first, one CTA a chunk (a launch a chunk cost more than its walk).
  const size_t staged_bytes = static_cast<size_t>(experts) * sizeof(int32_t);
  write_expert_chunks_kernel<<<chunks, megakernel::kExpertChunkThreads, staged_bytes, stream>>>(
      workspace_.view(), chunk_tables_, rows);
  MOK_CUDA_CHECK_LAUNCH();
  for (int index = 0; index < chunks; ++index) {
    const megakernel::ExpertChunk chunk =
        megakernel::ExpertChunk::at(chunk_tables_, experts, rows, index);
    const megakernel::RoutedRowSet chunk_set{chunk.row_source, chunk.offsets + experts};
    // The chunk's GEMMs: its experts' rows (counts -1 outside it), their tiles found among its
    // experts alone (an empty chunk's GEMMs end at once).
    const auto chunk_shape = [&](int n, int k) {
      gemm::GroupedShape shape{experts, rows, n, k, chunk.counts};
      shape.expert_range = chunk.range;
      return shape;
    };
    if (!saved) {
      // (rows, H) -> (rows, 2I) bf16: the chunk's gate/up pre-activations again.
      dispatch_tokens_window(workspace_, copy, stream, x, chunk_rows_, chunk.window);
      gemm::grouped_forward(chunk_shape(2 * inter, hidden), chunk_rows_, weights.gate_up,
                            chunk.offsets, gate_up_, gemm::ForwardOutput::kBf16, stream,
                            gemm_options);
    }
    dispatch_tokens_window(workspace_, copy, stream, dy, chunk_rows_, chunk.window);
    // g = dy · W_down: (rows, H) -> (rows, I) fp32.
    gemm::grouped_dgrad(chunk_shape(hidden, inter), chunk_rows_, weights.down, chunk.offsets,
                        grad_hidden_, gemm::DgradOutput::kFp32, stream, gemm_options);
    swiglu_backward_routed(workspace_, swiglu_rows, chunk_set, stream);
    // dW_down = dyᵀ · (w·h), the chunk's experts.
    gemm::grouped_wgrad(chunk_shape(hidden, inter), chunk_rows_, weighted_hidden_, chunk.offsets,
                        grads.down, grads.output, stream, options_.gemm);
    // dx rows = d_gate_up · W_gate_up, each into its slot (row t · k + j, the row's source).
    gemm::GroupedShape gate_up_dgrad = chunk_shape(2 * inter, hidden);
    gate_up_dgrad.output_rows = chunk.row_source;
    gemm::grouped_dgrad(gate_up_dgrad, d_gate_up_, weights.gate_up, chunk.offsets,
                        workspace_.slots(), gemm::DgradOutput::kBf16, stream, options_.gemm);
    // dW_gate_up = d_gate_upᵀ · x, on x's rows over dy's.
    dispatch_tokens_window(workspace_, copy, stream, x, chunk_rows_, chunk.window);
    gemm::grouped_wgrad(chunk_shape(2 * inter, hidden), d_gate_up_, chunk_rows_, chunk.offsets,
                        grads.gate_up, grads.output, stream, options_.gemm);
  }
}

}  // namespace mok
