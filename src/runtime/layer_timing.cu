#include "runtime/layer_timing.hpp"

#include <cuda_bf16.h>

namespace mok::runtime {
namespace {

// fill_random's values (layer_timing.hpp).
__global__ void fill_random_kernel(__nv_bfloat16* out, int64_t count, double scale, uint64_t seed,
                                   uint64_t stream) {
  const float half_width = static_cast<float>(scale * 1.7320508075688772);
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull + index;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float unit = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[index] = __float2bfloat16_rn(half_width * (2.0f * unit - 1.0f));
  }
}

}  // namespace

void fill_random(bf16* out, int64_t count, double scale, uint64_t seed, uint64_t stream) {
  if (count == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
  fill_random_kernel<<<blocks, 256>>>(reinterpret_cast<__nv_bfloat16*>(out), count, scale, seed,
                                      stream);
  MOK_CUDA_CHECK_LAUNCH();
}

ForwardTiming time_forwards(const LayerRunSpec& spec, int rank, const std::string& loop,
                            cudaStream_t stream,
                            const std::function<void(const cudaEvent_t*)>& forward) {
  constexpr int kMarks = kNumForwardPhases + 1;  // before the first step and after each
  std::vector<cudaEvent_t> events(static_cast<size_t>(spec.iterations) * kMarks);
  for (cudaEvent_t& event : events) MOK_CUDA_CHECK(cudaEventCreate(&event));
  mark_timed_loop(spec, rank, loop, true);
  for (int iteration = 0; iteration < spec.iterations; ++iteration) {
    forward(&events[static_cast<size_t>(iteration) * kMarks]);
  }
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  mark_timed_loop(spec, rank, loop, false);
  std::vector<float> times(spec.iterations);
  std::vector<std::vector<float>> phase_times(kNumForwardPhases, times);
  for (int iteration = 0; iteration < spec.iterations; ++iteration) {
    const cudaEvent_t* marks = &events[static_cast<size_t>(iteration) * kMarks];
    MOK_CUDA_CHECK(cudaEventElapsedTime(&times[iteration], marks[0], marks[kNumForwardPhases]));
    for (int phase = 0; phase < kNumForwardPhases; ++phase) {
      MOK_CUDA_CHECK(
          cudaEventElapsedTime(&phase_times[phase][iteration], marks[phase], marks[phase + 1]));
    }
  }
  for (cudaEvent_t event : events) cudaEventDestroy(event);
  ForwardTiming timing;
  timing.ms = median(times);
  for (int phase = 0; phase < kNumForwardPhases; ++phase) {
    timing.phase_ms.push_back(median(phase_times[phase]));
  }
  return timing;
}

BackwardBuffers::BackwardBuffers(const LayerRunSpec& spec, int rank,
                                 const DeviceLayerWeights& weights, gemm::WgradOutput output)
    : dy(spec.tokens_per_rank * spec.shape.hidden),
      dx(spec.tokens_per_rank * spec.shape.hidden),
      d_topk_w(spec.tokens_per_rank * spec.shape.top_k),
      grad_gate_up(weights.gate_up_elements),
      grad_down(weights.down_elements),
      grad_shared_gate_up(weights.shared_gate_up_elements),
      grad_shared_down(weights.shared_down_elements) {
  const int64_t elements = spec.tokens_per_rank * spec.shape.hidden;
  if (spec.problem != nullptr) {
    dy.upload(spec.problem->dy.data() + rank * elements);
  } else {
    fill_random(dy.get(), elements, 1.0, spec.seed, 50 + rank);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const bool shared = spec.shape.has_shared();
  grads = {grad_gate_up.get(), grad_down.get(), shared ? grad_shared_gate_up.get() : nullptr,
           shared ? grad_shared_down.get() : nullptr, output};
}

}  // namespace mok::runtime
