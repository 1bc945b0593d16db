// mbarrier, proxy fences and register reallocation: the synchronisation vocabulary of the
// warp-specialised kernels. Each wrapper is one PTX instruction (or a spin around one).
#pragma once

#include <cstdint>

namespace mok::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrival_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(barrier)),
               "r"(arrival_count)
               : "memory");
}

// NOTE: makes the initialised barriers visible to the async proxy (TMA completes on them).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
}

// mbarrier_arrive when `arrive`: one predicated instruction, no branch (a warpgroup's wgmma may
// stay in flight across it).
__device__ __forceinline__ void mbarrier_arrive_if(bool arrive, uint64_t* barrier) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %1, 0;\n\t"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n\t}" ::"r"(smem_address(barrier)),
      "r"(static_cast<uint32_t>(arrive))
      : "memory");
}

// Arrives once on the barrier at the same shared-memory offset in CTA `cta` of this thread's
// cluster (this CTA's own included), with the default (release, CTA scope) semantics: a consumer
// whose wgmma reads of a stage have completed hands it back to every producer whose TMA
// multicast writes into it.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* barrier, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(cta)
      : "memory");
}

// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster: none passes until all have arrived (and their prior
// memory accesses are visible cluster-wide). Called by whole warps.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// Arrives once and announces `bytes` of asynchronous transactions that must land before the
// phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
      "selp.u32 %0, 1, 0, ready;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_address(barrier)), "r"(parity)
      : "memory");
  return done != 0;
}

// Polls until the phase with the given parity has completed. A wait that never ends is a bug in
// the pipeline (a lost arrival): after ~2^30 polls (seconds) timed_out() traps, so the host sees a
// launch failure instead of a hang.
template <class TimedOut>
__device__ __forceinline__ void mbarrier_poll(uint64_t* barrier, uint32_t parity,
                                              const TimedOut& timed_out) {
  uint32_t polls = 0;
  while (!mbarrier_try_wait(barrier, parity)) {
    if (++polls == (1u << 30)) timed_out();
  }
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  mbarrier_poll(barrier, parity, [] { __trap(); });
}

// The trap of mbarrier_wait_trap_out_of_line's timeout.
inline __device__ __noinline__ void mbarrier_wait_timed_out() { __trap(); }

// mbarrier_wait with its trap out of line. NOTE: with the trap inline, ptxas held warp-specialised
// consumer warpgroups to the launch bound's registers instead of their setmaxnreg budget, and the
// FP8 GEMM's accumulators spilled (docs/perf-notes/fp8.md); its waits use this one.
__device__ __forceinline__ void mbarrier_wait_trap_out_of_line(uint64_t* barrier, uint32_t parity) {
  mbarrier_poll(barrier, parity, mbarrier_wait_timed_out);
}

// NOTE: generic-proxy writes to shared memory (st.shared) that TMA or wgmma read next need this
// fence in the writing thread before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Register reallocation between warpgroups (sm_90a); only honoured when the kernel has a register
// cap at entry (__launch_bounds__(threads, 1)).
template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace mok::ptx
