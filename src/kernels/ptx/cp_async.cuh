// Per-thread asynchronous copies (cp.async, sm_80+): 16 bytes global -> shared without a register
// stop, their completion reported to an mbarrier. For what TMA cannot describe, such as rows
// gathered from anywhere: one warp instruction moves 512 bytes, where TMA needs one instruction
// per box.
#pragma once

#include <cstdint>

#include "kernels/ptx/barrier.cuh"

namespace mok::ptx {

// 16 bytes, both addresses 16-byte aligned; cached in L2 only, which fetches the 256-byte line
// pair around it (the next 128 bytes of a row are the next k-block). Only the first source_bytes
// (0 or 16) are read, the rest of the 16 are zero-filled.
__device__ __forceinline__ void cp_async_16(void* shared_destination, const void* global_source,
                                            uint32_t source_bytes = 16) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(
                   smem_address(shared_destination)),
               "l"(global_source), "r"(source_bytes)
               : "memory");
}

// The barrier's current phase also waits for every cp.async this thread issued so far: its
// pending count goes up by one now and back down when those copies have landed (no net arrival,
// so the barrier's expected count does not change).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_address(barrier))
               : "memory");
}

}  // namespace mok::ptx
