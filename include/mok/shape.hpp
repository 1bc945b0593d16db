// The shape of one MoE layer and the named presets of the benchmark protocol.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace mok {

// The GPU layer's row block: each expert's rows start at a multiple of it (the GEMM tile's
// height), and the ring of received rows holds at least two (GpuLayerOptions::ring_rows).
inline constexpr int64_t kRowBlock = 128;
inline constexpr int64_t kMinRingRows = 2 * kRowBlock;

struct LayerShape {
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I, per routed expert
  int64_t shared_intermediate = 0;  // I_s; 0 = no shared expert
  int64_t num_experts = 0;          // E, global
  int64_t top_k = 0;                // k

  bool has_shared() const { return shared_intermediate > 0; }

  // Useful FLOPs of one token's forward pass: three GEMMs of 2 FLOPs per multiply-add for the
  // routed experts it visits and for the shared expert. Backward is twice that.
  int64_t forward_flops_per_token() const {
    return 6 * hidden * (top_k * intermediate + shared_intermediate);
  }

  // Throws mok::Error naming the bad field. `ep` is the number of expert-parallel ranks.
  void validate(int64_t ep = 1) const;

  std::string describe() const;  // "H 7168, I 2048, E 256, top-8, I_s 2048"
};

struct Preset {
  std::string_view name;
  LayerShape shape;
  int64_t default_tokens_per_rank;
  std::string_view model;  // which model the shape comes from
};

std::span<const Preset> presets();

// Throws mok::Error("preset", ...) listing the known names when `name` is unknown.
const Preset& find_preset(std::string_view name);

}  // namespace mok
