// Special registers: which SM a thread runs on, and the GPU's global nanosecond timer.
#pragma once

#include <cstdint>

namespace mok::ptx {

__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t nanoseconds;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(nanoseconds));
  return nanoseconds;
}

}  // namespace mok::ptx
