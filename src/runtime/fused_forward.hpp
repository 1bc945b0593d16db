// Launcher of the fused forward kernel (kernels/megakernel/forward_kernel.cuh): the schedule, the
// dispatch, the shared and routed expert GEMMs and the combine push in one persistent launch.
// begin_call must run on the stream before it and the combine reduce after it
// (runtime/comm_ops.hpp): three launches per forward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/layer.hpp"
#include "runtime/workspace.hpp"

namespace mok {

// Device buffers of one call, in the layouts of LayerForward.
struct FusedForwardBuffers {
  const bf16* gate_up = nullptr;         // (E_l, 2I, H), gate/up interleaved
  const bf16* down = nullptr;            // (E_l, H, I)
  const bf16* shared_gate_up = nullptr;  // (2I_s, H), null without a shared expert
  const bf16* shared_down = nullptr;     // (H, I_s)
  bf16* routed_hidden = nullptr;         // (expert_rows, I): the ring, as expert_x
  bf16* shared_hidden = nullptr;         // (T_max, I_s)
  float* shared_output = nullptr;        // (T_max, H)
  // Save mode: the gate/up pre-activations kept for the backward (SavedContext), or null.
  bf16* saved_gate_up = nullptr;         // (R * T_max * k, 2I), by the rows' sources
  bf16* saved_shared_gate_up = nullptr;  // (T, 2I_s)
};

struct FusedForwardConfig {
  int num_ctas = 0;  // the persistent grid: one CTA per SM
  // Of which dispatch first, then compute (< num_ctas); 0: none, three warps of every CTA's
  // producer warpgroup dispatch beside its tiles instead.
  int comm_ctas = 0;
  int minibatch_mblocks = 0;  // minibatch, in row blocks of 128 (>= 1)
  // Row blocks of the ring (expert_x and routed_hidden): >= ceil(rows_capacity / 128) for one
  // round, else a multiple of minibatch_mblocks >= 2 minibatch_mblocks within expert_rows
  // (ring_config()).
  int ring_mblocks = 0;
  // The kernel makes the schedule itself (after begin_call), else stage_tokens and schedule ran
  // before it.
  bool schedule_in_kernel = true;
  // CTAs that make the schedule in the kernel (comm_ctas..num_ctas); the rest start on the shared
  // expert's gate/up tiles meanwhile.
  int schedule_ctas = 0;
  // L2 partition of each %smid (runtime/l2_partitions.hpp, kMaxSmIds entries), or null: task
  // tickets go out in minibatches per partition (kernels/megakernel/tickets.cuh).
  const uint8_t* sm_partition = nullptr;
  uint64_t* trace = nullptr;  // (num_ctas, kTraceFields) timeline, or null
};

// Dynamic shared memory of one CTA.
int fused_forward_shared_bytes();

// The minibatch and ring, in row blocks, for a workspace with `layout.expert_rows` rows of
// expert_x and a wanted minibatch: one round when expert_x holds every row, else the minibatch
// shrinks to at most half the ring and the ring to a multiple of it. Needs expert_rows >= 256.
struct RingBlocks {
  int minibatch_mblocks;
  int ring_mblocks;
};
RingBlocks ring_config(const comm::WorkspaceLayout& layout, int minibatch_mblocks);

// x (T, H) bf16 and topk_idx (T, k) int32: the caller's, on this device; T = num_tokens.
void fused_forward(CommWorkspace& ws, const LayerShape& shape, const FusedForwardBuffers& buffers,
                   const bf16* x, const int32_t* topk_idx, int64_t num_tokens,
                   const FusedForwardConfig& config, cudaStream_t stream);

}  // namespace mok
