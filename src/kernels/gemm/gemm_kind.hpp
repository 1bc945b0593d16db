// What a grouped GEMM computes (GemmKind) and how its results leave (EpilogueKind): plain C++, for
// the kernels (gemm_types.cuh), the host launchers and the host tests alike.
#pragma once

namespace mok::gemm {

enum class GemmKind {
  kForward,  // A K-major (activations), B K-major (weights [E, N, K])
  kDgrad,    // A K-major (dY), B MN-major (weights [E, K, N])
  kWgrad,    // A MN-major (dY rows), B MN-major (X rows); K = the group's row count
};

enum class EpilogueKind {
  kStoreBf16,       // C rounded to bf16
  kSwiGluBf16,      // gate/up columns interleaved by 8: h = bf16(swiglu(g, u)), width N / 2
  kStoreFp32,       // C in fp32
  kAccumulateFp32,  // C = main_grad + A·B, accumulators initialised from the fp32 output
  // FP8 engine only: gate/up columns interleaved by 128 (kSwiGluFp8Interleave); h = swiglu(g, u)
  // quantized to E4M3 per 1 x 128 from fp32, width N / 2 bytes, its scales in output_scales.
  kSwiGluFp8,
};

}  // namespace mok::gemm
