// Optional per-CTA timeline of the fused forward (FusedForwardParams::trace, null = off): where a
// CTA's time goes, for the perf notes. Globaltimer nanoseconds; one record of kTraceFields per CTA,
// each field written by one thread. Off, it costs one uniform branch per event.
#pragma once

#include <cstdint>

#include "kernels/ptx/special_registers.cuh"

namespace mok::megakernel {

enum TraceField : int {
  kTraceStart = 0,    // kernel entry (thread 0)
  kTraceScheduled,    // schedule done (thread 0)
  kTraceDispatched,   // this CTA's dispatch share done (its last dispatching warp)
  kTraceTasksEnd,     // the producer found no task left
  kTraceEnd,          // the consumers' last stores landed
  kTraceTasks,        // tasks this CTA ran
  kTraceInputWaitNs,  // producer: waiting for tasks' inputs (rows, gate/up tiles, schedule)
  kTraceSlotWaitNs,   // producer: waiting for the consumers to free a task slot
  kTracePublishNs,    // consumers: waiting for gate/up stores to land before publishing
  // kTraceInputWaitNs split by what was awaited: the schedule, then the inputs of each task kind
  // (TaskKind order: shared gate/up none, routed gate/up its rows and ring slot, shared down its
  // shared hidden rows, routed down its hidden rows)
  kTraceWaitScheduleNs,
  kTraceWaitKindNs,  // + TaskKind, four fields
  kTraceFields = kTraceWaitKindNs + 4
};

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint64_t trace_clock() { return ptx::global_timer_ns(); }

__device__ __forceinline__ void trace_set(uint64_t* trace, TraceField field, uint64_t value) {
  if (trace != nullptr) trace[blockIdx.x * kTraceFields + field] = value;
}

// The hook the task loops time their waits with: a span's start is 0 and its length 0 when the
// trace is off (one uniform branch each), so the loops read the same either way.
struct TraceSpans {
  bool on;
  __device__ __forceinline__ uint64_t begin() const { return on ? trace_clock() : 0; }
  __device__ __forceinline__ uint32_t since(uint64_t start) const {
    return on ? static_cast<uint32_t>(trace_clock() - start) : 0u;
  }
};
#endif

}  // namespace mok::megakernel
