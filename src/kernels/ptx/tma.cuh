// Bulk copies. Loads: global -> shared tiles described by a CUtensorMap (TMA), completing on an
// mbarrier as transaction bytes; out-of-bounds parts of a box are filled with zeros and still
// count as transaction bytes. Stores: plain shared -> global bulk copies of contiguous rows,
// tracked by per-thread bulk async-groups.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/ptx/barrier.cuh"

namespace mok::ptx {

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tensor_map))
               : "memory");
}

// Box at (inner, outer) element coordinates.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* tensor_map,
                                            uint64_t* barrier, int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(inner),
      "r"(outer)
      : "memory");
}

// Box at (inner, middle, outer) element coordinates.
__device__ __forceinline__ void tma_load_3d(void* destination, const CUtensorMap* tensor_map,
                                            uint64_t* barrier, int32_t inner, int32_t middle,
                                            int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(inner),
      "r"(middle), "r"(outer)
      : "memory");
}

// Shared -> global bulk copy of `bytes` contiguous bytes (a multiple of 16, both addresses
// 16-byte aligned), tracked by this thread's bulk async-groups.
__device__ __forceinline__ void bulk_store(void* global_destination, const void* source,
                                           uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<uint64_t>(global_destination)),
               "r"(smem_address(source)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most kPending of this thread's bulk groups still read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's bulk groups are incomplete (writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace mok::ptx
