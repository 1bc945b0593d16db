// The expert-parallel schedule, built on the GPU with no host reads:
//   1. begin_call      bump the call's epoch, zero the counters (one CTA), the fused forward's too
//   2. gather_copy     copy this rank's topk_idx (T, k) and T into every rank's window, then
//                      signal the gather flag (its x is in the window too: pulls may start)
//   3. count_slices, scan_slices, place_rows
//                      once every rank's gather flag is up: every id validated (in range,
//                      distinct within its row), the counts, the offsets (each local expert
//                      starts at a multiple of block_m) and each expert's rows in global token
//                      order (rank * T_max + t, then slot j), padding marked -1, in three passes
//                      over the ids however many experts: each warp counts the rows of every
//                      local expert in its slices of kScheduleSlice ids, one warp per expert turns
//                      the counts into the rows before each slice (in global order) and its total,
//                      and each warp places its slices' rows from there, in order; for this
//                      rank's own tokens, the row of each (t, j) (local_row) where the combine
//                      reads rows in place or the backward dispatches by token.
// make_schedule runs steps 2-3 in one kernel, grid barriers between the passes (the standalone
// schedule kernel, and the fused forward's schedule CTAs); within a pass nothing depends on timing.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/ptx/special_registers.cuh"

namespace mok::comm {

__device__ inline void begin_call(const WorkspaceView& view) {
  DeviceState* state = view.state();
  for (int64_t expert = threadIdx.x; expert < view.layout.experts_per_rank();
       expert += blockDim.x) {
    view.counts()[expert] = 0;
  }
  uint32_t* task_counters = view.task_counters(TaskCounter::kRowsArrived);
  for (int64_t index = threadIdx.x; index < kNumTaskCounters * view.layout.task_counter_blocks();
       index += blockDim.x) {
    task_counters[index] = 0;
  }
  if (threadIdx.x == 0) {
    state->call_began_ns = ptx::global_timer_ns();
    state->epoch += 1;
    state->combine_arrivals = 0;
    state->down_tiles_done = 0;
    state->next_task = 0;
    // No slice yet, and every ticket of it taken: the first producer to ask installs one.
    for (int partition = 0; partition < kMaxL2Partitions; ++partition) {
      state->task_pool[partition] = kTicketGrant;
    }
    state->barrier_count = 0;
  }
}

// This rank's topk_idx (T, k) and T into every rank's window, and its router weights topk_w
// (T, k) into its own when given (the backward's); CTA `cta` of `num_ctas` takes its share. The
// caller signals the gather flag once every CTA's stores are done.
__device__ inline void gather_copy(const WorkspaceView& view, const int32_t* topk_idx,
                                   const float* topk_w, int32_t num_tokens, int cta, int num_ctas) {
  const int64_t num_ids = static_cast<int64_t>(num_tokens) * view.layout.top_k;  // (T, k)
  const int64_t stride = static_cast<int64_t>(num_ctas) * blockDim.x;
  if (topk_w != nullptr) {
    float* weights = view.topk_w(view.rank);
    for (int64_t index = static_cast<int64_t>(cta) * blockDim.x + threadIdx.x; index < num_ids;
         index += stride) {
      weights[index] = topk_w[index];
    }
  }
  for (int owner = 0; owner < view.layout.num_ranks; ++owner) {
    int32_t* destination = view.topk(owner, view.rank);
    for (int64_t index = static_cast<int64_t>(cta) * blockDim.x + threadIdx.x; index < num_ids;
         index += stride) {
      destination[index] = topk_idx[index];
    }
    if (cta == 0 && threadIdx.x == 0) view.token_counts(owner)[view.rank] = num_tokens;
  }
}

__device__ __forceinline__ int64_t padded_rows(int64_t count, int64_t block_m) {
  return (count + block_m - 1) / block_m * block_m;
}

// Exclusive prefix sum over the CTA; `total` gets the sum. Every thread must call it.
__device__ inline int32_t exclusive_scan_cta(int32_t value, int32_t& total) {
  __shared__ int32_t warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  int32_t inclusive = value;
#pragma unroll
  for (int delta = 1; delta < 32; delta *= 2) {
    const int32_t other = __shfl_up_sync(0xffffffffu, inclusive, delta);
    if (lane >= delta) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int32_t sum = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const int32_t other = __shfl_up_sync(0xffffffffu, sum, delta);
      if (lane >= delta) sum += other;
    }
    warp_sums[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  const int32_t warp_base = warp == 0 ? 0 : warp_sums[warp - 1];
  total = warp_sums[num_warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return warp_base + inclusive - value;
}

// The slices of the schedule: slice c of source rank r covers ids [c, c + 1) * kScheduleSlice of
// that rank's (T_r, k) ids; each warp of the grid takes slices (r, c) in turn.
struct ScheduleWarp {
  int64_t first_warp, num_warps;
  int lane;
};

__device__ inline ScheduleWarp schedule_warp(int cta, int num_ctas) {
  const int64_t warps = blockDim.x / 32;
  return {static_cast<int64_t>(cta) * warps + threadIdx.x / 32, num_ctas * warps,
          static_cast<int>(threadIdx.x % 32)};
}

// Slice `slice` (of R * slices_per_source): its source rank's ids [first_id, end) of that rank's
// (T_source, k); empty (end <= first_id) past the rank's T_source * k ids. Read by the count and
// the place passes alike.
struct ScheduleSlice {
  int source;
  int32_t first_id, end;
  const int32_t* ids;  // the source rank's (T_source, k)
};

__device__ inline ScheduleSlice schedule_slice(const WorkspaceView& view, int64_t slice) {
  const int64_t slices = view.layout.slices_per_source();
  const int source = static_cast<int>(slice / slices);
  const int32_t num_ids =
      view.token_counts(view.rank)[source] * static_cast<int32_t>(view.layout.top_k);
  const int32_t first_id = static_cast<int32_t>((slice % slices) * kScheduleSlice);
  return {source, first_id, min(first_id + static_cast<int32_t>(kScheduleSlice), num_ids),
          view.topk(view.rank, source)};
}

// A slice's ids in registers, lane l holding ids first_id + 32 s + l (-1 from `end` on), loaded
// before a pass's steps so that the loads are in flight together rather than one a step.
constexpr int kSliceSteps = static_cast<int>(kScheduleSlice / 32);

__device__ __forceinline__ void load_slice(const ScheduleSlice& slice, int lane,
                                           int32_t (&slice_ids)[kSliceSteps]) {
#pragma unroll
  for (int step = 0; step < kSliceSteps; ++step) {
    const int32_t index = slice.first_id + 32 * step + lane;
    slice_ids[step] = index < slice.end ? slice.ids[index] : -1;
  }
}

// Pass 1, every warp, once every rank's ids are in (the gather flags): each id checked (in range,
// distinct within its row), and the rows of each local expert in each of its slices into
// slice_rows. `counters`: E_l ints of shared memory per warp. No global atomics: the experts'
// counts are the scan's totals (pass 2).
__device__ inline void count_slices(const WorkspaceView& view, int cta, int num_ctas,
                                    int32_t* counters) {
  DeviceState* state = view.state();
  if (cta_sees_error(view)) return;
  if (!wait_flags_all_ranks(view, FlagKind::kGather, state->epoch, Phase::kGather)) return;
  const WorkspaceLayout& layout = view.layout;
  // Every thread reads the same counts, so all leave together.
  for (int source = 0; source < layout.num_ranks; ++source) {
    const int32_t num_tokens = view.token_counts(view.rank)[source];
    if (num_tokens < 0 || num_tokens > layout.tokens_max) {
      if (cta == 0 && threadIdx.x == 0) {
        ErrorDetail detail{Phase::kSchedule};
        detail.peer = static_cast<uint32_t>(source);
        detail.value = num_tokens;
        detail.expected = static_cast<uint32_t>(layout.tokens_max);
        raise_error(&state->error, ErrorCode::kTokenCountOutOfRange, view.rank, detail);
      }
      return;
    }
  }
  const int64_t experts = layout.experts_per_rank();
  const int64_t first_expert = view.rank * experts;
  const int32_t top_k = static_cast<int32_t>(layout.top_k);
  const ScheduleWarp me = schedule_warp(cta, num_ctas);
  int32_t* mine = counters + (threadIdx.x / 32) * experts;
  const int64_t num_slices = layout.num_ranks * layout.slices_per_source();
  for (int64_t slice = me.first_warp; slice < num_slices; slice += me.num_warps) {
    const ScheduleSlice span = schedule_slice(view, slice);
    int32_t* out = view.slice_rows() + slice * experts;
    if (span.end <= span.first_id) {
      for (int64_t expert = me.lane; expert < experts; expert += 32) out[expert] = 0;
      continue;
    }
    for (int64_t expert = me.lane; expert < experts; expert += 32) mine[expert] = 0;
    __syncwarp();
    const int32_t* ids = span.ids;
    int32_t slice_ids[kSliceSteps];
    load_slice(span, me.lane, slice_ids);
#pragma unroll
    for (int step = 0; step < kSliceSteps; ++step) {  // whole warps: the vote below
      if (span.first_id + 32 * step >= span.end) break;
      const int32_t index = span.first_id + 32 * step + me.lane;
      const int32_t expert = slice_ids[step];
      const int32_t slot = index % top_k;
      ErrorCode code = ErrorCode::kNone;
      uint32_t expected = 0;
      if (expert < -1 || expert >= layout.num_experts) {
        code = ErrorCode::kExpertOutOfRange;
        expected = static_cast<uint32_t>(layout.num_experts);
      }
      // The ids of a row are distinct (-1 may repeat): the later slot of a repeat reports it,
      // naming the earliest slot it repeats. The row's earlier ids, 1 .. slot ids back, are in
      // the lanes before this one or in the step before; only a row that began in the slice
      // before (or a top-k over 33) reads them from memory.
      bool repeated = false;
      for (int32_t back = 1; back < top_k; ++back) {
        const int src = me.lane - back;
        const int32_t here = __shfl_sync(0xffffffffu, slice_ids[step], src & 31);
        const int32_t before =
            __shfl_sync(0xffffffffu, slice_ids[step == 0 ? 0 : step - 1], src & 31);
        if (code != ErrorCode::kNone || expert < 0 || back > slot) continue;
        const int32_t earlier_id =
            src >= 0 ? here : (src >= -32 && step > 0 ? before : ids[index - back]);
        if (earlier_id == expert) {
          repeated = true;
          expected = static_cast<uint32_t>(slot - back);  // the last match is the earliest slot
        }
      }
      if (repeated) code = ErrorCode::kExpertRepeated;
      if (__any_sync(0xffffffffu, code != ErrorCode::kNone)) {
        if (code != ErrorCode::kNone) {
          ErrorDetail detail{Phase::kSchedule};
          detail.peer = static_cast<uint32_t>(span.source);
          detail.token = index / top_k;
          detail.slot = slot;
          detail.value = expert;
          detail.expected = expected;
          raise_error(&state->error, code, view.rank, detail);
        }
        return;  // the whole warp; the grid barrier after this pass sees the error
      }
      const int64_t local_expert = expert - first_expert;  // -1 slots fall outside
      if (expert >= 0 && local_expert >= 0 && local_expert < experts) {
        atomicAdd(&mine[local_expert], 1);  // integer counts: exact in any order
      }
    }
    __syncwarp();
    for (int64_t expert = me.lane; expert < experts; expert += 32) out[expert] = mine[expert];
    __syncwarp();
  }
}

// Pass 2, after a barrier: for each local expert (one warp each), the rows it has in the slices
// before each slice (an exclusive scan over the slices in global order), in place, and its count.
__device__ inline void scan_slices(const WorkspaceView& view, int cta, int num_ctas) {
  if (cta_sees_error(view)) return;
  const WorkspaceLayout& layout = view.layout;
  const int64_t experts = layout.experts_per_rank();
  const int64_t num_slices = layout.num_ranks * layout.slices_per_source();
  const ScheduleWarp me = schedule_warp(cta, num_ctas);
  constexpr int kBatch = 8;  // rounds of 32 slices whose counts are loaded together
  for (int64_t expert = me.first_warp; expert < experts; expert += me.num_warps) {
    int32_t carried = 0;
    for (int64_t first = 0; first < num_slices; first += 32 * kBatch) {
      int32_t rows[kBatch];
#pragma unroll
      for (int round = 0; round < kBatch; ++round) {
        const int64_t slice = first + 32 * round + me.lane;
        rows[round] = slice < num_slices ? view.slice_rows()[slice * experts + expert] : 0;
      }
#pragma unroll
      for (int round = 0; round < kBatch; ++round) {
        const int64_t slice = first + 32 * round + me.lane;
        int32_t inclusive = rows[round];
#pragma unroll
        for (int delta = 1; delta < 32; delta *= 2) {
          const int32_t other = __shfl_up_sync(0xffffffffu, inclusive, delta);
          if (me.lane >= delta) inclusive += other;
        }
        if (slice < num_slices) {
          view.slice_rows()[slice * experts + expert] = carried + inclusive - rows[round];
        }
        carried += __shfl_sync(0xffffffffu, inclusive, 31);
      }
    }
    if (me.lane == 0) view.counts()[expert] = carried;  // the expert's rows over every slice
  }
}

// The offsets of the local experts (each starting at a multiple of block_m) from the counts, into
// `offsets` (shared memory, E_l + 1 entries), by the whole CTA, for any number of experts.
// NOTE: each CTA derives them itself, which saves a grid barrier.
__device__ inline void expert_offsets(const WorkspaceView& view, int32_t* offsets) {
  const int64_t experts = view.layout.experts_per_rank();
  const int32_t* counts = view.counts();
  __shared__ int32_t carried;
  if (threadIdx.x == 0) carried = 0;
  __syncthreads();
  for (int64_t first = 0; first < experts; first += blockDim.x) {
    const int64_t expert = first + threadIdx.x;
    const int32_t padded =
        expert < experts ? static_cast<int32_t>(padded_rows(counts[expert], view.layout.block_m))
                         : 0;
    int32_t total = 0;
    const int32_t before = exclusive_scan_cta(padded, total);
    if (expert < experts) offsets[expert] = carried + before;
    __syncthreads();
    if (threadIdx.x == 0) carried += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[experts] = carried;
  __syncthreads();
}

// Pass 3, after a barrier, the whole CTA: the offsets (written by CTA 0), padding rows marked -1,
// and every row of a local expert at its place in global order: its slice's rows before it
// (pass 2), then, within the slice, 32 ids at a time in order. `offsets`: E_l + 1 ints of shared
// memory; `counters`: E_l per warp, as for count_slices.
__device__ inline void place_rows(const WorkspaceView& view, int cta, int num_ctas,
                                  int32_t* offsets, int32_t* counters) {
  if (cta_sees_error(view)) return;
  const WorkspaceLayout& layout = view.layout;
  const int64_t experts = layout.experts_per_rank();
  const int64_t first_expert = view.rank * experts;
  expert_offsets(view, offsets);
  int32_t* row_source = view.row_source();
  for (int64_t expert = cta; expert < experts; expert += num_ctas) {
    const int64_t end = offsets[expert + 1];
    for (int64_t row = offsets[expert] + view.counts()[expert] + threadIdx.x; row < end;
         row += blockDim.x) {
      row_source[row] = -1;
    }
  }
  if (cta == 0) {
    for (int64_t expert = threadIdx.x; expert <= experts; expert += blockDim.x) {
      view.offsets()[expert] = offsets[expert];
    }
  }
  const ScheduleWarp me = schedule_warp(cta, num_ctas);
  int32_t* placed = counters + (threadIdx.x / 32) * experts;  // rows placed so far, per expert
  const int64_t num_slices = layout.num_ranks * layout.slices_per_source();
  const int32_t top_k = static_cast<int32_t>(layout.top_k);
  for (int64_t slice = me.first_warp; slice < num_slices; slice += me.num_warps) {
    const ScheduleSlice span = schedule_slice(view, slice);
    if (span.end <= span.first_id) continue;
    const int source = span.source;
    const int32_t* before = view.slice_rows() + slice * experts;
    for (int64_t expert = me.lane; expert < experts; expert += 32) {
      placed[expert] = offsets[expert] + before[expert];
    }
    __syncwarp();
    int32_t slice_ids[kSliceSteps];
    load_slice(span, me.lane, slice_ids);
#pragma unroll
    for (int step = 0; step < kSliceSteps; ++step) {  // whole warps: the shuffles below
      if (span.first_id + 32 * step >= span.end) break;
      const int32_t index = span.first_id + 32 * step + me.lane;
      const int32_t expert = slice_ids[step];
      const int64_t local_expert = expert - first_expert;
      const bool mine = expert >= 0 && local_expert >= 0 && local_expert < experts;
      // The lanes of one expert take its next places in lane order, i.e. in id order.
      const uint32_t same =
          __match_any_sync(0xffffffffu, mine ? static_cast<int32_t>(local_expert) : -1);
      if (mine) {
        const int32_t row = placed[local_expert] + __popc(same & ((1u << me.lane) - 1u));
        row_source[row] = pack_row_source(layout, source, index / top_k, index % top_k);
        // Read by the reduce in place (a workspace with expert_y) and by the backward's dispatch
        // by token; the fused forward needs none.
        if (source == view.rank && (layout.has_expert_y() || layout.backward)) {
          view.local_row()[index] = row;
        }
      }
      __syncwarp();
      if (mine && me.lane == __ffs(same) - 1) placed[local_expert] += __popc(same);
      __syncwarp();
    }
  }
}

// Steps 2-3 on CTAs [0, num_ctas) of the grid, all resident, after begin_call (an earlier
// launch), with grid barriers between the passes; the gather flag is raised once every CTA's ids
// are copied. `topk_w`: the backward's router weights to stage beside the ids, or null.
// `scratch`: shared memory for (E_l + 1) + warps * E_l ints. The caller's own work
// before the first barrier (the fused forward stages x there) is ordered before the gather flag.
// False when an error was recorded; the caller publishes the outcome as its kernel needs.
__device__ inline bool make_schedule(const WorkspaceView& view, const int32_t* topk_idx,
                                     const float* topk_w, int32_t num_tokens, int cta, int num_ctas,
                                     int32_t* scratch) {
  DeviceState* state = view.state();
  const uint32_t epoch = state->epoch;
  // One store by one thread at the start and after each barrier: no cost the passes would see.
  const auto stamp = [&](int pass) {
    if (cta == 0 && threadIdx.x == 0) state->schedule_ns[pass] = ptx::global_timer_ns();
  };
  stamp(0);
  gather_copy(view, topk_idx, topk_w, num_tokens, cta, num_ctas);
  bool ok = grid_barrier(view, num_ctas, Phase::kSchedule);
  stamp(1);
  if (ok && cta == 0 && threadIdx.x == 0) {
    __threadfence_system();
    signal_all_ranks(view, FlagKind::kGather, epoch);
  }
  // E_l + 1 offsets, then E_l row counters per warp.
  int32_t* offsets = scratch;
  int32_t* counters = scratch + view.layout.experts_per_rank() + 1;
  if (ok) count_slices(view, cta, num_ctas, counters);  // waits for every rank's gather flag
  ok = ok && grid_barrier(view, num_ctas, Phase::kSchedule);
  stamp(2);
  if (ok) scan_slices(view, cta, num_ctas);
  ok = ok && grid_barrier(view, num_ctas, Phase::kSchedule);
  stamp(3);
  if (ok) place_rows(view, cta, num_ctas, offsets, counters);
  ok = ok && grid_barrier(view, num_ctas, Phase::kSchedule);
  stamp(4);
  return ok;
}

}  // namespace mok::comm
