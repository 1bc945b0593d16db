// bench_layer's report of an FP8 mode's figures (--precision fp8 or mxfp8): the lines it prints
// beside mok's bf16 ones, and the fields its case adds to the JSON (the mode's forward as the
// case's mok_ms, its training step, backward and phases; the bf16 ones as bf16_*).
#pragma once

#include <cstdio>
#include <ostream>
#include <string>

#include "mok/layer_runner.hpp"

namespace mok::bench {

// The mode's forward, its phases and (backward) its training steps and backward phases, against
// the bf16 figures of the same run; flops: the forward's useful FLOPs a rank.
inline void print_fp8_mode(const LayerRunResult& result, const std::string& mode, double flops,
                           bool backward) {
  std::printf(
      "%-26s %s: forward %8.3f ms/rank  %7.1f useful TFLOP/s  (%.2fx the bf16 forward); weights "
      "quantized in %.3f ms, cache %.2f GB/rank, buffers %.2f GB/rank\n",
      "", mode.c_str(), result.fp8_forward_ms, flops / (result.fp8_forward_ms * 1e-3) * 1e-12,
      result.forward_ms / result.fp8_forward_ms, result.fp8_weight_quantize_ms,
      result.fp8_weight_bytes_per_rank / 1e9, result.fp8_buffer_bytes_per_rank / 1e9);
  for (size_t phase = 0; phase < result.fp8_phase_ms.size(); ++phase) {
    if (phase == 0) std::printf("    %s phases (ms, slowest rank): ", mode.c_str());
    std::printf("%s%s %.3f", phase == 0 ? "" : ", ", result.phase_names[phase].c_str(),
                result.fp8_phase_ms[phase]);
  }
  std::printf("\n");
  if (backward) {
    std::printf(
        "%-26s %s training step (weights quantized + forward + backward, save mode) %8.3f "
        "ms/rank (%.2fx the bf16 step); backward %8.3f ms/rank (%.2fx the bf16 backward), "
        "buffers %.2f GB/rank, context %.2f GB/rank\n",
        "", mode.c_str(), result.fp8_step_ms, result.forward_backward_ms / result.fp8_step_ms,
        result.fp8_backward_ms, result.backward_ms / result.fp8_backward_ms,
        result.fp8_backward_buffer_bytes_per_rank / 1e9,
        result.fp8_saved_context_bytes_per_rank / 1e9);
    std::printf(
        "%-26s %s step on the cached weights (forward + backward: gradient accumulation) "
        "%8.3f ms/rank (%.2fx the bf16 step); recompute mode: step %8.3f, backward %8.3f "
        "ms/rank\n",
        "", mode.c_str(), result.fp8_step_cached_weights_ms,
        result.forward_backward_ms / result.fp8_step_cached_weights_ms,
        result.fp8_step_recompute_ms, result.fp8_backward_recompute_ms);
    for (size_t phase = 0; phase < result.fp8_backward_phase_ms.size(); ++phase) {
      if (phase == 0) std::printf("    %s backward phases (ms, slowest rank): ", mode.c_str());
      std::printf("%s%s %.3f", phase == 0 ? "" : ", ", result.backward_phase_names[phase].c_str(),
                  result.fp8_backward_phase_ms[phase]);
    }
    std::printf("\n");
  }
}

// The mode's fields after the case's common ones: its forward's context, and (backward) its
// training steps, backward and phases, the bf16 ones beside them as bf16_*.
inline void json_fp8_mode(std::ostream& out, const LayerRunResult& result, const std::string& mode,
                          bool backward) {
  out << ", \"precision\": \"" << mode << "\", \"bf16_forward_ms\": " << result.forward_ms
      << ", \"weight_quantize_ms\": " << result.fp8_weight_quantize_ms
      << ", \"fp8_weight_bytes_per_rank\": " << result.fp8_weight_bytes_per_rank
      << ", \"bf16_phases_ms\": {";
  for (size_t phase = 0; phase < result.phase_ms.size(); ++phase) {
    out << (phase == 0 ? "" : ", ") << "\"" << result.phase_names[phase]
        << "\": " << result.phase_ms[phase];
  }
  out << "}";
  if (backward) {
    // The FP8 mode's training step (save mode, the weights' quantization inside each step), the
    // same on the cached weights (gradient accumulation), recompute mode's beside them, and the
    // bf16 one (save mode) as bf16_*.
    out << ", \"backward_ms\": " << result.fp8_backward_ms
        << ", \"fwdbwd_ms\": " << result.fp8_step_ms
        << ", \"fwdbwd_cached_weights_ms\": " << result.fp8_step_cached_weights_ms
        << ", \"backward_recompute_ms\": " << result.fp8_backward_recompute_ms
        << ", \"fwdbwd_recompute_ms\": " << result.fp8_step_recompute_ms
        << ", \"backward_buffer_bytes_per_rank\": " << result.fp8_backward_buffer_bytes_per_rank
        << ", \"saved_context_bytes_per_rank\": " << result.fp8_saved_context_bytes_per_rank
        << ", \"weight_bytes_per_rank\": " << result.weight_bytes_per_rank
        << ", \"context\": \"save\", \"weight_gradients\": \"bf16\""
        << ", \"bf16_backward_ms\": " << result.backward_ms
        << ", \"bf16_fwdbwd_ms\": " << result.forward_backward_ms;
    out << ", \"backward_phases_ms\": {";
    for (size_t phase = 0; phase < result.fp8_backward_phase_ms.size(); ++phase) {
      out << (phase == 0 ? "" : ", ") << "\"" << result.backward_phase_names[phase]
          << "\": " << result.fp8_backward_phase_ms[phase];
    }
    out << "}";
  }
}

}  // namespace mok::bench
