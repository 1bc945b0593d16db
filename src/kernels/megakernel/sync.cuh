// Readiness between the CTAs of the fused forward: per-row-block counters in the workspace
// (comm::TaskCounter), raised with a release after the data they cover is written and awaited
// with an acquire (and a timeout into the error record) before it is read.
//
// Writers and readers use different proxies: the dispatch and the GEMM epilogues write rows with
// ordinary stores; the mainloops read them with TMA (async proxy) and the combine with ordinary
// loads. Every release below is generic; a reader that goes on with TMA fences the async proxy
// after its acquire.
#pragma once

#include <cstdint>

#include "kernels/comm/flags.cuh"
#include "kernels/comm/workspace_layout.cuh"
#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/kernel_roles.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/named_barrier.cuh"
#include "kernels/ptx/special_registers.cuh"

namespace mok::megakernel {

// One thread: everything this thread (and, through an earlier barrier, its CTA) wrote is visible
// before the counter moves.
__device__ __forceinline__ void raise_counter(const comm::WorkspaceView& view,
                                              comm::TaskCounter kind, int mblock) {
  __threadfence();
  atomicAdd(view.task_counters(kind) + mblock, 1u);
}

// Every wait of the fused kernel: one thread spins until ready() holds. False when an error is
// (or gets) recorded, or after view.timeout_ns, once record_timeout() has recorded why; the
// caller then goes on without the data (the call has failed and the host reports it).
template <class Ready, class RecordTimeout>
__device__ inline bool spin_until(const comm::WorkspaceView& view, const Ready& ready,
                                  const RecordTimeout& record_timeout) {
  const comm::ErrorRecord* error = &view.state()->error;
  const uint64_t start_ns = ptx::global_timer_ns();
  for (uint32_t spin = 0; !ready(); ++spin) {
    if ((spin & 63u) == 63u) {
      if (comm::has_error(error)) return false;
      if (ptx::global_timer_ns() - start_ns > view.timeout_ns) {
        record_timeout();
        return false;
      }
    }
    __nanosleep(64);
  }
  return true;
}

// One thread waits until the counter reaches `target`.
__device__ inline bool wait_counter(const comm::WorkspaceView& view, comm::TaskCounter kind,
                                    int mblock, uint32_t target, comm::Phase phase) {
  const uint32_t* counter = view.task_counters(kind) + mblock;
  uint32_t seen = 0;
  return spin_until(
      view, [&] { return (seen = ptx::load_acquire_gpu(counter)) >= target; },
      [&] {
        comm::ErrorDetail detail{phase};
        detail.token = mblock;
        detail.value = static_cast<int32_t>(seen);
        detail.expected = target;
        detail.flag_kind = static_cast<uint32_t>(kind);
        comm::raise_error(&view.state()->error, comm::ErrorCode::kTaskTimeout,
                          static_cast<uint32_t>(view.rank), detail);
      });
}

// The 256 threads of the two consumer warpgroups.
__device__ __forceinline__ void consumer_barrier() {
  ptx::named_barrier_sync<static_cast<uint32_t>(gemm::NamedBarrier::kConsumers),
                          gemm::TileConfig::kNumConsumerWarpgroups * gemm::kWarpgroupThreads>();
}

}  // namespace mok::megakernel
