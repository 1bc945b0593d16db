// TMA: global -> shared tile loads described by a CUtensorMap, completing on an mbarrier as
// transaction bytes (out-of-bounds parts of a box are filled with zeros and still count as
// transaction bytes), and shared -> global tile stores tracked by the issuing thread's bulk
// async-groups (out-of-bounds parts of a box are not written). The GEMM epilogues store with
// warp-wide stores (warp_rows.cuh), wgrad's bf16 output with tile stores (warp_boxes.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/ptx/barrier.cuh"

namespace mok::ptx {

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
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

// tma_load_2d into the same shared-memory offset of every CTA of the cluster in `cta_mask` (bit r:
// rank r), completing on the barrier at `barrier`'s offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* destination,
                                                      const CUtensorMap* tensor_map,
                                                      uint64_t* barrier, int32_t inner,
                                                      int32_t outer, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(inner),
      "r"(outer), "h"(cta_mask)
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

// tma_load_3d into the same shared-memory offset of every CTA of the cluster in `cta_mask`,
// completing on the barrier at `barrier`'s offset in each of them (as tma_load_2d_multicast).
__device__ __forceinline__ void tma_load_3d_multicast(void* destination,
                                                      const CUtensorMap* tensor_map,
                                                      uint64_t* barrier, int32_t inner,
                                                      int32_t middle, int32_t outer,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(inner),
      "r"(middle), "r"(outer), "h"(cta_mask)
      : "memory");
}

// Shared -> global when `issue`: the box at (inner, middle, outer) element coordinates, from
// `source` (laid out as the map's box, with its swizzle), then commits this thread's bulk
// async-group. The writes of the generic proxy to `source` must be fenced
// (fence_proxy_async_shared) before. One predicated sequence, no branch, so that a warpgroup's
// wgmma may stay in flight across it (ptxas waits for them before a divergent one).
__device__ __forceinline__ void tma_store_3d_commit_if(bool issue, const CUtensorMap* tensor_map,
                                                       const void* source, int32_t inner,
                                                       int32_t middle, int32_t outer) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
      "@p cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n\t"
      "@p cp.async.bulk.commit_group;\n\t}" ::"l"(reinterpret_cast<uint64_t>(tensor_map)),
      "r"(smem_address(source)), "r"(inner), "r"(middle), "r"(outer),
      "r"(static_cast<uint32_t>(issue))
      : "memory");
}

// Until at most kPending of this thread's bulk groups still read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until at most kPending of this thread's bulk groups are incomplete (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace mok::ptx
