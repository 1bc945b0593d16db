// Launchers of the FP8 grouped GEMMs (forward, dgrad, wgrad): checked arguments -> tensor maps
// and kernel arguments -> one launch on the caller's stream. No host synchronisation, no read of
// the expert offsets.
#include "mok/gemm_fp8.hpp"

#include <cuda.h>

#include <algorithm>
#include <initializer_list>

#include "kernels/gemm/fp8_gemm_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/cluster_launch.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/gemm_tensor_map.hpp"

namespace mok::gemm {
namespace {

// The forward's pipeline where Fp8Pipeline says 0 (docs/perf-notes/fp8.md has the measurements).
constexpr int kFp8ForwardStages = 4;
constexpr int kFp8ForwardCluster = kFp8ClusterSize;

struct Operand {
  const void* pointer;
  const char* name;
  uintptr_t alignment;
};

void check_common(const GroupedShape& shape, const int* expert_offsets,
                  std::initializer_list<Operand> operands, const void* output,
                  const char* output_name, const LaunchOptions& options) {
  MOK_CHECK_ARG(shape.num_experts >= 0, "shape.num_experts", "must be >= 0, got ",
                shape.num_experts);
  MOK_CHECK_ARG(shape.capacity_rows >= 1, "shape.capacity_rows", "must be >= 1, got ",
                shape.capacity_rows);
  MOK_CHECK_ARG(options.num_sms >= 0, "options.num_sms", "must be >= 0, got ", options.num_sms);
  MOK_CHECK_ARG(options.engine != GemmEngine::kPingpong, "options.engine",
                "the FP8 GEMM has the cooperative engine only (kAuto or kCooperative)");
  MOK_CHECK_ARG(shape.expert_range == nullptr, "shape.expert_range",
                "the FP8 GEMMs take every expert (no range of them yet)");
  if (shape.num_experts == 0) return;
  MOK_CHECK_ARG(expert_offsets != nullptr, "expert_offsets", "is null");
  for (const Operand& operand : operands) {
    MOK_CHECK_ARG(operand.pointer != nullptr, operand.name, "is null");
    MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(operand.pointer) % operand.alignment == 0,
                  operand.name, "must be ", operand.alignment, "-byte aligned, got address ",
                  operand.pointer);
  }
  MOK_CHECK_ARG(output != nullptr, output_name, "is null");
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(output) % 16 == 0, output_name,
                "must be 16-byte aligned, got address ", output);
}

using Fp8Kernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, Fp8GemmParams);

// One instance of the kernel and what its launch needs.
struct KernelLaunch {
  Fp8Kernel kernel;
  uint32_t smem_bytes;
  int cluster_size;
};

template <EpilogueKind kEpilogue, GemmKind kKind, int kStages = fp8_stages(kKind, kEpilogue),
          int kClusterSize = 1, bool kGateUp = false>
KernelLaunch kernel_launch() {
  return {&fp8_grouped_gemm_kernel<kEpilogue, kKind, kStages, kClusterSize, kGateUp>,
          Fp8SharedLayout<kEpilogue, kKind, kStages, kClusterSize>::kLaunchBytes, kClusterSize};
}

// NOTE: the attribute belongs to the current device, and one process may drive several GPUs:
// set it on every launch.
void set_smem_attribute(const KernelLaunch& launch) {
  MOK_CUDA_CHECK(cudaFuncSetAttribute(launch.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(launch.smem_bytes)));
}

// map_c: C as a tensor map for the epilogues that store tiles by TMA (Fp8Epilogue::kBoxStores),
// else unused.
void launch(const KernelLaunch& launch, const CUtensorMap& map_a, const CUtensorMap& map_b,
            const Fp8GemmParams& params, int num_ctas, cudaStream_t stream,
            const CUtensorMap& map_c = {}) {
  set_smem_attribute(launch);
  if (launch.cluster_size == 1) {
    launch.kernel<<<num_ctas, Fp8TileConfig::kNumThreads, launch.smem_bytes, stream>>>(
        map_a, map_b, map_c, params);
  } else {
    runtime::launch_on_clusters(launch.kernel, num_ctas, Fp8TileConfig::kNumThreads,
                                launch.smem_bytes, launch.cluster_size, stream, map_a, map_b, map_c,
                                params);
  }
  MOK_CUDA_CHECK_LAUNCH();
}

template <EpilogueKind kEpilogue, GemmKind kKind>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const Fp8GemmParams& params,
            int num_ctas, cudaStream_t stream, const CUtensorMap& map_c = {}) {
  launch(kernel_launch<kEpilogue, kKind>(), map_a, map_b, params, num_ctas, stream, map_c);
}

// Clusters of a clustered kernel that fit on the current device at once (0: run single CTAs).
int max_active_clusters(const KernelLaunch& launch) {
  return runtime::max_active_clusters(reinterpret_cast<const void*>(launch.kernel),
                                      Fp8TileConfig::kNumThreads, launch.smem_bytes,
                                      launch.cluster_size);
}

// The forward kernel for an epilogue, a ring depth (bf16 outputs) and a cluster size; kGateUp:
// kSwiGluFp8's instance that also stores the gate/up sums.
template <EpilogueKind kEpilogue, bool kGateUp = false>
KernelLaunch forward_kernel(int stages, int cluster_size) {
  constexpr GemmKind kForward = GemmKind::kForward;
  if constexpr (uses_staged_store(kEpilogue)) {
    if (stages == 3) {
      return cluster_size == 1 ? kernel_launch<kEpilogue, kForward, 3>()
                               : kernel_launch<kEpilogue, kForward, 3, kFp8ClusterSize>();
    }
  }
  constexpr int kStages = fp8_stages(kForward, kEpilogue);
  return cluster_size == 1
             ? kernel_launch<kEpilogue, kForward, kStages, 1, kGateUp>()
             : kernel_launch<kEpilogue, kForward, kStages, kFp8ClusterSize, kGateUp>();
}

KernelLaunch forward_kernel(EpilogueKind epilogue, int stages, int cluster_size, bool gate_up) {
  switch (epilogue) {
    case EpilogueKind::kStoreBf16:
      return forward_kernel<EpilogueKind::kStoreBf16>(stages, cluster_size);
    case EpilogueKind::kSwiGluBf16:
      return forward_kernel<EpilogueKind::kSwiGluBf16>(stages, cluster_size);
    case EpilogueKind::kStoreFp32:
      return forward_kernel<EpilogueKind::kStoreFp32>(stages, cluster_size);
    case EpilogueKind::kSwiGluFp8:
      return gate_up ? forward_kernel<EpilogueKind::kSwiGluFp8, true>(stages, cluster_size)
                     : forward_kernel<EpilogueKind::kSwiGluFp8>(stages, cluster_size);
    case EpilogueKind::kAccumulateFp32:
      break;
  }
  MOK_CHECK_ARG(false, "output", "the forward kernel does not accumulate");
  return {};
}

// One CTA per SM (the tile count is on the device).
int grid_size(const LaunchOptions& options) {
  return options.num_sms > 0 ? options.num_sms : current_device_sm_count();
}

// The forward kernel on checked arguments: C (rows, n) = A (rows, k) · B (E, n, k)ᵀ, the names
// those of the caller's arguments.
void run_forward_kernel(const GroupedShape& shape, const uint8_t* a, const float* a_scales,
                        const uint8_t* b, const float* b_scales, const int* expert_offsets, void* c,
                        EpilogueKind epilogue, const char* a_name, const char* b_name,
                        cudaStream_t stream, const LaunchOptions& options,
                        const Fp8Pipeline& pipeline, float* c_scales = nullptr,
                        void* gate_up = nullptr, const int32_t* gate_up_rows = nullptr) {
  MOK_CHECK_ARG(
      pipeline.cluster == 0 || pipeline.cluster == 1 || pipeline.cluster == kFp8ClusterSize,
      "pipeline.cluster", "must be 0, 1 or ", kFp8ClusterSize, ", got ", pipeline.cluster);
  MOK_CHECK_ARG(pipeline.stages == 0 || pipeline.stages == 3 || pipeline.stages == 4,
                "pipeline.stages", "must be 0, 3 or 4, got ", pipeline.stages);
  const int stages = pipeline.stages == 0 ? kFp8ForwardStages : pipeline.stages;
  int num_ctas = grid_size(options);
  KernelLaunch kernel = forward_kernel(epilogue, stages, 1, gate_up != nullptr);
  if ((pipeline.cluster == 0 ? kFp8ForwardCluster : pipeline.cluster) == kFp8ClusterSize) {
    // Whole clusters: of the CTAs asked for, as many as fit at once.
    const KernelLaunch clustered =
        forward_kernel(epilogue, stages, kFp8ClusterSize, gate_up != nullptr);
    const int clusters = std::min(num_ctas / kFp8ClusterSize, max_active_clusters(clustered));
    if (clusters >= 1) {
      kernel = clustered;
      num_ctas = clusters * kFp8ClusterSize;
    }
  }
  // NOTE: the maps read the E4M3 bytes as bf16 pairs: a row of k bytes is k / 2 bf16, and a box
  // 64 bf16 wide is one 128-byte swizzle row of 128 E4M3 values, the k-block. TMA moves and
  // swizzles bytes whatever the element type, and its zero fill is zero bytes either way. On a
  // cluster each CTA loads one piece of the weight tile: B's box is BLOCK_N / cluster rows.
  const CUtensorMap map_a =
      make_tensor_map_2d(a, shape.capacity_rows, shape.k / 2, Fp8TileConfig::BLOCK_M, a_name);
  const CUtensorMap map_b =
      make_tensor_map_3d(b, shape.num_experts, shape.n, shape.k / 2,
                         Fp8TileConfig::BLOCK_N / kernel.cluster_size, 64, b_name);
  Fp8GemmParams params;
  params.grouped = {expert_offsets,      shape.num_experts, 0, shape.n, shape.k, c,
                    shape.expert_counts, c_scales};
  params.gate_up = gate_up;
  params.gate_up_rows = gate_up_rows;
  params.a_scales = a_scales;
  params.b_scales = b_scales;
  launch(kernel, map_a, map_b, params, num_ctas, stream);
}

}  // namespace

void grouped_forward_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                         const uint8_t* w, const float* w_scales, const int* expert_offsets,
                         void* y, ForwardOutput output, cudaStream_t stream,
                         const LaunchOptions& options, const Fp8Pipeline& pipeline) {
  MOK_CHECK_ARG(shape.k > 0 && shape.k % Fp8TileConfig::kScaleBlock == 0, "shape.k",
                "must be a positive multiple of 128 (one FP8 scale block), got ", shape.k);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % 8 == 0, "shape.n",
                "must be a positive multiple of 8, got ", shape.n);
  MOK_CHECK_ARG(output != ForwardOutput::kSwiGluBf16 || shape.n % 16 == 0, "shape.n",
                "SwiGLU needs gate/up blocks of 8: n must be a multiple of 16, got ", shape.n);
  check_common(shape, expert_offsets,
               {{x, "x", 16}, {w, "w", 16}, {x_scales, "x_scales", 4}, {w_scales, "w_scales", 4}},
               y, "y", options);
  if (shape.num_experts == 0) return;
  const EpilogueKind epilogue = output == ForwardOutput::kBf16   ? EpilogueKind::kStoreBf16
                                : output == ForwardOutput::kFp32 ? EpilogueKind::kStoreFp32
                                                                 : EpilogueKind::kSwiGluBf16;
  run_forward_kernel(shape, x, x_scales, w, w_scales, expert_offsets, y, epilogue, "x", "w", stream,
                     options, pipeline);
}

void grouped_swiglu_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                        const uint8_t* w, const float* w_scales, const int* expert_offsets,
                        uint8_t* h, float* h_scales, cudaStream_t stream,
                        const LaunchOptions& options, const Fp8Pipeline& pipeline, bf16* gate_up,
                        const int32_t* gate_up_rows) {
  MOK_CHECK_ARG(shape.k > 0 && shape.k % Fp8TileConfig::kScaleBlock == 0, "shape.k",
                "must be a positive multiple of 128 (one FP8 scale block), got ", shape.k);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % (2 * kSwiGluFp8Interleave) == 0, "shape.n",
                "must be a positive multiple of 256 (gate/up blocks of 128: I a multiple of 128), "
                "got ",
                shape.n);
  check_common(shape, expert_offsets,
               {{x, "x", 16},
                {w, "w", 16},
                {x_scales, "x_scales", 4},
                {w_scales, "w_scales", 4},
                {h_scales, "h_scales", 4}},
               h, "h", options);
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(gate_up) % 16 == 0, "gate_up",
                "must be 16-byte aligned, got address ", static_cast<void*>(gate_up));
  if (shape.num_experts == 0) return;
  run_forward_kernel(shape, x, x_scales, w, w_scales, expert_offsets, h, EpilogueKind::kSwiGluFp8,
                     "x", "w", stream, options, pipeline, h_scales, gate_up, gate_up_rows);
}

void grouped_dgrad_fp8(const GroupedShape& shape, const uint8_t* dy, const float* dy_scales,
                       const uint8_t* w_t, const float* w_t_scales, const int* expert_offsets,
                       void* dx, DgradOutput output, cudaStream_t stream,
                       const LaunchOptions& options, const Fp8Pipeline& pipeline) {
  MOK_CHECK_ARG(shape.n > 0 && shape.n % Fp8TileConfig::kScaleBlock == 0, "shape.n",
                "must be a positive multiple of 128 (the dgrad sums over n in FP8 scale blocks), "
                "got ",
                shape.n);
  MOK_CHECK_ARG(shape.k > 0 && shape.k % 8 == 0, "shape.k",
                "must be a positive multiple of 8, got ", shape.k);
  check_common(shape, expert_offsets,
               {{dy, "dy", 16},
                {w_t, "w_t", 16},
                {dy_scales, "dy_scales", 4},
                {w_t_scales, "w_t_scales", 4}},
               dx, "dx", options);
  if (shape.num_experts == 0) return;
  // The forward kernel with the GEMM's N = the forward's k and K = its n.
  GroupedShape transposed = shape;
  transposed.n = shape.k;
  transposed.k = shape.n;
  run_forward_kernel(
      transposed, dy, dy_scales, w_t, w_t_scales, expert_offsets, dx,
      output == DgradOutput::kBf16 ? EpilogueKind::kStoreBf16 : EpilogueKind::kStoreFp32, "dy",
      "w_t", stream, options, pipeline);
}

void grouped_wgrad_fp8(const GroupedShape& shape, const uint8_t* dy_t, const float* dy_t_scales,
                       const uint8_t* x_t, const float* x_t_scales, const int* expert_offsets,
                       void* dw, WgradOutput output, cudaStream_t stream,
                       const LaunchOptions& options) {
  constexpr int kRowBlockBytes = Fp8TileConfig::BLOCK_K;
  MOK_CHECK_ARG(shape.capacity_rows % kRowBlockBytes == 0, "shape.capacity_rows",
                "must be a multiple of 128 (the transposed operands' scale blocks), got ",
                shape.capacity_rows);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % 8 == 0, "shape.n",
                "must be a positive multiple of 8, got ", shape.n);
  MOK_CHECK_ARG(shape.k > 0 && shape.k % 8 == 0, "shape.k",
                "must be a positive multiple of 8, got ", shape.k);
  check_common(shape, expert_offsets,
               {{dy_t, "dy_t", 16},
                {x_t, "x_t", 16},
                {dy_t_scales, "dy_t_scales", 4},
                {x_t_scales, "x_t_scales", 4}},
               dw, output == WgradOutput::kAccumulateFp32 ? "main_grad" : "dw", options);
  if (shape.num_experts == 0) return;
  // C (E, n, k) = A (n, rows) · B (k, rows)ᵀ per expert, K = the expert's rows. The maps read
  // bytes as bf16 pairs, as in the forward.
  const CUtensorMap map_a =
      make_tensor_map_2d(dy_t, shape.n, shape.capacity_rows / 2, Fp8TileConfig::BLOCK_M, "dy_t");
  const CUtensorMap map_b =
      make_tensor_map_2d(x_t, shape.k, shape.capacity_rows / 2, Fp8TileConfig::BLOCK_N, "x_t");
  Fp8GemmParams params;
  params.grouped = {expert_offsets,     shape.num_experts, shape.n, shape.k, 0, dw,
                    shape.expert_counts};
  params.a_scales = dy_t_scales;
  params.b_scales = x_t_scales;
  params.num_row_blocks = shape.capacity_rows / kRowBlockBytes;
  const int num_ctas = grid_size(options);
  switch (output) {
    case WgradOutput::kFp32:
      launch<EpilogueKind::kStoreFp32, GemmKind::kWgrad>(map_a, map_b, params, num_ctas, stream);
      break;
    case WgradOutput::kBf16: {
      // The store warp's tile stores (Fp8Epilogue::store_tile), one (BLOCK_M, 64) box at a time.
      using Boxes = Fp8Epilogue<EpilogueKind::kStoreBf16, GemmKind::kWgrad>::Boxes;
      const CUtensorMap map_c =
          make_tensor_map_3d(dw, shape.num_experts, shape.n, shape.k, Fp8TileConfig::BLOCK_M,
                             Boxes::kBoxColumns, "dw");
      launch<EpilogueKind::kStoreBf16, GemmKind::kWgrad>(map_a, map_b, params, num_ctas, stream,
                                                         map_c);
      break;
    }
    case WgradOutput::kAccumulateFp32:
      launch<EpilogueKind::kAccumulateFp32, GemmKind::kWgrad>(map_a, map_b, params, num_ctas,
                                                              stream);
      break;
  }
}

}  // namespace mok::gemm
