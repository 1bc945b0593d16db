// The fused forward's communication: the schedule (every CTA) and the dispatch (the producer
// warpgroups' spare warps of every CTA, or the first num_comm_ctas CTAs), see forward_kernel.cuh.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/row_copy.cuh"
#include "kernels/comm/token_schedule.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/sync.cuh"
#include "kernels/megakernel/trace.cuh"

namespace mok::megakernel {

// 16-byte loads each dispatching lane keeps in flight: the kernel's 384 threads (against the copy
// kernels' 1024) need more than the copy kernels' 8 to keep the bytes in flight that an NVLink pull
// needs; 16 spilled registers in the whole kernel, 12 does not.
inline constexpr int kDispatchUnroll = 12;
// The same for the producer warpgroup's spare warps, which dispatch within its kProducerRegisters
// when the kernel has no communication CTAs.
inline constexpr int kProducerDispatchUnroll = 4;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The schedule, on the first num_schedule_ctas CTAs: comm::make_schedule, the standalone schedule
// kernel's code, while the other CTAs run shared gate/up tiles. Ends by publishing schedule_epoch,
// which the compute producers also wait for before their first routed task (a failed schedule
// publishes it too: they then find the error and skip the routed tasks).
// NOTE: not inlined: inlined, its loops spilled ~140 B of registers in the whole kernel.
// scratch: shared memory for (E_l + 1) + warps * E_l ints (the dynamic shared memory, unused until
// compute).
__device__ __noinline__ void make_schedule(const FusedForwardParams& params, uint32_t epoch,
                                           int32_t* scratch) {
  const comm::WorkspaceView& view = params.view;
  const comm::WorkspaceLayout& layout = view.layout;
  const int cta = static_cast<int>(blockIdx.x), num_ctas = params.num_schedule_ctas;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  // x into the window (peers pull it once they see the gather flag; this rank's own rows are read
  // from the caller's x, so one rank alone stages nothing), topk_idx to every rank.
  const int64_t staged_tokens = layout.num_ranks > 1 ? params.num_tokens : 0;
  for (int64_t token = static_cast<int64_t>(cta) * warps + threadIdx.x / 32; token < staged_tokens;
       token += static_cast<int64_t>(num_ctas) * warps) {
    const char* source = reinterpret_cast<const char*>(params.x) + token * layout.row_bytes();
    comm::copy_row_warp<comm::RowLoad::kBypassL1>(source, view.x_row(view.rank, token),
                                                  layout.row_bytes(), lane);
  }
  comm::make_schedule(view, params.topk_idx, /*topk_w=*/nullptr, params.num_tokens, cta, num_ctas,
                      scratch);
  // NOTE: on failure (a recorded error) every waiter gives up on its own, and the producers,
  // released here, find the error and take no routed task.
  if (cta == 0 && threadIdx.x == 0) ptx::store_release_gpu(&view.state()->schedule_epoch, epoch);
}

// One thread: waits until this call's schedule is made (make_schedule publishes schedule_epoch;
// with schedule_in_kernel = 0 it was made before the launch). False when it failed or timed out
// (the error is recorded).
__device__ inline bool wait_for_schedule(const FusedForwardParams& params) {
  const comm::WorkspaceView& view = params.view;
  comm::DeviceState* state = view.state();
  const uint32_t epoch = state->epoch;
  const bool scheduled = spin_until(
      view,
      [&] {
        return !params.schedule_in_kernel || ptx::load_acquire_gpu(&state->schedule_epoch) == epoch;
      },
      [&] {
        comm::ErrorDetail detail{comm::Phase::kSchedule};
        detail.expected = epoch;
        comm::raise_error(&state->error, comm::ErrorCode::kTimeout,
                          static_cast<uint32_t>(view.rank), detail);
      });
  return scheduled && !comm::has_error(&state->error);
}

// The dispatch's rows, dealt in order to warps first_warp, first_warp + num_warps, ...: each
// warp copies its rows into expert_x and counts each row block's arrivals
// (TaskCounter::kRowsArrived). kUnroll: 16-byte loads each lane keeps in flight.
template <int kUnroll>
__device__ inline void dispatch_rows(const FusedForwardParams& params, int64_t first_warp,
                                     int64_t num_warps) {
  const comm::WorkspaceView& view = params.view;
  const comm::WorkspaceLayout& layout = view.layout;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t num_rows = view.offsets()[layout.experts_per_rank()];
  const int32_t* row_source = view.row_source();

  // Rows in order, dealt to every dispatching warp in turn, so row blocks fill front to back.
  // Each warp's rows increase, so a warp waiting for a ring slot holds back only later rows.
  constexpr int kRows = gemm::TileConfig::BLOCK_M;
  uint32_t* arrived = view.task_counters(comm::TaskCounter::kRowsArrived);
  const uint32_t gate_up_tiles = static_cast<uint32_t>(gemm::ceil_div(
      params.gemm[static_cast<int>(TaskKind::kGateUp)].n, gemm::TileConfig::BLOCK_N));
  int slot_free_below = params.ring_mblocks;  // blocks this warp knows it may write
  for (int64_t row = first_warp; row < num_rows; row += num_warps) {
    const int32_t packed = row_source[row];
    if (packed < 0) continue;  // padding: never counted, never read
    const int mblock = static_cast<int>(row / kRows);
    if (mblock >= slot_free_below) {
      // A later round: the block's ring slot is free once the gate/up tiles of the block a round
      // back have read it.
      bool ok = true;
      if (lane == 0) {
        ok = wait_counter(view, comm::TaskCounter::kHiddenReady, mblock - params.ring_mblocks,
                          gate_up_tiles, comm::Phase::kDispatch);
      }
      if (!__shfl_sync(0xffffffffu, ok ? 1 : 0, 0)) return;
      slot_free_below = mblock + 1;
    }
    const int64_t ring_row = row - ring_round_base(mblock, params.ring_mblocks);
    const comm::RowSource source = comm::unpack_row_source(layout, packed);
    const char* from = source.rank == view.rank
                           ? reinterpret_cast<const char*>(params.x) +
                                 static_cast<int64_t>(source.token) * layout.row_bytes()
                           : view.x_row(source.rank, source.token);
    comm::copy_row_warp<comm::RowLoad::kBypassL1, kUnroll>(from, view.expert_x_row(ring_row),
                                                           layout.row_bytes(), lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence();
      atomicAdd(arrived + row / gemm::TileConfig::BLOCK_M, 1u);
    }
  }
}

// A rank with no routed rows has no down tile to raise its combine flag: one thread raises it.
__device__ inline void signal_combine_if_no_rows(const FusedForwardParams& params) {
  const comm::WorkspaceView& view = params.view;
  if (view.offsets()[view.layout.experts_per_rank()] == 0) {
    comm::signal_all_ranks(view, comm::FlagKind::kCombine, view.state()->epoch);
  }
}

// The dispatch with no communication CTAs (num_comm_ctas = 0): warps 1-3 of every CTA's producer
// warpgroup, idle otherwise, once the schedule is made, beside the CTA's tiles. Spread over every
// SM, the copy is not held to the rate one SM's loads reach (docs/perf-notes/layer.md).
__device__ inline void dispatch_beside_tiles(const FusedForwardParams& params) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int scheduled = 0;
  if (lane == 0) scheduled = wait_for_schedule(params) ? 1 : 0;
  if (!__shfl_sync(0xffffffffu, scheduled, 0)) return;
  constexpr int kDispatchWarps = 3;
  dispatch_rows<kProducerDispatchUnroll>(
      params, static_cast<int64_t>(blockIdx.x) * kDispatchWarps + threadIdx.x / 32 - 1,
      static_cast<int64_t>(gridDim.x) * kDispatchWarps);
  if (blockIdx.x == 0 && threadIdx.x == 32) signal_combine_if_no_rows(params);
  if (params.trace != nullptr && lane == 0) {
    atomicMax(reinterpret_cast<unsigned long long*>(
                  &params.trace[blockIdx.x * kTraceFields + kTraceDispatched]),
              static_cast<unsigned long long>(trace_clock()));
  }
}

__device__ inline void communicate(const FusedForwardParams& params) {
  if (comm::cta_sees_error(params.view)) return;
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  dispatch_rows<kDispatchUnroll>(params, static_cast<int64_t>(blockIdx.x) * warps + warp,
                                 static_cast<int64_t>(params.num_comm_ctas) * warps);
  if (blockIdx.x == 0 && threadIdx.x == 0) signal_combine_if_no_rows(params);
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
