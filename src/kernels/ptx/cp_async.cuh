// Non-bulk asynchronous copies (cp.async, sm_80+) global -> shared whose completion an mbarrier
// tracks: how the FP8 GEMM's producer stages each k-block's scales beside the TMA tiles without
// waiting for them itself; and the transposed quantizer's tile loads (cp_async_wait_all).
#pragma once

#include <cstdint>

#include "kernels/ptx/barrier.cuh"

namespace mok::ptx {

// 4 bytes from `source` to `destination`, or 4 zero bytes without reading `source` when `valid`
// is false (src-size 0). Both 4-byte aligned.
__device__ __forceinline__ void cp_async_4(void* destination, const void* source, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_address(destination)),
               "l"(reinterpret_cast<uint64_t>(source)), "r"(valid ? 4 : 0)
               : "memory");
}

// 16 bytes from `source` to `destination`, through L2 only (.cg: a streaming read). Both 16-byte
// aligned.
__device__ __forceinline__ void cp_async_16(void* destination, const void* source) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(destination)),
               "l"(reinterpret_cast<uint64_t>(source))
               : "memory");
}

// Arrives on `barrier` once every cp.async this thread issued before has landed. noinc: the
// arrival counts against the barrier's expected count (mbarrier_init must include it).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(barrier))
               : "memory");
}

// Until every cp.async this thread issued has landed (before a thread with copies in flight exits).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

}  // namespace mok::ptx
