// The fused forward's launch: tensor maps of the four GEMMs, their shapes, one launch.
#include "runtime/fused_forward.hpp"

#include <algorithm>

#include "kernels/megakernel/forward_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/gemm_tensor_map.hpp"
#include "runtime/l2_partitions.hpp"

namespace mok {

int fused_forward_shared_bytes() { return static_cast<int>(megakernel::kSharedBytes); }

RingBlocks ring_config(const comm::WorkspaceLayout& layout, int minibatch_mblocks) {
  constexpr int64_t kRows = gemm::TileConfig::BLOCK_M;
  MOK_CHECK_ARG(minibatch_mblocks >= 1, "minibatch_mblocks", "must be >= 1, got ",
                minibatch_mblocks);
  if (layout.expert_rows >= layout.rows_capacity()) {
    return {minibatch_mblocks, static_cast<int>(gemm::ceil_div(layout.rows_capacity(), kRows))};
  }
  const int64_t ring = layout.expert_rows / kRows;
  MOK_CHECK_ARG(ring >= 2, "ring_rows", "the ring needs at least 2 row blocks (", 2 * kRows,
                " rows), got ", layout.expert_rows, " rows");
  const int minibatch = static_cast<int>(std::min<int64_t>(minibatch_mblocks, ring / 2));
  return {minibatch, static_cast<int>(ring / minibatch * minibatch)};
}

void fused_forward(CommWorkspace& ws, const LayerShape& shape, const FusedForwardBuffers& buffers,
                   const bf16* x, const int32_t* topk_idx, int64_t num_tokens,
                   const FusedForwardConfig& config, cudaStream_t stream) {
  using gemm::TileConfig;
  using megakernel::TaskKind;
  const comm::WorkspaceLayout& layout = ws.layout();
  MOK_CHECK_ARG(layout.block_m == TileConfig::BLOCK_M, "workspace.block_m",
                "the fused forward needs row blocks of ", TileConfig::BLOCK_M, ", got ",
                layout.block_m);
  MOK_CHECK_ARG(config.comm_ctas >= 0 && config.comm_ctas < config.num_ctas, "comm_ctas",
                "must be in [0, ", config.num_ctas, "), got ", config.comm_ctas);
  const RingBlocks ring = ring_config(layout, config.minibatch_mblocks);
  MOK_CHECK_ARG(ring.minibatch_mblocks == config.minibatch_mblocks &&
                    ring.ring_mblocks == config.ring_mblocks,
                "ring_mblocks", "minibatch ", config.minibatch_mblocks, " and ring ",
                config.ring_mblocks, " row blocks do not fit this workspace (ring_config gives ",
                ring.minibatch_mblocks, " and ", ring.ring_mblocks, ")");
  MOK_CHECK_ARG(config.schedule_ctas >= std::max(config.comm_ctas, 1) &&
                    config.schedule_ctas <= config.num_ctas,
                "schedule_ctas", "must be in [max(comm_ctas, 1) = ", std::max(config.comm_ctas, 1),
                ", ", config.num_ctas, "], got ", config.schedule_ctas);
  MOK_CHECK_ARG(num_tokens == 0 || (x != nullptr && topk_idx != nullptr), "forward",
                "null x or topk_idx for ", num_tokens, " tokens");
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(x) % 16 == 0, "x", "must be 16-byte aligned");
  MOK_CHECK_ARG((layout.experts_per_rank() * (1 + megakernel::kThreads / 32) + 1) * 4 <=
                    fused_forward_shared_bytes(),
                "num_experts", layout.experts_per_rank(),
                " local experts: their offsets and row "
                "counters exceed the shared memory the schedule has");
  const bool has_shared = shape.has_shared() && num_tokens > 0;
  const uint64_t experts = static_cast<uint64_t>(layout.experts_per_rank());
  const uint64_t rows = static_cast<uint64_t>(layout.expert_rows);  // the ring's
  const uint64_t tokens_max = static_cast<uint64_t>(layout.tokens_max);
  const uint64_t hidden = static_cast<uint64_t>(shape.hidden);
  const uint64_t inter = static_cast<uint64_t>(shape.intermediate);
  const uint64_t shared_inter = static_cast<uint64_t>(shape.shared_intermediate);

  megakernel::FusedForwardMaps maps{};
  megakernel::FusedForwardParams params{};
  auto set = [&](TaskKind kind, const CUtensorMap& a, const CUtensorMap& b, int n, int k,
                 void* output) {
    const int index = static_cast<int>(kind);
    maps.a[index] = a;
    maps.b[index] = b;
    params.gemm[index] = {ws.expert_offsets(), static_cast<int>(experts), 0, n, k, output};
  };
  // Rows past an expert's rows are read but never stored (each output row depends on its input
  // row only), so the A maps of the intermediates span their buffers' capacity.
  set(TaskKind::kGateUp,
      gemm::make_tensor_map_2d(ws.expert_x(), rows, hidden, TileConfig::BLOCK_M, "expert_x"),
      gemm::make_tensor_map_3d(buffers.gate_up, experts, 2 * inter, hidden, TileConfig::BLOCK_N, 64,
                               "gate_up"),
      static_cast<int>(2 * inter), static_cast<int>(hidden), buffers.routed_hidden);
  maps.a_tail[static_cast<int>(TaskKind::kGateUp)] = gemm::make_tensor_map_2d(
      ws.expert_x(), rows, hidden, megakernel::kCarriedTailRows, "expert_x");
  maps.a_tail[static_cast<int>(TaskKind::kDown)] = gemm::make_tensor_map_2d(
      buffers.routed_hidden, rows, inter, megakernel::kCarriedTailRows, "routed_hidden");
  set(TaskKind::kDown,
      gemm::make_tensor_map_2d(buffers.routed_hidden, rows, inter, TileConfig::BLOCK_M,
                               "routed_hidden"),
      gemm::make_tensor_map_3d(buffers.down, experts, hidden, inter, TileConfig::BLOCK_N, 64,
                               "down"),
      // (the output pointer is unused: RowsToOwners places every row)
      static_cast<int>(hidden), static_cast<int>(inter), ws.expert_y());
  if (has_shared) {
    set(TaskKind::kSharedGateUp,
        gemm::make_tensor_map_2d(x, static_cast<uint64_t>(num_tokens), hidden, TileConfig::BLOCK_M,
                                 "x"),
        gemm::make_tensor_map_3d(buffers.shared_gate_up, 1, 2 * shared_inter, hidden,
                                 TileConfig::BLOCK_N, 64, "shared_gate_up"),
        static_cast<int>(2 * shared_inter), static_cast<int>(hidden), buffers.shared_hidden);
    set(TaskKind::kSharedDown,
        gemm::make_tensor_map_2d(buffers.shared_hidden, tokens_max, shared_inter,
                                 TileConfig::BLOCK_M, "shared_hidden"),
        gemm::make_tensor_map_3d(buffers.shared_down, 1, hidden, shared_inter, TileConfig::BLOCK_N,
                                 64, "shared_down"),
        static_cast<int>(hidden), static_cast<int>(shared_inter), buffers.shared_output);
  }
  params.view = ws.view();
  params.x = reinterpret_cast<const __nv_bfloat16*>(x);
  params.topk_idx = topk_idx;
  params.saved_gate_up = reinterpret_cast<__nv_bfloat16*>(buffers.saved_gate_up);
  params.saved_shared_gate_up =
      has_shared ? reinterpret_cast<__nv_bfloat16*>(buffers.saved_shared_gate_up) : nullptr;
  params.num_tokens = static_cast<int>(num_tokens);
  params.num_comm_ctas = config.comm_ctas;
  params.minibatch_mblocks = config.minibatch_mblocks;
  params.ring_mblocks = config.ring_mblocks;
  params.has_shared = has_shared ? 1 : 0;
  params.schedule_in_kernel = config.schedule_in_kernel ? 1 : 0;
  params.num_schedule_ctas = config.schedule_ctas;
  params.trace = config.trace;
  params.sm_partition = config.sm_partition;
  params.max_sm_ids = runtime::kMaxSmIds;

  const int shared_bytes = fused_forward_shared_bytes();
  // NOTE: the attribute belongs to the current device; one process may drive several GPUs.
  MOK_CUDA_CHECK(cudaFuncSetAttribute(megakernel::fused_forward_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  megakernel::fused_forward_kernel<<<config.num_ctas, megakernel::kThreads, shared_bytes, stream>>>(
      maps, params);
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace mok
