// The fused forward of one MoE layer on one rank: one persistent launch, one CTA per SM, between
// the schedule (before) and the combine reduce (after).
//
//   every CTA first: the schedule — stage x into the window, push topk_idx to every rank, count
//     and order the rows of the local experts (token_schedule.cuh)
//   communication CTAs (blockIdx < num_comm_ctas): the dispatch — pull every routed row into
//     expert_x in row order, counting each row block's arrivals (TaskCounter::kRowsArrived) —
//     then they compute too
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

#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/megakernel/combine_store.cuh"
#include "kernels/megakernel/sync.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/schedule/token_schedule.cuh"

namespace mok::megakernel {

// Indexed by TaskKind: A (rows, K) and B (groups, N, K) of each GEMM.
struct FusedForwardMaps {
  CUtensorMap a[kNumTaskKinds];
  CUtensorMap b[kNumTaskKinds];
};

struct FusedForwardParams {
  comm::WorkspaceView view;
  const __nv_bfloat16* x;    // (T, H), the caller's tokens
  const int32_t* topk_idx;   // (T, k)
  gemm::GroupedGemmParams gemm[kNumTaskKinds];  // n, k and output of each GEMM
  int num_tokens;     // this rank's tokens this call
  int num_comm_ctas;  // blockIdx.x below this communicates, the rest compute
  int chunk_mblocks;  // row blocks per minibatch
  int has_shared;
  int schedule_in_kernel;  // 0: the schedule kernels (comm_ops.hpp) ran before the launch
};

// Every task shares one stage ring, laid out for the SwiGLU epilogue (it has the staging tile).
using RingLayout = gemm::SharedLayout<gemm::EpilogueKind::kSwiGluBf16>;
using Loop = gemm::Mainloop<gemm::GemmKind::kForward, RingLayout>;
inline constexpr int kThreads = gemm::TileConfig::kNumThreads;
inline constexpr int kCopyUnroll = 8;
// Register split (128 * producer + 256 * consumer <= 64 K): the producer warp also decodes tasks.
inline constexpr uint32_t kProducerRegisters = 56;
inline constexpr uint32_t kConsumerRegisters = 224;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// ---- communication ----------------------------------------------------------------------------

// One warp copies one row (row_bytes, a multiple of 16), e.g. from a peer's window: loads bypass
// L1.
__device__ inline void copy_row(const char* source, char* destination, int64_t row_bytes,
                                int lane) {
  const int4* from = reinterpret_cast<const int4*>(source);
  int4* to = reinterpret_cast<int4*>(destination);
  const int64_t vectors = row_bytes / 16;
  for (int64_t base = lane; base < vectors; base += 32 * kCopyUnroll) {
    int4 values[kCopyUnroll];
#pragma unroll
    for (int unroll = 0; unroll < kCopyUnroll; ++unroll) {
      const int64_t index = base + unroll * 32;
      if (index < vectors) values[unroll] = __ldcg(from + index);
    }
#pragma unroll
    for (int unroll = 0; unroll < kCopyUnroll; ++unroll) {
      const int64_t index = base + unroll * 32;
      if (index < vectors) to[index] = values[unroll];
    }
  }
}

// The schedule, on every CTA: the steps of token_schedule.cuh, with barriers across the grid in
// place of kernel boundaries (ordering the rows is one CTA per expert, too much for the
// communication CTAs alone: measured 30 % slower on qwen3-30b-a3b). Ends by publishing
// schedule_epoch, which the compute producers also wait for before their first routed task (a
// failed schedule publishes it too: they then find the error and skip the routed tasks).
// NOTE: not inlined: inlined, its loops spilled ~140 B of registers in the whole kernel.
__device__ __noinline__ void make_schedule(const FusedForwardParams& params, uint32_t epoch) {
  const comm::WorkspaceView& view = params.view;
  const comm::WorkspaceLayout& layout = view.layout;
  const int cta = static_cast<int>(blockIdx.x), num_ctas = static_cast<int>(gridDim.x);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  // x into the window (peers pull it once they see the gather flag), topk_idx to every rank.
  for (int64_t token = static_cast<int64_t>(cta) * warps + threadIdx.x / 32;
       token < params.num_tokens; token += static_cast<int64_t>(num_ctas) * warps) {
    const char* source = reinterpret_cast<const char*>(params.x) + token * layout.row_bytes();
    copy_row(source, view.x_row(view.rank, token), layout.row_bytes(), lane);
  }
  comm::gather_copy(view, params.topk_idx, params.num_tokens, cta, num_ctas);
  bool ok = ctas_barrier(view, num_ctas);
  if (ok && cta == 0 && threadIdx.x == 0) {
    __threadfence_system();
    comm::signal_all_ranks(view, comm::FlagKind::kGather, epoch);
  }
  if (ok) comm::count_rows(view, cta, num_ctas);  // waits for every rank's gather flag
  ok = ok && ctas_barrier(view, num_ctas);
  if (ok) {
    for (int64_t expert = cta; expert < layout.experts_per_rank(); expert += num_ctas) {
      comm::order_rows(view, expert);
    }
  }
  ok = ok && ctas_barrier(view, num_ctas);
  // NOTE: on failure (a recorded error) every waiter gives up on its own, and the producers,
  // released here, find the error and take no routed task.
  if (cta == 0 && threadIdx.x == 0) store_release_gpu(&view.state()->schedule_epoch, epoch);
}

__device__ inline void communicate(const FusedForwardParams& params) {
  const comm::WorkspaceView& view = params.view;
  const comm::WorkspaceLayout& layout = view.layout;
  comm::DeviceState* state = view.state();
  const uint32_t epoch = state->epoch;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  if (comm::cta_sees_error(view)) return;
  const int64_t num_rows = view.offsets()[layout.experts_per_rank()];
  const int32_t* row_source = view.row_source();

  // Rows in order, dealt to every communication warp in turn, so row blocks fill front to back.
  uint32_t* arrived = view.task_counters(comm::TaskCounter::kRowsArrived);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < num_rows;
       row += static_cast<int64_t>(params.num_comm_ctas) * warps) {
    const int32_t packed = row_source[row];
    if (packed < 0) continue;  // padding: never counted, never read
    const comm::RowSource source = comm::unpack_row_source(layout, packed);
    copy_row(view.x_row(source.rank, source.token), view.expert_x_row(row), layout.row_bytes(),
             lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence();
      atomicAdd(arrived + row / gemm::TileConfig::BLOCK_M, 1u);
    }
  }

  // A rank with no routed rows has no down tile to raise its combine flag.
  if (num_rows == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    comm::signal_all_ranks(view, comm::FlagKind::kCombine, epoch);
  }
}

// ---- compute ----------------------------------------------------------------------------------

__device__ inline TaskShape task_shape(const FusedForwardParams& params) {
  TaskShape shape;
  shape.shared_mblocks =
      params.has_shared ? gemm::ceil_div(params.num_tokens, gemm::TileConfig::BLOCK_M) : 0;
  shape.routed_mblocks = 0;  // known once the schedule is (routed_mblocks())
  shape.num_experts = static_cast<int>(params.view.layout.experts_per_rank());
  shape.chunk_mblocks = params.chunk_mblocks;
  for (int kind = 0; kind < kNumTaskKinds; ++kind) {
    shape.n_blocks[kind] = gemm::ceil_div(params.gemm[kind].n, gemm::TileConfig::BLOCK_N);
  }
  return shape;
}

// Producer lane 0: waits until the communication CTAs have made this call's schedule, then reads
// the routed row blocks; 0 when the schedule failed (the error is recorded).
__device__ inline int routed_mblocks(const FusedForwardParams& params) {
  const comm::WorkspaceView& view = params.view;
  comm::DeviceState* state = view.state();
  const uint32_t epoch = state->epoch;
  const uint64_t start_ns = comm::global_timer_ns();
  for (uint32_t spin = 0;
       params.schedule_in_kernel && load_acquire_gpu(&state->schedule_epoch) != epoch; ++spin) {
    if ((spin & 63u) == 63u) {
      if (comm::has_error(&state->error)) return 0;
      if (comm::global_timer_ns() - start_ns > view.timeout_ns) {
        comm::ErrorDetail detail{comm::Phase::kSchedule};
        detail.expected = epoch;
        comm::raise_error(&state->error, comm::ErrorCode::kTimeout,
                          static_cast<uint32_t>(view.rank), detail);
        return 0;
      }
    }
    __nanosleep(64);
  }
  if (comm::has_error(&state->error)) return 0;
  return view.offsets()[view.layout.experts_per_rank()] / gemm::TileConfig::BLOCK_M;
}

// Producer lane 0, before a task's first load: its input rows are written and released.
__device__ inline void wait_for_inputs(const FusedForwardParams& params, const TaskShape& shape,
                                       const Task& task) {
  const comm::WorkspaceView& view = params.view;
  switch (task.kind) {
    case TaskKind::kSharedGateUp:
      return;  // x was staged before the launch
    case TaskKind::kGateUp: {
      const int rows = min(gemm::TileConfig::BLOCK_M,
                           task.tile.row_begin + task.tile.row_count -
                               task.mblock * gemm::TileConfig::BLOCK_M);
      wait_counter(view, comm::TaskCounter::kRowsArrived, task.mblock, rows, comm::Phase::kDispatch);
      break;
    }
    case TaskKind::kSharedDown:
      wait_counter(view, comm::TaskCounter::kSharedHiddenReady, task.mblock,
                   shape.n_blocks[static_cast<int>(TaskKind::kSharedGateUp)],
                   comm::Phase::kExperts);
      break;
    case TaskKind::kDown:
      wait_counter(view, comm::TaskCounter::kHiddenReady, task.mblock,
                   shape.n_blocks[static_cast<int>(TaskKind::kGateUp)], comm::Phase::kExperts);
      break;
  }
  // The TMA loads that follow (async proxy) read what the acquire made visible.
  comm::fence_async_proxy_global();
}

template <gemm::EpilogueKind kEpilogue>
__device__ inline void run_tile(const gemm::GroupedGemmParams& gemm_params, const Task& task,
                                int consumer_idx, const Loop::Storage& smem, Loop::State& state,
                                float (&accum)[gemm::TileConfig::BLOCK_N / 2]) {
  using Store = gemm::Epilogue<gemm::GemmKind::kForward, kEpilogue>;
  Store::init(gemm_params, task.tile, consumer_idx, accum);
  Loop::mma(smem, gemm_params, task.tile, consumer_idx, state, accum);
  Store::store(gemm_params, task.tile, consumer_idx, smem.staging, accum);
}

// All consumer threads, after a tile's bulk stores were issued: once they have landed, the row
// block's counter of `kind` moves on.
__device__ inline void publish_tile(const comm::WorkspaceView& view, comm::TaskCounter kind,
                                    int mblock) {
  if (threadIdx.x % 32 < 16) ptx::bulk_wait_group<0>();
  consumer_barrier();
  if (threadIdx.x == 128) raise_counter(view, kind, mblock);
}

// All consumer threads, once their last bulk copies have landed: count this CTA's down tiles; the
// CTA that completes the rank's count raises the combine flag on every rank.
__device__ inline void finish_down_tiles(const FusedForwardParams& params, uint32_t down_tiles) {
  consumer_barrier();
  if (threadIdx.x != 128) return;
  const comm::WorkspaceView& view = params.view;
  comm::DeviceState* state = view.state();
  // The schedule is known here: this CTA ran down tiles, handed over after the producer's acquire.
  const uint32_t total =
      static_cast<uint32_t>(view.offsets()[view.layout.experts_per_rank()] /
                            gemm::TileConfig::BLOCK_M) *
      static_cast<uint32_t>(gemm::ceil_div(params.gemm[static_cast<int>(TaskKind::kDown)].n,
                                           gemm::TileConfig::BLOCK_N));
  __threadfence_system();  // the rows this CTA wrote into peers' slots, before the count
  const uint32_t previous = atomicAdd(&state->down_tiles_done, down_tiles);
  if (previous + down_tiles == total) {
    __threadfence_system();
    comm::signal_all_ranks(view, comm::FlagKind::kCombine, state->epoch);
  }
}

// The tasks the producer took, decoded, handed to the consumers in order: kTaskSlots slots, each
// with a full barrier (the producer wrote it) and an empty one (every consumer warp has read it).
// A slot whose task.mblock is kNoTask tells the consumers to stop.
inline constexpr int kTaskSlots = 4;
inline constexpr int kNoTask = -1;

struct TaskRing {
  Task task[kTaskSlots];
  uint64_t full[kTaskSlots];
  uint64_t empty[kTaskSlots];
};

// The whole CTA: runs tasks until none is left. The producer warp takes each ticket from the
// rank's counter as soon as the previous task's loads are issued, so a CTA that joins late (a
// communication CTA done with the dispatch) or runs slow tiles simply takes fewer tasks.
__device__ inline void compute(const FusedForwardMaps& maps, const FusedForwardParams& params,
                               uint8_t* aligned_smem) {
  const Loop::Storage smem = Loop::Storage::carve(aligned_smem);
  __shared__ TaskRing handoff;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < RingLayout::kNumStages; ++stage) {
      ptx::mbarrier_init(&smem.full[stage], 1);
      ptx::mbarrier_init(&smem.empty[stage], gemm::TileConfig::kNumConsumerWarpgroups * 4);
    }
    ptx::mbarrier_init(smem.tail, 1);
    for (int slot = 0; slot < kTaskSlots; ++slot) {
      ptx::mbarrier_init(&handoff.full[slot], 1);
      ptx::mbarrier_init(&handoff.empty[slot], gemm::TileConfig::kNumConsumerWarpgroups * 4);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  Task task;
  Loop::State state;
  int slot = 0;
  uint32_t slot_phase = 0;
  auto advance_slot = [&] {
    if (++slot == kTaskSlots) {
      slot = 0;
      slot_phase ^= 1u;
    }
  };
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warpgroup_idx = static_cast<int>(threadIdx.x / 128);
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    if (threadIdx.x / 32 == 0) {
      const TaskShape shape = task_shape(params);
      TaskScheduler scheduler(shape, params.view, params.num_tokens);
      uint32_t* next_task = &params.view.state()->next_task;
      uint32_t tail_phase = 0;
      bool routed_known = false;
      for (;;) {
        int ticket = 0;
        if (lane == 0) ticket = static_cast<int>(atomicAdd(next_task, 1u));
        ticket = __shfl_sync(0xffffffffu, ticket, 0);
        if (!routed_known && ticket >= scheduler.shared_gate_up_tasks()) {
          int mblocks = 0;
          if (lane == 0) mblocks = routed_mblocks(params);
          scheduler.set_routed_mblocks(__shfl_sync(0xffffffffu, mblocks, 0));
          routed_known = true;
        }
        const bool has_task = scheduler.decode(ticket, task);
        if (!has_task) task.mblock = kNoTask;
        if (lane == 0) {
          ptx::mbarrier_wait(&handoff.empty[slot], slot_phase ^ 1u);
          handoff.task[slot] = task;
          ptx::mbarrier_arrive(&handoff.full[slot]);
        }
        __syncwarp();
        advance_slot();
        if (!has_task) break;
        if (lane == 0) wait_for_inputs(params, shape, task);
        __syncwarp();
        const int kind = static_cast<int>(task.kind);
        Loop::load(&maps.a[kind], &maps.b[kind], smem, params.gemm[kind], task.tile, state,
                   tail_phase);
      }
    }
  } else {
    ptx::setmaxnreg_increase<kConsumerRegisters>();
    const int consumer_idx = warpgroup_idx - 1;
    float accum[gemm::TileConfig::BLOCK_N / 2];  // (64, BLOCK_N) fragment of this warpgroup
    uint32_t down_tiles = 0;  // stored by this CTA
    for (;;) {
      ptx::mbarrier_wait(&handoff.full[slot], slot_phase);
      task = handoff.task[slot];
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&handoff.empty[slot]);
      advance_slot();
      if (task.mblock == kNoTask) break;
      const gemm::GroupedGemmParams& gemm_params = params.gemm[static_cast<int>(task.kind)];
      switch (task.kind) {
        case TaskKind::kSharedGateUp:
        case TaskKind::kGateUp:
          run_tile<gemm::EpilogueKind::kSwiGluBf16>(gemm_params, task, consumer_idx, smem, state,
                                                    accum);
          publish_tile(params.view,
                       task.kind == TaskKind::kGateUp ? comm::TaskCounter::kHiddenReady
                                                      : comm::TaskCounter::kSharedHiddenReady,
                       task.mblock);
          break;
        case TaskKind::kSharedDown:
          // fp32 from registers; read only by the reduce, after this kernel
          run_tile<gemm::EpilogueKind::kStoreFp32>(gemm_params, task, consumer_idx, smem, state,
                                                   accum);
          break;
        case TaskKind::kDown: {
          using Store = gemm::Epilogue<gemm::GemmKind::kForward, gemm::EpilogueKind::kStoreBf16>;
          Store::init(gemm_params, task.tile, consumer_idx, accum);
          Loop::mma(smem, gemm_params, task.tile, consumer_idx, state, accum);
          store_rows_to_owners<RingLayout::kStagingPitch>(params.view, gemm_params.n, task.tile,
                                                          consumer_idx, smem.staging, accum);
          ++down_tiles;
          break;
        }
      }
    }
    if (threadIdx.x % 32 < 16) ptx::bulk_wait_group<0>();
    if (down_tiles > 0) finish_down_tiles(params, down_tiles);
  }
}

#endif  // __CUDA_ARCH__ >= 900

__global__ void __launch_bounds__(kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardMaps maps,
                         const __grid_constant__ FusedForwardParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  // An earlier fault (e.g. a bad expert id found by the schedule) leaves the offsets undefined.
  if (comm::cta_sees_error(params.view)) return;
  if (params.schedule_in_kernel) make_schedule(params, params.view.state()->epoch);
  if (static_cast<int>(blockIdx.x) < params.num_comm_ctas) {
    communicate(params);
    __syncthreads();  // then compute like the others
  }
  const uint32_t base_address = ptx::smem_address(dynamic_smem);
  uint8_t* aligned = dynamic_smem + ((RingLayout::kAlignment - base_address % RingLayout::kAlignment) %
                                     RingLayout::kAlignment);
  compute(maps, params, aligned);
#endif
}

}  // namespace mok::megakernel
