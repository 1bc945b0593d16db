// bench_soak's inputs, made on the device from the step number (routings in rotation, x, dy,
// the layer's weights), its host helpers, and the probe's check that every output element is
// finite (bench_soak.cu says what the soak checks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "mok/cuda_check.hpp"
#include "mok/device_buffer.hpp"
#include "mok/error.hpp"
#include "mok/gpu_layer.hpp"
#include "mok/shape.hpp"

namespace mok::soak {

using mok::detail::concat;

// ---- device-side inputs ---------------------------------------------------------------------

// SplitMix64's finaliser: a counter-based hash, the same on every GPU and in every run.
__host__ __device__ inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ inline float unit_interval(uint64_t bits) {  // [0, 1)
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// Uniform values with standard deviation `scale` from (seed, stream, index).
__global__ inline void fill_random_kernel(__nv_bfloat16* out, int64_t count, float scale,
                                          uint64_t seed, uint64_t stream) {
  const float half_width = scale * 1.7320508f;
  const uint64_t base = mix(seed ^ mix(stream));
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float unit = unit_interval(mix(base + static_cast<uint64_t>(index)));
    out[index] = __float2bfloat16_rn(half_width * (2.0f * unit - 1.0f));
  }
}

inline void fill_random(mok::bf16* out, int64_t count, double scale, uint64_t seed, uint64_t stream,
                        cudaStream_t cuda_stream) {
  if (count == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 2048));
  fill_random_kernel<<<blocks, 256, 0, cuda_stream>>>(reinterpret_cast<__nv_bfloat16*>(out), count,
                                                      static_cast<float>(scale), seed, stream);
  MOK_CUDA_CHECK_LAUNCH();
}

// The routings of the rotation; step s uses routing s % kNumRoutings, so that every window of a
// multiple of kNumRoutings steps holds the same mix (500 and 1000 are).
enum class Routing : int {
  kUniform = 0,      // k distinct experts, uniformly
  kSkewed = 1,       // expert ~ E·u⁴: a few experts take most rows, many none
  kOneExpert = 2,    // every token to one expert (slot 0), the other slots -1
  kHotExperts = 3,   // k distinct experts out of k + 2 neighbours: the rest of the experts empty
  kUnusedSlots = 4,  // uniform, each slot -1 with probability 0.3 (some rows all -1)
};
constexpr int kNumRoutings = 5;
const char* const kRoutingNames[kNumRoutings] = {"uniform", "skewed", "one-expert", "hot-experts",
                                                 "unused-slots"};

// One token per thread: its k ids (distinct but for -1, as the contract asks) and weights of
// either sign (unused slots too: their weight must be ignored). `hot`: the step's hot expert.
__global__ inline void make_routing_kernel(int32_t* topk_idx, float* topk_w, int num_tokens,
                                           int top_k, int num_experts, Routing routing,
                                           uint64_t seed, uint64_t step) {
  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token >= num_tokens) return;
  const uint64_t step_key = mix(seed ^ mix(step));
  const int hot = static_cast<int>(step_key % static_cast<uint64_t>(num_experts));
  const int window = min(num_experts, top_k + 2);  // kHotExperts; >= k, so a free id exists
  int32_t* row = topk_idx + static_cast<int64_t>(token) * top_k;
  float* weights = topk_w + static_cast<int64_t>(token) * top_k;
  const uint64_t token_key = mix(step_key + static_cast<uint64_t>(token));
  for (int slot = 0; slot < top_k; ++slot) {
    const uint64_t draw = mix(token_key + 3u * slot);
    const uint64_t extra = mix(token_key + 3u * slot + 1u);
    int expert = static_cast<int>(draw % static_cast<uint64_t>(num_experts));
    switch (routing) {
      case Routing::kUniform:
      case Routing::kUnusedSlots:
        break;
      case Routing::kSkewed: {
        const float u = unit_interval(draw);
        expert = min(num_experts - 1, static_cast<int>(num_experts * (u * u) * (u * u)));
        break;
      }
      case Routing::kOneExpert:
        expert = slot == 0 ? hot : -1;
        break;
      case Routing::kHotExperts:
        expert = (hot + static_cast<int>(draw % static_cast<uint64_t>(window))) % num_experts;
        break;
    }
    if (routing == Routing::kUnusedSlots && unit_interval(extra) < 0.3f) expert = -1;
    if (expert >= 0) {
      // Taken by an earlier slot: the next id (within the window for kHotExperts).
      auto taken = [&](int id) {
        for (int earlier = 0; earlier < slot; ++earlier) {
          if (row[earlier] == id) return true;
        }
        return false;
      };
      while (taken(expert)) {
        expert =
            routing == Routing::kHotExperts
                ? (hot + ((expert - hot + num_experts) % num_experts + 1) % window) % num_experts
                : (expert + 1) % num_experts;
      }
    }
    row[slot] = expert;
    weights[slot] = 2.0f * unit_interval(mix(token_key + 3u * slot + 2u)) - 1.0f;
  }
}

inline void make_routing(int32_t* topk_idx, float* topk_w, const mok::LayerShape& shape,
                         int64_t num_tokens, Routing routing, uint64_t seed, uint64_t step,
                         cudaStream_t stream) {
  const int blocks = static_cast<int>((num_tokens + 255) / 256);
  make_routing_kernel<<<blocks, 256, 0, stream>>>(
      topk_idx, topk_w, static_cast<int>(num_tokens), static_cast<int>(shape.top_k),
      static_cast<int>(shape.num_experts), routing, seed, step);
  MOK_CUDA_CHECK_LAUNCH();
}

// ---- host helpers ---------------------------------------------------------------------------

inline double median(std::vector<float> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

inline double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

inline int64_t device_bytes_in_use() {
  size_t free_bytes = 0, total_bytes = 0;
  MOK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

// ---- the probe ------------------------------------------------------------------------------

// One output of the probe, downloaded.
struct ProbeTensor {
  const char* name;
  const void* device;
  size_t bytes;
  int element_bytes;  // 2: bf16, 4: fp32
  std::vector<uint8_t> host;
};

inline bool finite_element(const uint8_t* element, int element_bytes) {
  if (element_bytes == 2) {
    uint16_t bits;
    std::memcpy(&bits, element, 2);
    return (bits & 0x7f80u) != 0x7f80u;
  }
  uint32_t bits;
  std::memcpy(&bits, element, 4);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// "grad_down element 17 (start 0x3f800000, end 0x3f800001)", or empty when every bit is equal.
inline std::string first_difference(const std::vector<ProbeTensor>& start,
                                    const std::vector<ProbeTensor>& end) {
  for (size_t which = 0; which < start.size(); ++which) {
    const ProbeTensor& a = start[which];
    const ProbeTensor& b = end[which];
    if (std::memcmp(a.host.data(), b.host.data(), a.host.size()) == 0) continue;
    for (size_t offset = 0; offset < a.host.size(); offset += a.element_bytes) {
      if (std::memcmp(&a.host[offset], &b.host[offset], a.element_bytes) == 0) continue;
      uint32_t bits_a = 0, bits_b = 0;
      std::memcpy(&bits_a, &a.host[offset], a.element_bytes);
      std::memcpy(&bits_b, &b.host[offset], a.element_bytes);
      char text[160];
      std::snprintf(text, sizeof(text), "%s element %zu (start 0x%0*x, end 0x%0*x)", a.name,
                    offset / a.element_bytes, 2 * a.element_bytes, bits_a, 2 * a.element_bytes,
                    bits_b);
      return text;
    }
  }
  return "";
}

// "dx: 12 elements not finite", or empty.
inline std::string non_finite(const std::vector<ProbeTensor>& tensors) {
  for (const ProbeTensor& tensor : tensors) {
    int64_t count = 0;
    for (size_t offset = 0; offset < tensor.host.size(); offset += tensor.element_bytes) {
      count += finite_element(&tensor.host[offset], tensor.element_bytes) ? 0 : 1;
    }
    if (count > 0) return concat(tensor.name, ": ", count, " elements not finite (unwritten?)");
  }
  return "";
}

}  // namespace mok::soak
