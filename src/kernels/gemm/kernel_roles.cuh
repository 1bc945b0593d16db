// The warp-specialised kernels' shared vocabulary (the grouped GEMM kernels and the fused
// megakernel): which warpgroup does what, the named barriers they sync on, and the register split
// between producer and consumers, checked against the SM's register file at compile time.
#pragma once

#include <cstdint>

namespace mok::gemm {

inline constexpr int kWarpgroupThreads = 128;

// Warpgroup 0 produces (TMA loads; in the megakernel also task decoding and dispatch), the others
// consume (wgmma and the epilogue).
enum class WarpgroupRole { kProducer, kConsumer };

#if defined(__CUDACC__)
__device__ __forceinline__ int warpgroup_index() {
  return static_cast<int>(threadIdx.x / static_cast<uint32_t>(kWarpgroupThreads));
}
__device__ __forceinline__ WarpgroupRole warpgroup_role() {
  return threadIdx.x < static_cast<uint32_t>(kWarpgroupThreads) ? WarpgroupRole::kProducer
                                                                : WarpgroupRole::kConsumer;
}
// The first thread of the first consumer warpgroup: the one that publishes for the consumers.
__device__ __forceinline__ bool is_consumer_leader() {
  return static_cast<int>(threadIdx.x) == kWarpgroupThreads;
}
#endif

// bar.sync ids (0 is __syncthreads'). One table for every kernel, so no two uses collide.
enum class NamedBarrier : uint32_t {
  kConsumers = 1,      // megakernel: both consumer warpgroups, after a tile's stores
  kMainloopTurn0 = 2,  // ping-pong: consumer 0 may start its mainloop (the other one hands over)
  kMainloopTurn1 = 3,  // ping-pong: consumer 1 may start its mainloop
};

// setmaxnreg budgets: every thread of the CTA holds its warpgroup's registers at once, and the SM
// has 64 K of them (one CTA per SM).
constexpr bool register_split_fits(uint32_t producer_registers, uint32_t consumer_registers,
                                   int num_consumer_warpgroups) {
  return (producer_registers + num_consumer_warpgroups * consumer_registers) * kWarpgroupThreads <=
         64 * 1024;
}

}  // namespace mok::gemm
