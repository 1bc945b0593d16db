// Launchers of the grouped expert GEMMs: shape description -> launch config -> kernel arguments
// -> one launch on the caller's stream. No host synchronisation, no read of the expert offsets.
#include "mok/gemm.hpp"

#include <cuda.h>

#include <algorithm>

#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/pingpong_gemm_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/cluster_launch.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/gemm_engine.hpp"
#include "runtime/gemm_tensor_map.hpp"

namespace mok::gemm {
namespace {

struct LaunchConfig {
  int num_ctas;
  int pingpong_block_m;  // ping-pong kernel, (BLOCK_M, 16384 / BLOCK_M) tiles; 0: cooperative
  int cluster_size = 1;  // cooperative wgrad: CTAs per cluster (kWgradClusterSize) or 1
  int block_m() const { return pingpong_block_m > 0 ? pingpong_block_m : TileConfig::BLOCK_M; }
  int block_n() const {
    return pingpong_block_m > 0 ? 128 * 128 / pingpong_block_m : TileConfig::BLOCK_N;
  }
};

// The engine for a case: the ping-pong tile's BLOCK_M, or 0 for the cooperative kernel; kAuto's
// choice is runtime/gemm_engine.hpp's.
int pick_engine(const LaunchOptions& options, GemmKind kind, EpilogueKind epilogue,
                int reduction_length, int rows_per_group = -1) {
  switch (options.engine) {
    case GemmEngine::kCooperative:
      return 0;
    case GemmEngine::kPingpong:
      return kPingpongBlockM;
    case GemmEngine::kAuto:
      break;
  }
  return auto_pingpong_block_m(kind, epilogue, reduction_length, rows_per_group);
}

// Persistent grid: one CTA per SM, fewer when the tile count is known to be smaller (wgrad).
// known_tiles(block_m, block_n) < 0: unknown on the host.
template <class KnownTiles>
LaunchConfig pick_config(const LaunchOptions& options, int pingpong_block_m,
                         KnownTiles known_tiles) {
  MOK_CHECK_ARG(options.num_sms >= 0, "options.num_sms", "must be >= 0, got ", options.num_sms);
  LaunchConfig config{0, pingpong_block_m};
  long long num_ctas = options.num_sms > 0 ? options.num_sms : current_device_sm_count();
  const long long tiles = known_tiles(config.block_m(), config.block_n());
  if (tiles >= 0) num_ctas = std::min(num_ctas, std::max(tiles, 1LL));
  config.num_ctas = static_cast<int>(num_ctas);
  return config;
}

long long unknown_tiles(int, int) { return -1; }

void check_shape(const GroupedShape& shape, const int* expert_offsets) {
  MOK_CHECK_ARG(shape.num_experts >= 0, "shape.num_experts", "must be >= 0, got ",
                shape.num_experts);
  MOK_CHECK_ARG(shape.capacity_rows >= 1, "shape.capacity_rows", "must be >= 1, got ",
                shape.capacity_rows);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % 8 == 0, "shape.n",
                "must be a positive multiple of 8, got ", shape.n);
  MOK_CHECK_ARG(shape.k > 0 && shape.k % 8 == 0, "shape.k",
                "must be a positive multiple of 8, got ", shape.k);
  MOK_CHECK_ARG(expert_offsets != nullptr || shape.num_experts == 0, "expert_offsets", "is null");
}

// Outputs are written 16 bytes at a time (bf16 rows by warp stores, fp32 pairs): the base must be
// 16-byte aligned; with n a multiple of 8 every row then is too.
void check_output(const void* output, const char* name) {
  MOK_CHECK_ARG(output != nullptr, name, "is null");
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(output) % 16 == 0, name,
                "must be 16-byte aligned, got address ", output);
}

using GemmKernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, GroupedGemmParams);

void launch_kernel(GemmKernel kernel, int num_threads, uint32_t smem_bytes,
                   const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                   const GroupedGemmParams& params, int num_ctas, cudaStream_t stream,
                   int cluster_size = 1) {
  // NOTE: the attribute belongs to the current device, and one process may drive several GPUs
  // (one host thread per rank): set it on every launch (a host-side call of about a microsecond).
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem_bytes)));
  if (cluster_size == 1) {
    kernel<<<num_ctas, num_threads, smem_bytes, stream>>>(map_a, map_b, map_c, params);
  } else {
    runtime::launch_on_clusters(kernel, num_ctas, num_threads, smem_bytes, cluster_size, stream,
                                map_a, map_b, map_c, params);
  }
  MOK_CUDA_CHECK_LAUNCH();
}

// map_c: C as a tensor map for the epilogues that store tiles by TMA (Epilogue::kBoxStores), else
// unused (defaults to an empty one).
template <GemmKind kKind, EpilogueKind kEpilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const GroupedGemmParams& params,
            const LaunchConfig& config, cudaStream_t stream, const CUtensorMap& map_c = {}) {
  if (config.pingpong_block_m == kPingpongBlockM) {
    launch_kernel(&pingpong_gemm_kernel<kKind, kEpilogue, kPingpongBlockM>,
                  PingpongConfig<kPingpongBlockM>::kNumThreads,
                  PingpongSharedLayout<kEpilogue, kPingpongBlockM>::kLaunchBytes, map_a, map_b,
                  map_c, params, config.num_ctas, stream);
    return;
  }
  if constexpr (kKind == GemmKind::kWgrad) {
    if (config.cluster_size == kWgradClusterSize) {
      launch_kernel(&grouped_gemm_kernel<kKind, kEpilogue, kWgradClusterSize>,
                    TileConfig::kNumThreads,
                    CooperativeLayout<kKind, kEpilogue, kWgradClusterSize>::kLaunchBytes, map_a,
                    map_b, map_c, params, config.num_ctas, stream, kWgradClusterSize);
      return;
    }
  }
  launch_kernel(&grouped_gemm_kernel<kKind, kEpilogue>, TileConfig::kNumThreads,
                CooperativeLayout<kKind, kEpilogue>::kLaunchBytes, map_a, map_b, map_c, params,
                config.num_ctas, stream);
}

// Clusters of the cooperative wgrad kernel with this epilogue that fit on the device at once.
template <EpilogueKind kEpilogue>
int wgrad_max_clusters() {
  return runtime::max_active_clusters(
      reinterpret_cast<const void*>(
          &grouped_gemm_kernel<GemmKind::kWgrad, kEpilogue, kWgradClusterSize>),
      TileConfig::kNumThreads,
      CooperativeLayout<GemmKind::kWgrad, kEpilogue, kWgradClusterSize>::kLaunchBytes,
      kWgradClusterSize);
}

EpilogueKind forward_epilogue(ForwardOutput output) {
  switch (output) {
    case ForwardOutput::kSwiGluBf16:
      return EpilogueKind::kSwiGluBf16;
    case ForwardOutput::kFp32:
      return EpilogueKind::kStoreFp32;
    case ForwardOutput::kBf16:
      break;
  }
  return EpilogueKind::kStoreBf16;
}

}  // namespace

void grouped_forward(const GroupedShape& shape, const bf16* x, const bf16* w,
                     const int* expert_offsets, void* y, ForwardOutput output, cudaStream_t stream,
                     const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  MOK_CHECK_ARG(output != ForwardOutput::kSwiGluBf16 || shape.n % 16 == 0, "shape.n",
                "SwiGLU needs gate/up blocks of 8: n must be a multiple of 16, got ", shape.n);
  if (shape.num_experts == 0) return;
  check_output(y, "y");
  const LaunchConfig config =
      pick_config(options,
                  pick_engine(options, GemmKind::kForward, forward_epilogue(output), shape.k,
                              options.group_rows > 0 ? options.group_rows : -1),
                  unknown_tiles);
  const CUtensorMap map_a =
      make_tensor_map_2d(x, shape.capacity_rows, shape.k, config.block_m(), "x");
  const CUtensorMap map_b =
      make_tensor_map_3d(w, shape.num_experts, shape.n, shape.k, config.block_n(), 64, "w");
  MOK_CHECK_ARG(shape.output_rows == nullptr || output != ForwardOutput::kFp32, "shape.output_rows",
                "scatters bf16 results only, not ForwardOutput::kFp32");
  GroupedGemmParams params{expert_offsets,     shape.num_experts, 0, shape.n, shape.k, y,
                           shape.expert_counts};
  params.output_rows = shape.output_rows;
  params.group_range = shape.expert_range;
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
                   const int* expert_offsets, void* dx, DgradOutput output, cudaStream_t stream,
                   const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  if (shape.num_experts == 0) return;
  check_output(dx, "dx");
  // C[rows, k] = dY[rows, n] · W[n, k]: the reduction runs over n, W is read n-rows by k-columns.
  // Every engine reads W in (64, 64) boxes and dY in (BLOCK_M, 64) boxes.
  static_assert(PingpongConfig<kPingpongBlockM>::BLOCK_K == TileConfig::BLOCK_K &&
                    PingpongConfig<kPingpongBlockM>::kPanel == TileConfig::kPanel,
                "one weight map for every engine");
  const EpilogueKind epilogue =
      output == DgradOutput::kFp32 ? EpilogueKind::kStoreFp32 : EpilogueKind::kStoreBf16;
  const LaunchConfig config = pick_config(
      options,
      pick_engine(options, GemmKind::kDgrad, epilogue, shape.n,
                  options.group_rows > 0 ? options.group_rows
                                         : shape.capacity_rows / std::max(shape.num_experts, 1)),
      unknown_tiles);
  const CUtensorMap map_a =
      make_tensor_map_2d(dy, shape.capacity_rows, shape.n, config.block_m(), "dy");
  const CUtensorMap map_b = make_tensor_map_3d(w, shape.num_experts, shape.n, shape.k,
                                               TileConfig::BLOCK_K, TileConfig::kPanel, "w");
  MOK_CHECK_ARG(shape.output_rows == nullptr || output == DgradOutput::kBf16, "shape.output_rows",
                "scatters bf16 results only, not DgradOutput::kFp32");
  GroupedGemmParams params{expert_offsets,     shape.num_experts, 0, shape.k, shape.n, dx,
                           shape.expert_counts};
  params.output_rows = shape.output_rows;
  params.group_range = shape.expert_range;
  if (output == DgradOutput::kFp32) {
    launch<GemmKind::kDgrad, EpilogueKind::kStoreFp32>(map_a, map_b, params, config, stream);
  } else {
    launch<GemmKind::kDgrad, EpilogueKind::kStoreBf16>(map_a, map_b, params, config, stream);
  }
}

void grouped_wgrad(const GroupedShape& shape, const bf16* dy, const bf16* x,
                   const int* expert_offsets, void* dw, WgradOutput output, cudaStream_t stream,
                   const LaunchOptions& options) {
  check_shape(shape, expert_offsets);
  MOK_CHECK_ARG(shape.output_rows == nullptr, "shape.output_rows",
                "is for forward and dgrad results; wgrad's rows are the weights'");
  if (shape.num_experts == 0) return;
  check_output(dw, "dw");
  // C[n, k] = dYᵀ[n, rows] · X[rows, k]: both operands are read rows-of-the-expert by 64 columns.
  const CUtensorMap map_a =
      make_tensor_map_2d(dy, shape.capacity_rows, shape.n, TileConfig::BLOCK_K, "dy");
  const CUtensorMap map_b =
      make_tensor_map_2d(x, shape.capacity_rows, shape.k, TileConfig::BLOCK_K, "x");
  GroupedGemmParams params{expert_offsets,     shape.num_experts, shape.n, shape.k, 0, dw,
                           shape.expert_counts};
  params.group_range = shape.expert_range;
  const EpilogueKind epilogue = output == WgradOutput::kFp32   ? EpilogueKind::kStoreFp32
                                : output == WgradOutput::kBf16 ? EpilogueKind::kStoreBf16
                                                               : EpilogueKind::kAccumulateFp32;
  const auto num_tiles = [&](int block_m, int block_n) {
    return static_cast<long long>(shape.num_experts) * ceil_div(shape.n, block_m) *
           ceil_div(shape.k, block_n);
  };
  MOK_CHECK_ARG(options.wgrad_cluster == 0 || options.wgrad_cluster == 1 ||
                    options.wgrad_cluster == kWgradClusterSize,
                "options.wgrad_cluster", "must be 0, 1 or ", kWgradClusterSize, ", got ",
                options.wgrad_cluster);
  LaunchConfig config =
      pick_config(options, pick_engine(options, GemmKind::kWgrad, epilogue, -1), num_tiles);
  if (config.pingpong_block_m == 0 && options.wgrad_cluster != 1) {
    // Whole clusters: of the CTAs asked for, as many as fit at once, no more than have tiles.
    const long long cluster_tiles =
        static_cast<long long>(shape.num_experts) *
        ceil_div(ceil_div(shape.n, TileConfig::BLOCK_M), kWgradClusterSize) *
        ceil_div(shape.k, TileConfig::BLOCK_N);
    const int asked = options.num_sms > 0 ? options.num_sms : current_device_sm_count();
    const int fitting = epilogue == EpilogueKind::kStoreFp32
                            ? wgrad_max_clusters<EpilogueKind::kStoreFp32>()
                        : epilogue == EpilogueKind::kStoreBf16
                            ? wgrad_max_clusters<EpilogueKind::kStoreBf16>()
                            : wgrad_max_clusters<EpilogueKind::kAccumulateFp32>();
    const long long clusters = std::min({static_cast<long long>(asked / kWgradClusterSize),
                                         static_cast<long long>(fitting), cluster_tiles});
    if (clusters >= 1) {
      config.num_ctas = static_cast<int>(clusters) * kWgradClusterSize;
      config.cluster_size = kWgradClusterSize;
    }
  }
  switch (output) {
    case WgradOutput::kFp32:
      launch<GemmKind::kWgrad, EpilogueKind::kStoreFp32>(map_a, map_b, params, config, stream);
      break;
    case WgradOutput::kBf16: {
      // dW [experts, n, k] bf16, stored a box at a time (warp_boxes.cuh).
      const CUtensorMap map_c = make_warp_box_map(dw, shape.num_experts, shape.n, shape.k, "dw");
      launch<GemmKind::kWgrad, EpilogueKind::kStoreBf16>(map_a, map_b, params, config, stream,
                                                         map_c);
      break;
    }
    case WgradOutput::kAccumulateFp32:
      launch<GemmKind::kWgrad, EpilogueKind::kAccumulateFp32>(map_a, map_b, params, config, stream);
      break;
  }
}

}  // namespace mok::gemm
