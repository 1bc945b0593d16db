// Named CTA barriers (bar.sync / bar.arrive): hand-offs between warpgroups that the stage
// mbarriers do not cover. Barrier 0 belongs to __syncthreads; callers number theirs from 1.
#pragma once

#include <cstdint>

namespace mok::ptx {

// Waits until `num_threads` threads (a multiple of 32, this warp's included) have arrived.
__device__ __forceinline__ void named_barrier_sync(uint32_t barrier_id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(num_threads) : "memory");
}

// The same with the id and the count as immediates (no registers held for them).
template <uint32_t kBarrierId, uint32_t kNumThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kBarrierId), "n"(kNumThreads) : "memory");
}

// Counts this warp towards the barrier without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t barrier_id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(barrier_id), "r"(num_threads) : "memory");
}

}  // namespace mok::ptx
