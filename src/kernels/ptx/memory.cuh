// Ordered global memory accesses: release stores and acquire loads at GPU or system scope (the
// readiness counters of one GPU, the flags between GPUs), L2-only loads, and the fence between
// the async proxy (TMA, bulk copies) and generic accesses to global memory.
#pragma once

#include <cstdint>

namespace mok::ptx {

__device__ __forceinline__ uint32_t load_acquire_gpu(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_gpu(uint32_t* address, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void store_release_system(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

// A load cached in L2 only (never in this SM's L1).
__device__ __forceinline__ uint64_t load_l2_only(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// NOTE: bulk (TMA) copies write through the async proxy; a generic-proxy release that must cover
// them needs this fence after their completion (and TMA loads that must see generic writes need
// it before they are issued).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace mok::ptx
