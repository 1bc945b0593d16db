// Thread-block clusters (sm_90): a CTA's rank in its cluster, the cluster-wide barrier, and
// arrivals on a peer CTA's mbarrier through distributed shared memory.
#pragma once

#include <cstdint>

#include "kernels/ptx/barrier.cuh"

namespace mok::ptx {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster: the shared-memory writes (and mbarrier inits) before
// it are visible to the whole cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrives once on the mbarrier at the same shared-memory offset as `barrier` in CTA `cta_rank`
// of this cluster (this CTA's own included), with the default (CTA-scope) release: what it
// publishes is that this thread's wgmma reads of a stage have completed, which needs no
// cluster-wide fence (a .release.cluster arrive made the pairs' mainloop 28 % slower).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* barrier, uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(cta_rank)
      : "memory");
}

}  // namespace mok::ptx
