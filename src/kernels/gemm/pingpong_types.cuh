// The ping-pong engine's tile and shared-memory layout. Each consumer warpgroup owns a whole
// (BLOCK_M, BLOCK_N) tile with 128 fp32 accumulators per thread; the two consumers take the CTA's
// tiles in turn and their mainloops alternate, so one warpgroup's epilogue runs beside the
// other's MMAs. The cooperative engine (gemm_types.cuh) shares one (128, 256) tile between them
// instead and stalls the tensor cores through every epilogue. The launchers use (128, 128);
// (64, 256) compiles too but measured 0.65-0.90x the cooperative kernel (one accumulator chain,
// 3 stages), and (128, 128) itself ~0.9x outside short-K forward GEMMs: docs/perf-notes/gemm.md.
//
// Per output element the K-sum is the cooperative engine's: the same k-blocks of 64 in natural
// order, the same wgmma k16 steps; only the N width of one wgmma may differ (128 or 256).
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/gemm/kernel_roles.cuh"

namespace mok::gemm {

// One consumer warpgroup owns the tile: BLOCK_M / 64 wgmma rows, BLOCK_N such that each thread
// holds 128 accumulators.
template <int kBlockM>
struct PingpongConfig : TileShape<kBlockM, 128 * 128 / kBlockM> {
  static_assert(kBlockM == 64 || kBlockM == 128, "one or two wgmma row blocks of 64");
  using Shape = TileShape<kBlockM, 128 * 128 / kBlockM>;
  static constexpr uint32_t kRowBlockBytes = 64 * Shape::BLOCK_K * 2;  // 64 rows of A (one panel)
  static_assert(kRowBlockBytes == Shape::kPanelBytes, "an MN-major A panel is one wgmma row block");
};

// Named barriers of the ping-pong kernel (kernel_roles.cuh): NamedBarrier::kMainloopTurn0 + c is
// "consumer c may start its mainloop", arrived at by the other consumer when its mainloop is done.
static_assert(static_cast<uint32_t>(NamedBarrier::kMainloopTurn1) ==
                  static_cast<uint32_t>(NamedBarrier::kMainloopTurn0) + 1,
              "one mainloop-turn barrier per consumer, consecutive");

// Dynamic shared memory: the stage ring, one bf16 staging tile per consumer, the barriers. The
// same struct sizes the launch on the host and finds the buffers on the device.
template <EpilogueKind kEpilogue, int kBlockM>
struct PingpongSharedLayout {
  using Config = PingpongConfig<kBlockM>;
  static constexpr bool kStagedStore = uses_staged_store(kEpilogue);
  static constexpr uint32_t kAlignment = 1024;
  // bf16 outputs: 16 staging rows per warp (warp_rows.cuh).
  static constexpr uint32_t kStagingBytesPerConsumer = kStagedStore ? 4 * kWarpStagingBytes : 0;
  // As many stages as fit beside the staging tiles, barriers and alignment slack (at most 6).
  static constexpr uint32_t kSpareBytes =
      227 * 1024 - kAlignment - 256 - Config::kNumConsumerWarpgroups * kStagingBytesPerConsumer;
  static constexpr int kFittingStages = static_cast<int>(kSpareBytes / Config::kStageBytes);
  static constexpr int kNumStages = kFittingStages < 6 ? kFittingStages : 6;
  static constexpr int kClusterSize = 1;
  static constexpr int kNumTailBarriers = 1;
  static constexpr uint32_t kAOffset = 0;  // (kNumStages, BLOCK_M, BLOCK_K)
  static constexpr uint32_t kBOffset = kNumStages * Config::kABytes;
  // (kNumConsumerWarpgroups, 4 warps, kWarpStagingBytes)
  static constexpr uint32_t kStagingOffset = kBOffset + kNumStages * Config::kBBytes;
  static constexpr uint32_t kBarrierOffset =
      kStagingOffset + Config::kNumConsumerWarpgroups * kStagingBytesPerConsumer;
  // full[kNumStages], empty[kNumStages], tail (the wgrad row-tail staging barrier)
  static constexpr uint32_t kNumBarriers = 2 * kNumStages + 1;
  static constexpr uint32_t kBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr uint32_t kLaunchBytes = kBytes + kAlignment;  // slack to align the base
  static_assert(kLaunchBytes <= 227 * 1024, "shared memory layout exceeds the 227 KiB limit");
};

}  // namespace mok::gemm
