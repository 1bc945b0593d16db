// TMA loads: global -> shared tiles described by a CUtensorMap, completing on an mbarrier as
// transaction bytes; out-of-bounds parts of a box are filled with zeros and still count as
// transaction bytes. (The GEMM epilogues store with warp-wide stores: warp_rows.cuh.)
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

}  // namespace mok::ptx
