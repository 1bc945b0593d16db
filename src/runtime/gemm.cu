// Launchers of the grouped expert GEMMs: shape description -> launch config -> kernel arguments
// -> one launch on the caller's stream. No host synchronisation, no read of the expert offsets.
#include "mok/gemm.hpp"

#include <cuda.h>

#include <algorithm>

#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "mok/error.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/gemm_tensor_map.hpp"

namespace mok::gemm {
namespace {

struct LaunchConfig {
  int num_ctas;
};

int device_sm_count() {
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  int count = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Persistent grid: one CTA per SM, fewer when the tile count is known to be smaller (wgrad).
LaunchConfig pick_config(const LaunchOptions& options, long long known_tiles) {
  MOK_CHECK_ARG(options.num_sms >= 0, "options.num_sms", "must be >= 0, got ", options.num_sms);
  long long num_ctas = options.num_sms > 0 ? options.num_sms : device_sm_count();
  if (known_tiles >= 0) num_ctas = std::min(num_ctas, std::max(known_tiles, 1LL));
  return {static_cast<int>(num_ctas)};
}

void check_shape(const GroupedShape& shape, const int* expert_offsets) {
  MOK_CHECK_ARG(shape.num_experts >= 0, "shape.num_experts", "must be >= 0, got ",
                shape.num_experts);
  MOK_CHECK_ARG(shape.capacity_rows >= 1, "shape.capacity_rows", "must be >= 1, got ",
                shape.capacity_rows);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % 8 == 0, "shape.n", "must be a positive multiple of 8, got ",
                shape.n);
  MOK_CHECK_ARG(shape.k > 0 && shape.k % 8 == 0, "shape.k", "must be a positive multiple of 8, got ",
                shape.k);
  MOK_CHECK_ARG(expert_offsets != nullptr || shape.num_experts == 0, "expert_offsets",
                "is null");
}

template <GemmKind kKind, EpilogueKind kEpilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const GroupedGemmParams& params,
            const LaunchConfig& config, cudaStream_t stream) {
  auto* kernel = &grouped_gemm_kernel<kKind, kEpilogue>;
  // NOTE: the attribute belongs to the current device, and one process may drive several GPUs
  // (one host thread per rank): set it on every launch (a host-side call of about a microsecond).
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      SharedLayout<kEpilogue>::kLaunchBytes));
  kernel<<<config.num_ctas, TileConfig::kNumThreads, SharedLayout<kEpilogue>::kLaunchBytes,
           stream>>>(
      map_a, map_b, params);
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

void grouped_forward(const GroupedShape& shape, const bf16* x, const bf16* w,
                     const int* expert_offsets, void* y, ForwardOutput output,
                     cudaStream_t stream, const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  MOK_CHECK_ARG(output != ForwardOutput::kSwiGluBf16 || shape.n % 16 == 0, "shape.n",
                "SwiGLU needs gate/up blocks of 8: n must be a multiple of 16, got ", shape.n);
  if (shape.num_experts == 0) return;
  const CUtensorMap map_a = make_tensor_map_2d(x, shape.capacity_rows, shape.k,
                                               TileConfig::BLOCK_M, "x");
  const CUtensorMap map_b = make_tensor_map_3d(w, shape.num_experts, shape.n, shape.k,
                                               TileConfig::BLOCK_N, 64, "w");
  const GroupedGemmParams params{expert_offsets, shape.num_experts, 0, shape.n, shape.k, y};
  const LaunchConfig config = pick_config(options, -1);
  switch (output) {
    case ForwardOutput::kBf16:
      launch<GemmKind::kForward, EpilogueKind::kStoreBf16>(map_a, map_b, params, config, stream);
      break;
    case ForwardOutput::kSwiGluBf16:
      launch<GemmKind::kForward, EpilogueKind::kSwiGluBf16>(map_a, map_b, params, config, stream);
      break;
    case ForwardOutput::kFp32:
      launch<GemmKind::kForward, EpilogueKind::kStoreFp32>(map_a, map_b, params, config, stream);
      break;
  }
}

void grouped_dgrad(const GroupedShape& shape, const bf16* dy, const bf16* w,
                   const int* expert_offsets, bf16* dx, cudaStream_t stream,
                   const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  if (shape.num_experts == 0) return;
  // C[rows, k] = dY[rows, n] · W[n, k]: the reduction runs over n, W is read n-rows by k-columns.
  const CUtensorMap map_a = make_tensor_map_2d(dy, shape.capacity_rows, shape.n,
                                               TileConfig::BLOCK_M, "dy");
  const CUtensorMap map_b = make_tensor_map_3d(w, shape.num_experts, shape.n, shape.k,
                                               TileConfig::BLOCK_K, TileConfig::kChunk, "w");
  const GroupedGemmParams params{expert_offsets, shape.num_experts, 0, shape.k, shape.n, dx};
  launch<GemmKind::kDgrad, EpilogueKind::kStoreBf16>(map_a, map_b, params,
                                                     pick_config(options, -1), stream);
}

void grouped_wgrad(const GroupedShape& shape, const bf16* dy, const bf16* x,
                   const int* expert_offsets, void* dw, WgradOutput output, cudaStream_t stream,
                   const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  if (shape.num_experts == 0) return;
  // C[n, k] = dYᵀ[n, rows] · X[rows, k]: both operands are read rows-of-the-expert by 64 columns.
  const CUtensorMap map_a = make_tensor_map_2d(dy, shape.capacity_rows, shape.n,
                                               TileConfig::BLOCK_K, "dy");
  const CUtensorMap map_b = make_tensor_map_2d(x, shape.capacity_rows, shape.k,
                                               TileConfig::BLOCK_K, "x");
  const GroupedGemmParams params{expert_offsets, shape.num_experts, shape.n, shape.k, 0, dw};
  const long long tiles = static_cast<long long>(shape.num_experts) *
                          ceil_div(shape.n, TileConfig::BLOCK_M) *
                          ceil_div(shape.k, TileConfig::BLOCK_N);
  const LaunchConfig config = pick_config(options, tiles);
  switch (output) {
    case WgradOutput::kFp32:
      launch<GemmKind::kWgrad, EpilogueKind::kStoreFp32>(map_a, map_b, params, config, stream);
      break;
    case WgradOutput::kBf16:
      launch<GemmKind::kWgrad, EpilogueKind::kStoreBf16>(map_a, map_b, params, config, stream);
      break;
    case WgradOutput::kAccumulateFp32:
      launch<GemmKind::kWgrad, EpilogueKind::kAccumulateFp32>(map_a, map_b, params, config,
                                                             stream);
      break;
  }
}

}  // namespace mok::gemm
