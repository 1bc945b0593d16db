// kAuto's engine for a grouped GEMM (mok::gemm::GemmEngine), as measured: one host function for
// the launchers (gemm.cu) and the host tests (tests/cpu/test_gemm_engine.cpp), which pin each
// measured case to the engine it won on. Both engines give the same bits; only the speed differs.
#pragma once

#include "kernels/gemm/gemm_kind.hpp"

namespace mok::gemm {

// The ping-pong tile's BLOCK_M, where the ping-pong engine runs a case.
constexpr int kPingpongBlockM = 128;

// kAuto's choice: kPingpongBlockM, or 0 for the cooperative engine. reduction_length: the GEMM's K;
// rows_per_group: the output rows a group gets on average (LaunchOptions::group_rows; for the
// dgrad, capacity_rows / num_experts when not given), or -1: unknown.
//
// The rule (docs/perf-notes/gemm.md, the ping-pong engine): the ping-pong mainloop runs below the
// cooperative one's rate per clock, so everything is cooperative but what ping-pong wins back.
constexpr int auto_pingpong_block_m(GemmKind kind, EpilogueKind epilogue, int reduction_length,
                                    int rows_per_group) {
  // Plain bf16 forward GEMMs with short K: ping-pong measured ahead on qwen3-30b down (K = 768)
  // and qwen3-235b down (K = 1536); at K = 2048 the two trade places between runs
  // (docs/perf-notes/gemm.md).
  constexpr int kPingpongMaxK = 1536;
  if (kind == GemmKind::kForward && epilogue == EpilogueKind::kStoreBf16 &&
      reduction_length <= kPingpongMaxK) {
    return kPingpongBlockM;
  }
  // Longer K, where the caller gives the rows (the backward's recompute of the gate/up
  // pre-activations): ping-pong over short experts, cooperative over long ones. Measured on one
  // H100 (docs/perf-notes/backward.md): ping-pong ahead at 256 and 512 rows an expert
  // (deepseek-v3, qwen3-235b-a22b), cooperative at 1024 and 2048 (qwen3-30b-a3b, mixtral-8x7b).
  // Short experts' M tiles share each weight panel; a CTA's two ping-pong consumers read it in
  // step, separate cooperative CTAs drift apart and read it from DRAM again (Nsight Compute, same
  // notes).
  constexpr int kForwardCooperativeMinRows = 1024;
  if (kind == GemmKind::kForward && epilogue == EpilogueKind::kStoreBf16 && rows_per_group > 0 &&
      rows_per_group < kForwardCooperativeMinRows) {
    return kPingpongBlockM;
  }
  // fp32 row outputs leave by synchronous register stores that stall a cooperative tile's MMAs;
  // the ping-pong tiles overlap them (docs/perf-notes/backward.md). For the dgrad that now holds
  // only at long K over short experts: cooperative measured ahead at K <= 4096 (the down dgrad at
  // qwen3-30b-a3b, qwen3-235b-a22b and mixtral-8x7b) and at K = 7168 over 8192 rows (deepseek-v3's
  // shared expert), far behind at K = 7168 over ~256 rows an expert (deepseek-v3's routed one).
  // The forward's fp32 outputs (the unfused shared down) keep ping-pong, not measured since. The
  // bf16 dgrad stays cooperative at every measured size.
  constexpr int kDgradFp32CooperativeMaxK = 4096, kDgradFp32CooperativeMinRows = 512;
  if (epilogue == EpilogueKind::kStoreFp32) {
    if (kind == GemmKind::kForward) return kPingpongBlockM;
    if (kind == GemmKind::kDgrad && reduction_length > kDgradFp32CooperativeMaxK &&
        rows_per_group < kDgradFp32CooperativeMinRows) {
      return kPingpongBlockM;
    }
  }
  return 0;
}

}  // namespace mok::gemm
