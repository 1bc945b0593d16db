// The fused forward's compute: tasks by ticket, each run by the GEMM engine's mainloop and an
// epilogue, inputs awaited and outputs published through the row-block counters; see
// forward_kernel.cuh and task_list.cuh.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/gemm/mainloop.cuh"
#include "kernels/megakernel/carried_tails.cuh"
#include "kernels/megakernel/combine_store.cuh"
#include "kernels/megakernel/communicate.cuh"
#include "kernels/megakernel/forward_params.cuh"
#include "kernels/megakernel/saved_context.cuh"
#include "kernels/megakernel/sync.cuh"
#include "kernels/megakernel/task_list.cuh"
#include "kernels/megakernel/tickets.cuh"
#include "kernels/megakernel/trace.cuh"
#include "kernels/ptx/barrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/tma.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ inline TaskShape task_shape(const FusedForwardParams& params) {
  TaskShape shape;
  shape.shared_mblocks =
      params.has_shared ? gemm::ceil_div(params.num_tokens, gemm::TileConfig::BLOCK_M) : 0;
  shape.routed_mblocks = 0;  // known once the schedule is (routed_mblocks())
  shape.num_experts = static_cast<int>(params.view.layout.experts_per_rank());
  shape.minibatch_mblocks = params.minibatch_mblocks;
  shape.ring_mblocks = params.ring_mblocks;
  for (int kind = 0; kind < kNumTaskKinds; ++kind) {
    shape.n_blocks[kind] = gemm::ceil_div(params.gemm[kind].n, gemm::TileConfig::BLOCK_N);
  }
  return shape;
}

// Producer lane 0: waits until this call's schedule is made, then reads the routed row blocks;
// 0 when the schedule failed (the error is recorded).
__device__ inline int routed_mblocks(const FusedForwardParams& params) {
  if (!wait_for_schedule(params)) return 0;
  const comm::WorkspaceView& view = params.view;
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
      // A block `offset` blocks on of the tile's expert (row_begin is the ring's, not the call's):
      // its rows, and its hidden rows' ring slot, free once the block a round back has been read
      // by its down tiles. The tile's own block, and the tail's when it carries some (in the same
      // ring round).
      const auto wait_block = [&](int offset) {
        const int mblock = task.mblock + offset;
        const int rows =
            min(gemm::TileConfig::BLOCK_M,
                task.tile.row_count - (task.tile.mblock + offset) * gemm::TileConfig::BLOCK_M);
        wait_counter(view, comm::TaskCounter::kRowsArrived, mblock, rows, comm::Phase::kDispatch);
        if (mblock >= shape.ring_mblocks) {
          wait_counter(view, comm::TaskCounter::kDownDone, mblock - shape.ring_mblocks,
                       shape.n_blocks[static_cast<int>(TaskKind::kDown)], comm::Phase::kExperts);
        }
      };
      wait_block(0);
      if (task.tail_rows > 0) wait_block(task.tail_offset());
      break;
    }
    case TaskKind::kSharedDown:
      wait_counter(view, comm::TaskCounter::kSharedHiddenReady, task.mblock,
                   shape.n_blocks[static_cast<int>(TaskKind::kSharedGateUp)],
                   comm::Phase::kExperts);
      break;
    case TaskKind::kDown: {
      // (a carried tail's hidden rows are ready once all its carriers have stored theirs)
      const int tiles = shape.n_blocks[static_cast<int>(TaskKind::kGateUp)];
      wait_counter(view, comm::TaskCounter::kHiddenReady, task.mblock, tiles,
                   comm::Phase::kExperts);
      if (task.tail_rows > 0) {
        wait_counter(view, comm::TaskCounter::kHiddenReady, task.mblock + task.tail_offset(),
                     tiles * task.tail_carriers, comm::Phase::kExperts);
      }
      break;
    }
  }
  // The TMA loads that follow (async proxy) read what the acquire made visible.
  ptx::fence_proxy_async_global();
}

// row_destination: where staged bf16 rows go (the epilogue's row-major default, or RowsToOwners;
// its block(n) places the rows n blocks on: a carried tail's). save (SwiGLU tiles, save mode):
// where the pre-activations go too, or null.
template <gemm::EpilogueKind kEpilogue, class RowDestination = typename gemm::Epilogue<
                                            gemm::GemmKind::kForward, kEpilogue>::RowMajorRows>
__device__ inline void run_tile(const gemm::GroupedGemmParams& gemm_params, const Task& task,
                                int consumer_idx, const Loop::Storage& smem,
                                const uint8_t* tail_smem, Loop::State& state,
                                float (&accum)[gemm::TileConfig::BLOCK_N / 2],
                                const RowDestination& row_destination = {},
                                const RowsToSavedContext* save = nullptr) {
  using Store = gemm::Epilogue<gemm::GemmKind::kForward, kEpilogue>;
  constexpr bool kCanSave = kEpilogue == gemm::EpilogueKind::kSwiGluBf16;
  Store::init(gemm_params, task.tile, consumer_idx, accum);
  constexpr bool kCanCarry = kEpilogue != gemm::EpilogueKind::kStoreFp32;
  if (kCanCarry && task.tail_rows > 0) {
    float tail[Tail::kAccumulators];
    Tail::mma_beside_full_tile<Loop>(smem, tail_smem, kTailStageBytes, gemm_params, task.tile,
                                     consumer_idx, state, accum, tail);
    float* stash = tail_stash(tail_smem);
#pragma unroll
    for (int i = 0; i < Tail::kAccumulators; ++i) stash[i * kConsumerThreads] = tail[i];
  } else {
    Loop::mma(smem, gemm_params, task.tile, consumer_idx, state, accum);
  }
  if constexpr (kCanSave) {
    if (save != nullptr) {
      save_pre_activations(gemm_params, task.tile, consumer_idx, smem.staging, accum, *save);
    }
  }
  Store::store(gemm_params, task.tile, consumer_idx, smem.staging, accum, row_destination);
  if constexpr (kCanCarry) {
    if (task.tail_rows > 0) {
      if constexpr (kCanSave) {
        if (save != nullptr) {
          store_tail<gemm::EpilogueKind::kStoreBf16>(gemm_params, task, consumer_idx,
                                                     tail_stash(tail_smem), *save);
        }
      }
      store_tail<kEpilogue>(gemm_params, task, consumer_idx, tail_stash(tail_smem),
                            row_destination);
    }
  }
}

// All consumer threads, after storing a tile: the row block's counter of `kind` moves on (the
// barrier orders every consumer's stores before the raise's fence).
// tail_mblock >= 0: the carried tail's block, whose counter moves on too.
__device__ inline void publish_tile(const comm::WorkspaceView& view, comm::TaskCounter kind,
                                    int mblock, int tail_mblock = -1) {
  consumer_barrier();
  if (gemm::is_consumer_leader()) {
    raise_counter(view, kind, mblock);
    if (tail_mblock >= 0) raise_counter(view, kind, tail_mblock);
  }
}

// All consumer threads, after their last stores: count this CTA's down tiles; the CTA that
// completes the rank's count raises the combine flag on every rank.
__device__ inline void finish_down_tiles(const FusedForwardParams& params, uint32_t down_tiles) {
  consumer_barrier();
  if (!gemm::is_consumer_leader()) return;
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
// NOTE: racecheck reports the slot's write against the consumers' reads of it, though both ways
// are ordered: the write precedes the producer's arrive (release) on `full`, which every reader
// waits on (acquire); a warp's reads precede its __syncwarp, then its lane 0 arrives on `empty`,
// which the producer waits on before the next write. The tool apparently does not carry lanes
// 1-31's reads across the warp barrier; scripts/device/sanitize.sh counts that report apart, by
// the two lines' text, and shows which hazards it is (docs/perf-notes/reliability.md).
inline constexpr int kTaskSlots = 4;
inline constexpr int kNoTask = -1;

struct TaskRing {
  Task task[kTaskSlots];
  uint64_t full[kTaskSlots];
  uint64_t empty[kTaskSlots];
};

// Where a role is in the task ring: slot and the phase parity of its barriers.
struct TaskRingCursor {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kTaskSlots) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// The producer warp: takes tickets, decodes them, hands each task to the consumers through the
// ring, waits for its inputs and issues its loads; a kNoTask slot when none is left.
__device__ __forceinline__ void produce_tasks(const FusedForwardMaps& maps,
                                              const FusedForwardParams& params,
                                              const Loop::Storage& smem, TaskRing& handoff,
                                              uint8_t* aligned_smem, Loop::State& state) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const TaskShape shape = task_shape(params);
  TaskScheduler scheduler(shape, params.view.offsets(), params.view.counts(), params.num_tokens);
  TaskRingCursor cursor;
  Task task;
  uint32_t tail_phase = 0;
  bool routed_known = false;
  const TraceSpans spans{params.trace != nullptr};
  uint32_t input_wait_ns = 0, slot_wait_ns = 0, tasks = 0;  // 32 bits: 4 s is plenty
  for (;;) {
    int ticket = 0;
    if (lane == 0) {
      // (the partition is looked up per ticket: kept in a register, the producer spilled)
      ticket = take_ticket(params.view.state(),
                           cta_l2_partition(params.sm_partition, params.max_sm_ids));
    }
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (!routed_known && ticket >= scheduler.shared_gate_up_tasks()) {
      int mblocks = 0;
      const uint64_t wait_start = spans.begin();
      if (lane == 0) mblocks = routed_mblocks(params);
      const uint32_t waited = spans.since(wait_start);
      input_wait_ns += waited;
      if (lane == 0) trace_set(params.trace, kTraceWaitScheduleNs, waited);
      scheduler.set_routed_mblocks(__shfl_sync(0xffffffffu, mblocks, 0));
      routed_known = true;
    }
    const bool has_task = scheduler.decode(ticket, task);
    if (!has_task) task.mblock = kNoTask;
    if (has_task && task.carried) continue;  // the tile of the block before computes it
    if (lane == 0) {
      const uint64_t wait_start = spans.begin();
      ptx::mbarrier_wait(&handoff.empty[cursor.slot], cursor.phase ^ 1u);
      slot_wait_ns += spans.since(wait_start);
      handoff.task[cursor.slot] = task;
      ptx::mbarrier_arrive(&handoff.full[cursor.slot]);
    }
    __syncwarp();
    cursor.advance();
    if (!has_task) {
      if (lane == 0) {
        trace_set(params.trace, kTraceTasksEnd, spans.begin());
        trace_set(params.trace, kTraceTasks, tasks);
        trace_set(params.trace, kTraceInputWaitNs, input_wait_ns);
        trace_set(params.trace, kTraceSlotWaitNs, slot_wait_ns);
      }
      return;
    }
    ++tasks;
    if (lane == 0) {
      const uint64_t wait_start = spans.begin();
      wait_for_inputs(params, shape, task);
      if (spans.on) {
        const uint32_t waited = spans.since(wait_start);
        input_wait_ns += waited;
        // per kind, accumulated in the trace record itself (no producer registers)
        const int field = kTraceWaitKindNs + static_cast<int>(task.kind);
        params.trace[blockIdx.x * kTraceFields + field] += waited;
      }
    }
    __syncwarp();
    const int kind = static_cast<int>(task.kind);
    if (task.tail_rows > 0) {
      Loop::load(&maps.a[kind], &maps.b[kind], smem, params.gemm[kind], task.tile, state,
                 tail_phase, TailLoads(&maps.a_tail[kind], tail_stages(aligned_smem), task));
    } else {
      Loop::load(&maps.a[kind], &maps.b[kind], smem, params.gemm[kind], task.tile, state,
                 tail_phase);
    }
  }
}

// A consumer warpgroup: runs the tasks the producer hands over until the kNoTask slot; publishes
// gate/up tiles to their row blocks' counters and counts this CTA's down tiles.
__device__ __forceinline__ void consume_tasks(const FusedForwardParams& params,
                                              const Loop::Storage& smem, TaskRing& handoff,
                                              uint8_t* aligned_smem, Loop::State& state,
                                              int consumer_idx) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const uint8_t* tail_smem = tail_stages(aligned_smem);
  float accum[gemm::TileConfig::BLOCK_N / 2];  // (64, BLOCK_N) fragment of this warpgroup
  TaskRingCursor cursor;
  Task task;
  uint32_t down_tiles = 0;  // stored by this CTA
  const TraceSpans spans{params.trace != nullptr && gemm::is_consumer_leader()};
  uint32_t publish_ns = 0;
  for (;;) {
    ptx::mbarrier_wait(&handoff.full[cursor.slot], cursor.phase);
    task = handoff.task[cursor.slot];
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&handoff.empty[cursor.slot]);
    cursor.advance();
    if (task.mblock == kNoTask) break;
    const gemm::GroupedGemmParams& gemm_params = params.gemm[static_cast<int>(task.kind)];
    // A tile that carries rows of a tail stands for (part of) the tail's tile too.
    const int tail_mblock = task.tail_rows > 0 ? task.mblock + task.tail_offset() : -1;
    switch (task.kind) {
      case TaskKind::kSharedGateUp:
      case TaskKind::kGateUp: {
        const bool routed = task.kind == TaskKind::kGateUp;
        __nv_bfloat16* saved = routed ? params.saved_gate_up : params.saved_shared_gate_up;
        const RowsToSavedContext save{
            routed ? params.view.row_source() : nullptr, reinterpret_cast<char*>(saved),
            static_cast<int64_t>(gemm_params.n) * 2,
            static_cast<int64_t>(task.mblock) * gemm::TileConfig::BLOCK_M};
        run_tile<gemm::EpilogueKind::kSwiGluBf16>(gemm_params, task, consumer_idx, smem, tail_smem,
                                                  state, accum, {},
                                                  saved != nullptr ? &save : nullptr);
        const uint64_t publish_start = spans.begin();
        publish_tile(params.view,
                     task.kind == TaskKind::kGateUp ? comm::TaskCounter::kHiddenReady
                                                    : comm::TaskCounter::kSharedHiddenReady,
                     task.mblock, tail_mblock);
        publish_ns += spans.since(publish_start);
        break;
      }
      case TaskKind::kSharedDown:
        // fp32 from registers; read only by the reduce, after this kernel
        run_tile<gemm::EpilogueKind::kStoreFp32>(gemm_params, task, consumer_idx, smem, tail_smem,
                                                 state, accum);
        break;
      case TaskKind::kDown: {
        // The combine push: each row into its owner's slot (combine_store.cuh).
        const int first_row = task.mblock * gemm::TileConfig::BLOCK_M;
        run_tile<gemm::EpilogueKind::kStoreBf16>(gemm_params, task, consumer_idx, smem, tail_smem,
                                                 state, accum,
                                                 RowsToOwners{&params.view, first_row});
        // (the tail's tile counts once, with its first carrier)
        down_tiles += task.tail_rows > 0 && task.tail_carrier == 0 ? 2 : 1;
        if (task.frees_ring_block) {
          // Every k-block of the tile has landed (both consumers waited for them): its hidden
          // rows (and a carried tail's, in the same round: one carrier with ring rounds) may
          // be overwritten by the next round.
          publish_tile(params.view, comm::TaskCounter::kDownDone, task.mblock, tail_mblock);
        }
        break;
      }
    }
  }
  if (down_tiles > 0) finish_down_tiles(params, down_tiles);
  if (spans.on) {
    trace_set(params.trace, kTraceEnd, spans.begin());
    trace_set(params.trace, kTracePublishNs, publish_ns);
  }
}

// The whole CTA: runs tasks until none is left. The producer warp takes each ticket from the
// rank's counter as soon as the previous task's loads are issued, so a CTA that joins late (a
// communication CTA done with the dispatch) or runs slow tiles simply takes fewer tasks. Warps
// 1-3 of the producer warpgroup dispatch rows beside the tiles (communicate.cuh) unless
// communication CTAs do.
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

  Loop::State state;
  if (gemm::warpgroup_role() == gemm::WarpgroupRole::kProducer) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    if (threadIdx.x / 32 == 0) {
      produce_tasks(maps, params, smem, handoff, aligned_smem, state);
    } else if (params.num_comm_ctas == 0) {
      dispatch_beside_tiles(params);
    }
  } else {
    ptx::setmaxnreg_increase<kConsumerRegisters>();
    consume_tasks(params, smem, handoff, aligned_smem, state, gemm::warpgroup_index() - 1);
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
