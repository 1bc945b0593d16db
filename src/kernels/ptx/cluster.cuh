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

// Stores `value` at the same shared-memory offset as `local` in CTA `cta_rank` of this cluster.
__device__ __forceinline__ void store_shared_cluster(int* local, uint32_t cta_rank, int value) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.u32 [remote], %2;\n"
      "}\n" ::"r"(smem_address(local)),
      "r"(cta_rank), "r"(value)
      : "memory");
}

// Arrives on the peer's mbarrier with a cluster-scope release: what this thread stored into the
// peer's shared memory before it is visible to the peer's threads that wait on the barrier with
// mbarrier_wait_cluster.
__device__ __forceinline__ void mbarrier_arrive_release_cluster(uint64_t* barrier,
                                                                uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(cta_rank)
      : "memory");
}

// mbarrier_wait with a cluster-scope acquire (the arrivals came from another CTA of the cluster).
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* barrier, uint32_t parity) {
  uint32_t polls = 0;
  for (;;) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_address(barrier)), "r"(parity)
        : "memory");
    if (done != 0) return;
    if (++polls == (1u << 30)) __trap();
  }
}

}  // namespace mok::ptx
