// Cross-GPU readiness: system-scope release/acquire flags that hold a per-call epoch, waits that
// time out into the error record, and the "last CTA out signals" pattern that turns the stores of
// a whole grid into one flag per peer; and the barrier across one kernel's CTAs.
//
// Every flag lives in the window of the rank that waits on it and is written by the rank that
// signals, so polling stays in local memory and only the one signalling store crosses NVLink.
// Flags are never reset: a wait succeeds once the flag has reached the epoch (compared modulo
// 2^32), so the same flags serve every call and every replay of a captured graph.
#pragma once

#include <cstdint>

#include "kernels/comm/error_record.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/special_registers.cuh"

namespace mok::comm {

__device__ __forceinline__ bool epoch_reached(uint32_t seen, uint32_t target) {
  return static_cast<int32_t>(seen - target) >= 0;
}

// The CTA agrees on whether an earlier fault was recorded (one read, broadcast), so that every
// thread takes the same path through the barriers that follow.
__device__ inline bool cta_sees_error(const WorkspaceView& view) {
  __shared__ int seen;
  if (threadIdx.x == 0) seen = has_error(&view.state()->error) ? 1 : 0;
  __syncthreads();
  const bool result = seen != 0;
  __syncthreads();
  return result;
}

// One thread waits until `source`'s flag of `kind` in this rank's window reaches `target`.
// Returns false, after recording a timeout (or seeing an earlier error), when it never does.
__device__ inline bool wait_flag(const WorkspaceView& view, FlagKind kind, int source,
                                 uint32_t target, Phase phase) {
  const uint32_t* flag = view.flag(view.rank, kind, source);
  ErrorRecord* error = &view.state()->error;
  const uint64_t start_ns = ptx::global_timer_ns();
  for (uint32_t spin = 0;; ++spin) {
    const uint32_t seen = ptx::load_acquire_system(flag);
    if (epoch_reached(seen, target)) return true;
    if ((spin & 63u) == 63u) {
      if (has_error(error)) return false;
      if (ptx::global_timer_ns() - start_ns > view.timeout_ns) {
        ErrorDetail detail{phase};
        detail.peer = static_cast<uint32_t>(source);
        detail.value = static_cast<int32_t>(seen);
        detail.expected = target;
        detail.flag_kind = static_cast<uint32_t>(kind);
        raise_error(error, ErrorCode::kTimeout, static_cast<uint32_t>(view.rank), detail);
        return false;
      }
    }
    __nanosleep(32);
  }
}

// The whole CTA waits for `kind` flags of every rank; true when all arrived.
__device__ inline bool wait_flags_all_ranks(const WorkspaceView& view, FlagKind kind,
                                            uint32_t target, Phase phase) {
  __shared__ int all_arrived;
  if (threadIdx.x == 0) {
    bool arrived = true;
    for (int source = 0; source < view.layout.num_ranks && arrived; ++source) {
      arrived = wait_flag(view, kind, source, target, phase);
    }
    all_arrived = arrived ? 1 : 0;
  }
  __syncthreads();
  return all_arrived != 0;
}

// One thread sets this rank's `kind` flag to `value` in every rank's window (its own included),
// after everything this thread has observed so far.
__device__ inline void signal_all_ranks(const WorkspaceView& view, FlagKind kind, uint32_t value) {
  __threadfence_system();
  for (int owner = 0; owner < view.layout.num_ranks; ++owner) {
    ptx::store_release_system(view.flag(owner, kind, view.rank), value);
  }
}

// The whole CTA: a barrier across the first `num_ctas` CTAs of the grid, which must all be
// resident (the schedule's passes run so, in one kernel). The last to arrive resets the count and
// bumps the generation the others wait on. False, for every thread, when an error was recorded or
// the wait timed out (recorded as a task timeout in `phase`: a CTA of the grid never arrived, e.g.
// other kernels held the SMs it needed).
__device__ inline bool grid_barrier(const WorkspaceView& view, int num_ctas, Phase phase) {
  DeviceState* state = view.state();
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t generation = ptx::load_acquire_gpu(&state->barrier_generation);
    __threadfence();
    bool ok = true;
    if (atomicAdd(&state->barrier_count, 1u) == static_cast<uint32_t>(num_ctas) - 1) {
      state->barrier_count = 0;
      __threadfence();
      atomicAdd(&state->barrier_generation, 1u);
    } else {
      ErrorRecord* error = &state->error;
      const uint64_t start_ns = ptx::global_timer_ns();
      for (uint32_t spin = 0; ptx::load_acquire_gpu(&state->barrier_generation) == generation;
           ++spin) {
        if ((spin & 63u) == 63u) {
          if (has_error(error)) {
            ok = false;
            break;
          }
          if (ptx::global_timer_ns() - start_ns > view.timeout_ns) {
            ErrorDetail detail{phase};
            detail.value = static_cast<int32_t>(state->barrier_count);
            detail.expected = static_cast<uint32_t>(num_ctas);
            raise_error(error, ErrorCode::kTaskTimeout, static_cast<uint32_t>(view.rank), detail);
            ok = false;
            break;
          }
        }
        __nanosleep(64);
      }
    }
    __threadfence();
    passed = ok ? 1 : 0;
  }
  __syncthreads();
  const bool result = passed != 0;
  __syncthreads();
  return result;
}

// Called by every thread of every CTA once its stores are issued. True in thread 0 of the CTA that
// arrives last; at that point the stores of every CTA are ordered before that thread's next store.
// `arrivals` is zeroed by the first kernel of each call.
__device__ inline bool last_block_arrived(uint32_t* arrivals) {
  __threadfence_system();  // this thread's stores (peer stores too) before the arrival count
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) {
    const uint32_t previous = atomicAdd(arrivals, 1u);
    is_last = (previous == gridDim.x - 1) ? 1 : 0;
    if (is_last) __threadfence_system();
  }
  __syncthreads();
  return threadIdx.x == 0 && is_last != 0;
}

}  // namespace mok::comm
