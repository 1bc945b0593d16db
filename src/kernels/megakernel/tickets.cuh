// The fused forward's task tickets (task_list.cuh), handed out so that the CTAs near one L2
// partition take runs of consecutive tasks together.
//
// H100/H200 split L2 into two partitions; an SM reads through the one it is attached to, and a
// line that partition does not hold crosses the fabric between them. Consecutive tasks of the list
// share their weight tile (one expert's column block, row blocks inner), so when the CTAs that run
// them sit on one side, the tile crosses at most once instead of once per side. (ncu at deepseek-v3
// EP1 named the fabric the most loaded unit of L2; docs/perf-notes/layer.md.)
//
// Each partition draws grants of kTicketGrant consecutive tickets from the call's counter
// (next_task) and its CTAs take the grant's tickets in order. Every CTA's tickets still increase,
// and a partition claims a new grant only once its current one is handed out, so the argument of
// task_list.cuh holds: the earliest unfinished task has been taken, or is the next of its
// partition's grant, whose CTAs all hold earlier (runnable) tasks.
#pragma once

#include <cstdint>

#include "kernels/comm/workspace_layout.cuh"
#include "kernels/ptx/special_registers.cuh"

namespace mok::megakernel {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The L2 partition this CTA's SM reads through: sm_partition (indexed by %smid, kMaxSmIds
// entries) from the probe of runtime/l2_partitions.hpp, or 0 without one.
__device__ inline int cta_l2_partition(const uint8_t* sm_partition, int max_sm_ids) {
  if (sm_partition == nullptr) return 0;
  const uint32_t id = ptx::sm_id();
  const int partition = id < static_cast<uint32_t>(max_sm_ids) ? sm_partition[id] : 0;
  return partition < comm::kMaxL2Partitions ? partition : 0;
}

// One thread: the next ticket of this CTA's partition.
__device__ inline int take_ticket(comm::DeviceState* state, int partition) {
  unsigned long long* pool = &state->task_pool[partition];
  for (;;) {
    const unsigned long long seen = atomicAdd(pool, 1ull);
    const uint32_t grant = static_cast<uint32_t>(seen >> 32);  // first ticket + 1, 0 for none
    const uint32_t taken = static_cast<uint32_t>(seen);
    if (taken < comm::kTicketGrant) return static_cast<int>(grant - 1 + taken);
    if (taken == comm::kTicketGrant) {
      // This thread emptied the grant: it claims the next one and takes its first ticket.
      const uint32_t first = atomicAdd(&state->next_task, comm::kTicketGrant);
      atomicExch(pool, (static_cast<unsigned long long>(first + 1) << 32) | 1ull);
      return static_cast<int>(first);
    }
    // Another thread is claiming the next grant: wait for it, then take again.
    while (static_cast<uint32_t>(*reinterpret_cast<volatile unsigned long long*>(pool) >> 32) ==
           grant) {
      __nanosleep(32);
    }
  }
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mok::megakernel
