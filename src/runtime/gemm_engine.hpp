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
// The rule of runs 5 and 6 (docs/perf-notes/gemm.md): the ping-pong mainloop runs at ~92 % of the
// cooperative one's rate per clock, so everything is cooperative but what ping-pong wins back.
constexpr int auto_pingpong_block_m(GemmKind kind, EpilogueKind epilogue, int reduction_length,
                                    int rows_per_group) {
  // Plain bf16 forward GEMMs with short K: ping-pong measured ahead on qwen3-30b down (K = 768)
  // and qwen3-235b down (K = 1536) in the runs of a0aa876 and 7574ade; at K = 2048 the two trade
  // places between runs (perf-notes/gemm.md v12).
  constexpr int kPingpongMaxK = 1536;
  if (kind == GemmKind::kForward && epilogue == EpilogueKind::kStoreBf16 &&
      reduction_length <= kPingpongMaxK) {
    return kPingpongBlockM;
  }
  // Longer K, where the caller gives the rows (the backward's recompute of the gate/up
  // pre-activations): ping-pong over short experts, cooperative over long ones. Measured
  // (backward.md v30, one H100): ping-pong ahead at 256 and 512 rows an expert (deepseek-v3 8.60
  // against 15.85 ms, qwen3-235b-a22b 3.32 against 5.11), cooperative at 1024 and 2048
  // (qwen3-30b-a3b 1.59 against 1.67, mixtral-8x7b 6.01 against 8.12). Short experts' M tiles
  // share each weight panel; a CTA's two ping-pong consumers read it in step, separate
  // cooperative CTAs drift apart and read it from DRAM again (v30's Nsight Compute figures).
  constexpr int kForwardCooperativeMinRows = 1024;
  if (kind == GemmKind::kForward && epilogue == EpilogueKind::kStoreBf16 && rows_per_group > 0 &&
      rows_per_group < kForwardCooperativeMinRows) {
    return kPingpongBlockM;
  }
  // fp32 row outputs leave by synchronous register stores that stall a cooperative tile's MMAs;
  // the ping-pong tiles overlap them (backward.md v2). For the dgrad that now holds only at long
  // K over short experts: cooperative measured ahead at K <= 4096 (the down dgrad at
  // qwen3-30b-a3b 0.98 -> 0.77 ms, qwen3-235b-a22b 1.77 -> 1.64, mixtral-8x7b 4.24 -> 3.18) and
  // at K = 7168 over 8192 rows (deepseek-v3's shared expert: its phase 1.73 -> 1.57), far behind
  // at K = 7168 over ~256 rows an expert (deepseek-v3's routed one: 4.42 -> 6.88; backward.md
  // v29, v30). The forward's fp32 outputs (the unfused shared down) keep ping-pong, not measured
  // since. The bf16 dgrad stays cooperative at every measured size (v30).
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
