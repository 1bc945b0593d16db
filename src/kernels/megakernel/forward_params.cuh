// What the fused forward kernel is given, and the fixed shape of its CTAs (the GEMM engine's:
// a producer warpgroup and two consumer warpgroups, one stage ring for every task).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/megakernel/task_list.cuh"

namespace mok::megakernel {

// Indexed by TaskKind: A (rows, K) and B (groups, N, K) of each GEMM.
struct FusedForwardMaps {
  CUtensorMap a[kNumTaskKinds];
  CUtensorMap b[kNumTaskKinds];
  // The routed kinds' A in boxes of kCarriedTailRows rows: carried tails (task_list.cuh)
  CUtensorMap a_tail[kNumTaskKinds];
};

struct FusedForwardParams {
  comm::WorkspaceView view;
  const __nv_bfloat16* x;   // (T, H), the caller's tokens
  const int32_t* topk_idx;  // (T, k)
  // Save mode (saved_context.cuh): the gate/up pre-activations, or null (not kept).
  __nv_bfloat16* saved_gate_up;                 // (R * T_max * k, 2I), by row_source
  __nv_bfloat16* saved_shared_gate_up;          // (T, 2I_s), by token
  gemm::GroupedGemmParams gemm[kNumTaskKinds];  // n, k and output of each GEMM
  int num_tokens;                               // this rank's tokens this call
  int num_comm_ctas;      // blockIdx.x below this dispatches first, then computes like the rest;
                          // 0: warps 1-3 of every CTA dispatch beside its tiles
  int minibatch_mblocks;  // row blocks per minibatch
  int ring_mblocks;       // row blocks of expert_x and the routed hidden rows (task_list.cuh)
  int has_shared;
  int schedule_in_kernel;  // 0: the standalone schedule (comm_ops.hpp) ran before the launch
  // blockIdx.x below this makes the schedule (>= num_comm_ctas); the others start on the shared
  // gate/up tiles at once
  int num_schedule_ctas;
  uint64_t* trace;              // (grid, kTraceFields) per-CTA timeline (trace.cuh), or null
  const uint8_t* sm_partition;  // L2 partition by %smid (tickets.cuh), or null
  int max_sm_ids;               // entries of sm_partition
};

// Every task shares one stage ring, laid out for the SwiGLU epilogue (it has the staging tile).
using RingLayout = gemm::SharedLayout<gemm::EpilogueKind::kSwiGluBf16>;
using Loop = gemm::Mainloop<gemm::GemmKind::kForward, RingLayout>;
inline constexpr int kThreads = gemm::TileConfig::kNumThreads;
inline constexpr int kConsumerThreads = 128 * gemm::TileConfig::kNumConsumerWarpgroups;
// Past the stage ring, 1024-byte aligned: each stage's carried tail rows (kCarriedTailRows rows of
// A, laid out as A).
inline constexpr uint32_t kTailStageBytes = kCarriedTailRows * gemm::TileConfig::BLOCK_K * 2;
inline constexpr uint32_t kTailOffset = (RingLayout::kBytes + 1023) / 1024 * 1024;
// Then each consumer thread's carried tail accumulators while the tile's own are stored.
// (two m64 slices of 64 x rows outputs over a warpgroup's 128 threads: rows a thread)
inline constexpr int kTailAccumulators = kCarriedTailRows;  // CarriedTail::kAccumulators
inline constexpr uint32_t kTailStashOffset = kTailOffset + RingLayout::kNumStages * kTailStageBytes;
inline constexpr uint32_t kTailStashBytes =
    kConsumerThreads * kTailAccumulators * static_cast<uint32_t>(sizeof(float));
inline constexpr uint32_t kSharedBytes =
    kTailStashOffset + kTailStashBytes + RingLayout::kAlignment;
static_assert(kSharedBytes <= 227 * 1024, "shared memory layout exceeds the 227 KiB limit");
// Register split: the producer warp also decodes tasks (and three of its warps dispatch).
inline constexpr uint32_t kProducerRegisters = 72;
inline constexpr uint32_t kConsumerRegisters = 216;
static_assert(gemm::register_split_fits(kProducerRegisters, kConsumerRegisters,
                                        gemm::TileConfig::kNumConsumerWarpgroups),
              "the fused kernel's register split exceeds the SM's register file");

}  // namespace mok::megakernel
