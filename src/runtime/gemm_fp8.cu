// Launcher of the FP8 grouped forward GEMM: checked arguments -> tensor maps and kernel arguments
// -> one launch on the caller's stream. No host synchronisation, no read of the expert offsets.
#include "mok/gemm_fp8.hpp"

#include <cuda.h>

#include <algorithm>

#include "kernels/gemm/fp8_gemm_kernel.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/gemm_tensor_map.hpp"

namespace mok::gemm {
namespace {

void check_arguments(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                     const uint8_t* w, const float* w_scales, const int* expert_offsets,
                     ForwardOutput output, const LaunchOptions& options) {
  MOK_CHECK_ARG(shape.num_experts >= 0, "shape.num_experts", "must be >= 0, got ",
                shape.num_experts);
  MOK_CHECK_ARG(shape.capacity_rows >= 1, "shape.capacity_rows", "must be >= 1, got ",
                shape.capacity_rows);
  MOK_CHECK_ARG(shape.k > 0 && shape.k % Fp8TileConfig::kScaleBlock == 0, "shape.k",
                "must be a positive multiple of 128 (one FP8 scale block), got ", shape.k);
  MOK_CHECK_ARG(shape.n > 0 && shape.n % 8 == 0, "shape.n",
                "must be a positive multiple of 8, got ", shape.n);
  MOK_CHECK_ARG(output != ForwardOutput::kSwiGluBf16 || shape.n % 16 == 0, "shape.n",
                "SwiGLU needs gate/up blocks of 8: n must be a multiple of 16, got ", shape.n);
  MOK_CHECK_ARG(options.num_sms >= 0, "options.num_sms", "must be >= 0, got ", options.num_sms);
  MOK_CHECK_ARG(options.engine != GemmEngine::kPingpong, "options.engine",
                "the FP8 GEMM has the cooperative engine only (kAuto or kCooperative)");
  if (shape.num_experts == 0) return;
  MOK_CHECK_ARG(expert_offsets != nullptr, "expert_offsets", "is null");
  const struct {
    const void* pointer;
    const char* name;
    uintptr_t alignment;
  } operands[] = {{x, "x", 16}, {w, "w", 16}, {x_scales, "x_scales", 4}, {w_scales, "w_scales", 4}};
  for (const auto& operand : operands) {
    MOK_CHECK_ARG(operand.pointer != nullptr, operand.name, "is null");
    MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(operand.pointer) % operand.alignment == 0,
                  operand.name, "must be ", operand.alignment, "-byte aligned, got address ",
                  operand.pointer);
  }
}

template <EpilogueKind kEpilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const Fp8GemmParams& params,
            int num_ctas, cudaStream_t stream) {
  auto* kernel = &fp8_grouped_gemm_kernel<kEpilogue>;
  constexpr uint32_t kSmemBytes = Fp8SharedLayout<kEpilogue>::kLaunchBytes;
  // NOTE: the attribute belongs to the current device, and one process may drive several GPUs:
  // set it on every launch.
  MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemBytes)));
  kernel<<<num_ctas, Fp8TileConfig::kNumThreads, kSmemBytes, stream>>>(map_a, map_b, params);
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace

void grouped_forward_fp8(const GroupedShape& shape, const uint8_t* x, const float* x_scales,
                         const uint8_t* w, const float* w_scales, const int* expert_offsets,
                         void* y, ForwardOutput output, cudaStream_t stream,
                         const LaunchOptions& options) {
  check_arguments(shape, x, x_scales, w, w_scales, expert_offsets, output, options);
  if (shape.num_experts == 0) return;
  MOK_CHECK_ARG(y != nullptr, "y", "is null");
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(y) % 16 == 0, "y",
                "must be 16-byte aligned, got address ", y);
  // NOTE: the maps read the E4M3 bytes as bf16 pairs: a row of k bytes is k / 2 bf16, and a box
  // 64 bf16 wide is one 128-byte swizzle row of 128 E4M3 values, the k-block. TMA moves and
  // swizzles bytes whatever the element type, and its zero fill is zero bytes either way.
  const CUtensorMap map_a =
      make_tensor_map_2d(x, shape.capacity_rows, shape.k / 2, Fp8TileConfig::BLOCK_M, "x");
  const CUtensorMap map_b = make_tensor_map_3d(w, shape.num_experts, shape.n, shape.k / 2,
                                               Fp8TileConfig::BLOCK_N, 64, "w");
  Fp8GemmParams params;
  params.grouped = {expert_offsets, shape.num_experts, 0, shape.n, shape.k, y, shape.expert_counts};
  params.a_scales = x_scales;
  params.b_scales = w_scales;
  // One CTA per SM (the tile count is on the device).
  const int num_ctas = options.num_sms > 0 ? options.num_sms : current_device_sm_count();
  switch (output) {
    case ForwardOutput::kBf16:
      launch<EpilogueKind::kStoreBf16>(map_a, map_b, params, num_ctas, stream);
      break;
    case ForwardOutput::kSwiGluBf16:
      launch<EpilogueKind::kSwiGluBf16>(map_a, map_b, params, num_ctas, stream);
      break;
    case ForwardOutput::kFp32:
      launch<EpilogueKind::kStoreFp32>(map_a, map_b, params, num_ctas, stream);
      break;
  }
}

}  // namespace mok::gemm
