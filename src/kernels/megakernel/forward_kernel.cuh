// The fused forward of one MoE layer on one rank: one persistent launch, one CTA per SM, between
// the schedule (before) and the combine reduce (after).
//
//   the first num_schedule_ctas CTAs first: the schedule — stage x into the window, push topk_idx
//     to every rank, count and order the rows of the local experts (token_schedule.cuh); the
//     other CTAs start on the shared gate/up tiles (they read the caller's x) meanwhile
//   the dispatch — pull every routed row into expert_x in row order, counting each row block's
//     arrivals (TaskCounter::kRowsArrived): by default (num_comm_ctas = 0) warps 1-3 of every
//     CTA's producer warpgroup, beside its tiles; else the first num_comm_ctas CTAs, which then
//     compute too
//   compute: the GEMM engine's producer warpgroup and two consumer warpgroups take tasks of the
//     list of task_list.cuh by ticket. The producer waits for a task's inputs before loading its
//     first k-block; after a gate/up tile's stores complete, the consumers raise its row block's
//     counter. The down tiles' epilogue is the combine push (combine_store.cuh): each row goes
//     to its owner's slot. When the last down tile of this rank has landed, this rank's combine
//     flag goes up on every rank, and the reduce (the next launch) waits for it.
//
// Every output element is computed by the same tile code, in the same k order, as the unfused
// composition (LayerForward with fused = false), so the two agree bitwise; no value depends on
// which CTA ran a task or when.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/megakernel/communicate.cuh"
#include "kernels/megakernel/compute.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/trace.cuh"
#include "kernels/ptx/barrier.cuh"

namespace mok::megakernel {

__global__ void __launch_bounds__(kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardMaps maps,
                         const __grid_constant__ FusedForwardParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  // An earlier fault (e.g. a bad expert id found by the schedule) leaves the offsets undefined.
  if (threadIdx.x == 0) {
    trace_set(params.trace, kTraceStart, trace_clock());
    trace_set(params.trace, kTraceWaitScheduleNs, 0);
    trace_set(params.trace, kTraceDispatched, 0);  // raised by this CTA's dispatching warps, if any
    for (int kind = 0; kind < kNumTaskKinds; ++kind) {  // summed into by this thread's producer
      trace_set(params.trace, static_cast<TraceField>(kTraceWaitKindNs + kind), 0);
    }
  }
  if (comm::cta_sees_error(params.view)) return;
  if (params.schedule_in_kernel && static_cast<int>(blockIdx.x) < params.num_schedule_ctas) {
    make_schedule(params, params.view.state()->epoch, reinterpret_cast<int32_t*>(dynamic_smem));
  }
  if (threadIdx.x == 0) trace_set(params.trace, kTraceScheduled, trace_clock());
  if (static_cast<int>(blockIdx.x) < params.num_comm_ctas) {
    communicate(params);
    __syncthreads();  // then compute like the others
    if (threadIdx.x == 0) trace_set(params.trace, kTraceDispatched, trace_clock());
  }
  const uint32_t base_address = ptx::smem_address(dynamic_smem);
  uint8_t* aligned =
      dynamic_smem +
      ((RingLayout::kAlignment - base_address % RingLayout::kAlignment) % RingLayout::kAlignment);
  compute(maps, params, aligned);
#endif
}

}  // namespace mok::megakernel
