// kAuto's engine choice (runtime/gemm_engine.hpp) on the GEMMs of the presets' layers, each pinned
// to the engine it was measured faster on (docs/perf-notes/gemm.md, backward.md v2, v29, v30). A
// change of a threshold that moves one of these cases fails here: measure it first.
#include <gtest/gtest.h>

#include "runtime/gemm_engine.hpp"

namespace mok::gemm {
namespace {

constexpr int kPingpong = kPingpongBlockM;
constexpr int kCooperative = 0;

// The rows a routed expert gets at EP 1 with bench_layer's tokens: T k / E.
constexpr int kDeepseekRows = 8192 * 8 / 256;  // 256
constexpr int kQwen235Rows = 8192 * 8 / 128;   // 512
constexpr int kQwen30Rows = 16384 * 8 / 128;   // 1024
constexpr int kMixtralRows = 8192 * 2 / 8;     // 2048

struct MeasuredCase {
  const char* what;
  GemmKind kind;
  EpilogueKind epilogue;
  int reduction_length;
  int rows_per_group;  // -1: not given
  int engine;          // the one it was measured faster on
};

constexpr MeasuredCase kMeasuredCases[] = {
    // The unfused down GEMMs of qwen3-30b-a3b (K = I = 768) and qwen3-235b-a22b (1536).
    {"short-K forward, K 768", GemmKind::kForward, EpilogueKind::kStoreBf16, 768, -1, kPingpong},
    {"short-K forward, K 1536", GemmKind::kForward, EpilogueKind::kStoreBf16, 1536, -1, kPingpong},
    // Longer K with the rows unknown: cooperative (the two traded places at K = 2048).
    {"forward, K 2048", GemmKind::kForward, EpilogueKind::kStoreBf16, 2048, -1, kCooperative},
    {"forward, K 14336", GemmKind::kForward, EpilogueKind::kStoreBf16, 14336, -1, kCooperative},
    // The recomputed gate/up, (rows, H) -> (rows, 2I) bf16, K = H: ping-pong over short experts,
    // cooperative over long ones.
    {"recompute gate/up, deepseek-v3", GemmKind::kForward, EpilogueKind::kStoreBf16, 7168,
     kDeepseekRows, kPingpong},
    {"recompute gate/up, qwen3-235b-a22b", GemmKind::kForward, EpilogueKind::kStoreBf16, 4096,
     kQwen235Rows, kPingpong},
    {"recompute gate/up, qwen3-30b-a3b", GemmKind::kForward, EpilogueKind::kStoreBf16, 2048,
     kQwen30Rows, kCooperative},
    {"recompute gate/up, mixtral-8x7b", GemmKind::kForward, EpilogueKind::kStoreBf16, 4096,
     kMixtralRows, kCooperative},
    // The routed down dgrad (fp32, K = H): ping-pong only at deepseek-v3's 256-row experts.
    {"down dgrad, deepseek-v3", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 7168, kDeepseekRows,
     kPingpong},
    {"down dgrad, qwen3-30b-a3b", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 2048, kQwen30Rows,
     kCooperative},
    {"down dgrad, qwen3-235b-a22b", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 4096, kQwen235Rows,
     kCooperative},
    {"down dgrad, mixtral-8x7b", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 4096, kMixtralRows,
     kCooperative},
    // deepseek-v3's shared expert: one group of all 8192 tokens, K = 7168 (down) and 4096
    // (gate/up).
    {"shared down dgrad, deepseek-v3", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 7168, 8192,
     kCooperative},
    {"shared gate/up dgrad, deepseek-v3", GemmKind::kDgrad, EpilogueKind::kStoreFp32, 4096, 8192,
     kCooperative},
    // The routed gate/up dgrad (bf16, K = 2I): cooperative even over deepseek-v3's short experts.
    {"gate/up dgrad, deepseek-v3", GemmKind::kDgrad, EpilogueKind::kStoreBf16, 4096, kDeepseekRows,
     kCooperative},
    {"gate/up dgrad, qwen3-235b-a22b", GemmKind::kDgrad, EpilogueKind::kStoreBf16, 3072,
     kQwen235Rows, kCooperative},
    // The unfused shared expert's fp32 forward output.
    {"fp32 forward", GemmKind::kForward, EpilogueKind::kStoreFp32, 2048, -1, kPingpong},
};

TEST(GemmEngine, EachMeasuredCaseRunsOnTheEngineItWonOn) {
  for (const MeasuredCase& c : kMeasuredCases) {
    EXPECT_EQ(auto_pingpong_block_m(c.kind, c.epilogue, c.reduction_length, c.rows_per_group),
              c.engine)
        << c.what;
  }
}

TEST(GemmEngine, SwiGluForwardIsCooperative) {
  for (const int rows : {-1, kDeepseekRows, kMixtralRows}) {
    for (const int k : {768, 2048, 7168}) {
      EXPECT_EQ(auto_pingpong_block_m(GemmKind::kForward, EpilogueKind::kSwiGluBf16, k, rows),
                kCooperative)
          << k << " " << rows;
    }
  }
}

TEST(GemmEngine, EveryWgradIsCooperative) {
  for (const EpilogueKind epilogue :
       {EpilogueKind::kStoreBf16, EpilogueKind::kStoreFp32, EpilogueKind::kAccumulateFp32}) {
    EXPECT_EQ(auto_pingpong_block_m(GemmKind::kWgrad, epilogue, -1, -1), kCooperative);
  }
}

}  // namespace
}  // namespace mok::gemm
