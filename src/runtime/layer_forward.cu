// The unfused GPU layer forward: buffers sized from shapes, weights in the GEMM engine's layouts,
// and one enqueue of the whole composition per call (see layer_forward.hpp).
#include "runtime/layer_forward.hpp"

#include <algorithm>
#include <cmath>

#include <cuda_runtime.h>

#include "kernels/gemm/gemm_types.cuh"
#include "kernels/megakernel/trace.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/l2_partitions.hpp"

namespace mok {
namespace {

// The gate/up interleave block of gemm::interleave_gate_up: fused rows 16b..16b+7 are gate rows
// 8b..8b+7, fused rows 16b+8..16b+15 are up rows 8b..8b+7.
constexpr int64_t kInterleaveRows = 8;

// fused (experts, 2 * inter, hidden) <- gate, up (experts, inter, hidden) on the host: every block
// of 8 gate rows lands in the first half of a 16-row block, every block of up rows in the second.
void upload_interleaved(bf16* fused, const bf16* gate, const bf16* up, int64_t experts,
                        int64_t inter, int64_t hidden) {
  const size_t block_bytes = static_cast<size_t>(kInterleaveRows * hidden) * sizeof(bf16);
  const size_t num_blocks = static_cast<size_t>(experts * inter / kInterleaveRows);
  MOK_CUDA_CHECK(cudaMemcpy2D(fused, 2 * block_bytes, gate, block_bytes, block_bytes, num_blocks,
                              cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaMemcpy2D(fused + kInterleaveRows * hidden, 2 * block_bytes, up, block_bytes,
                              block_bytes, num_blocks, cudaMemcpyHostToDevice));
}

// The fused path sizes expert_x by its ring and needs no expert_y; the unfused one needs both
// for every row.
WorkspaceOptions workspace_options(const LayerForwardOptions& options) {
  WorkspaceOptions workspace = options.workspace;
  MOK_CHECK_ARG(options.fused.ring_rows >= 0, "fused.ring_rows", "must be >= 0, got ",
                options.fused.ring_rows);
  MOK_CHECK_ARG(options.fused.ring_rows == 0 || options.fused.ring_rows >= kMinRingRows,
                "fused.ring_rows", "the ring needs at least ", kMinRingRows,
                " rows (two row blocks), got ", options.fused.ring_rows);
  if (options.fused.enabled) {
    workspace.expert_rows = options.fused.ring_rows;
    workspace.expert_y = false;
  } else {
    workspace.expert_rows = 0;
    workspace.expert_y = true;
  }
  return workspace;
}

}  // namespace

const char* phase_name(ForwardPhase phase) {
  switch (phase) {
    case ForwardPhase::kSchedule:
      return "schedule";
    case ForwardPhase::kFused:
      return "fused";
    case ForwardPhase::kSharedExpert:
      return "shared-expert";
    case ForwardPhase::kDispatch:
      return "dispatch";
    case ForwardPhase::kGateUp:
      return "gate-up-swiglu";
    case ForwardPhase::kDown:
      return "down";
    case ForwardPhase::kCombinePush:
      return "combine-push";
    case ForwardPhase::kCombineReduce:
      return "combine-reduce";
  }
  return "unknown";
}

LayerForward::LayerForward(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                           const LayerForwardOptions& options)
    : shape_(shape),
      tokens_max_(tokens_max),
      options_(options),
      workspace_(comm, shape, tokens_max, workspace_options(options)) {
  shape.validate(comm.num_ranks());
  MOK_CHECK_ARG(shape.intermediate % 8 == 0, "shape.intermediate",
                "the SwiGLU GEMM needs a multiple of 8 (gate/up blocks), got ", shape.intermediate);
  MOK_CHECK_ARG(shape.shared_intermediate % 8 == 0, "shape.shared_intermediate",
                "must be a multiple of 8, got ", shape.shared_intermediate);
  MOK_CHECK_ARG(shape.hidden % 8 == 0, "shape.hidden", "must be a multiple of 8, got ",
                shape.hidden);
  const int64_t experts_local = workspace_.layout().experts_per_rank();
  const int64_t hidden = shape.hidden, inter = shape.intermediate;
  const int64_t shared_inter = shape.shared_intermediate;
  checked_int(workspace_.layout().rows_capacity(), "rows capacity");

  weights_.gate_up_elements = experts_local * 2 * inter * hidden;
  weights_.down_elements = experts_local * hidden * inter;
  if (options.allocate_weights) {
    weights_.gate_up = device_alloc<bf16>(weights_.gate_up_elements);
    weights_.down = device_alloc<bf16>(weights_.down_elements);
  }
  if (shape.has_shared()) {
    weights_.shared_gate_up_elements = 2 * shared_inter * hidden;
    weights_.shared_down_elements = hidden * shared_inter;
    if (options.allocate_weights) {
      weights_.shared_gate_up = device_alloc<bf16>(weights_.shared_gate_up_elements);
      weights_.shared_down = device_alloc<bf16>(weights_.shared_down_elements);
    }
    shared_hidden_ = device_alloc<bf16>(tokens_max * shared_inter);
    shared_output_ = device_alloc<float>(tokens_max * hidden);
    shared_offsets_ = device_alloc<int32_t>(2);
  }
  routed_hidden_ = device_alloc<bf16>(workspace_.layout().expert_rows * inter);
  num_sms_ = workspace_.num_sms();  // (a share of the GPU when ranks are emulated on it)
  // (emulated ranks' CTAs sit on any SMs: one ticket pool, or a partition none of them is on
  // would keep its tickets)
  if (options.fused.enabled && options.fused.l2_partition_tickets && !workspace_.shares_device()) {
    MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
    sm_partition_ = runtime::l2_partition_map().device_table;  // probed once per device
  }
}

LayerForward::~LayerForward() {
  for (void* memory : {static_cast<void*>(weights_.gate_up), static_cast<void*>(weights_.down),
                       static_cast<void*>(weights_.shared_gate_up),
                       static_cast<void*>(weights_.shared_down), static_cast<void*>(routed_hidden_),
                       static_cast<void*>(shared_hidden_), static_cast<void*>(shared_output_),
                       static_cast<void*>(shared_offsets_), static_cast<void*>(trace_)}) {
    cudaFree(memory);  // null is fine; errors here cannot be reported from a destructor
  }
}

void LayerForward::load_weights(const LayerWeights& weights) {
  MOK_CHECK_ARG(options_.allocate_weights, "load_weights",
                "this LayerForward was made with allocate_weights = false: pass the device "
                "weights to forward instead");
  validate_weights(shape_, workspace_.num_ranks(), weights);
  const int64_t experts_local = workspace_.layout().experts_per_rank();
  const int64_t hidden = shape_.hidden, inter = shape_.intermediate;
  upload_interleaved(weights_.gate_up, weights.gate.data, weights.up.data, experts_local, inter,
                     hidden);
  MOK_CUDA_CHECK(cudaMemcpy(weights_.down, weights.down.data,
                            static_cast<size_t>(weights_.down_elements) * sizeof(bf16),
                            cudaMemcpyHostToDevice));
  if (shape_.has_shared()) {
    upload_interleaved(weights_.shared_gate_up, weights.shared_gate.data, weights.shared_up.data, 1,
                       shape_.shared_intermediate, hidden);
    MOK_CUDA_CHECK(cudaMemcpy(weights_.shared_down, weights.shared_down.data,
                              static_cast<size_t>(weights_.shared_down_elements) * sizeof(bf16),
                              cudaMemcpyHostToDevice));
  }
}

int64_t LayerForward::buffer_bytes() const {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  int64_t bytes = layout.window_bytes + layout.local_bytes;
  bytes += layout.expert_rows * shape_.intermediate * 2;
  if (shape_.has_shared()) {
    bytes += tokens_max_ * (shape_.shared_intermediate * 2 + shape_.hidden * 4) + 8;
  }
  return bytes;
}

void LayerForward::check_device_weights(const DeviceLayerWeights& weights) const {
  const auto check = [](const bf16* data, int64_t elements, int64_t expected, const char* name) {
    MOK_CHECK_ARG(elements == expected, name, elements, " elements, the shape needs ", expected);
    MOK_CHECK_ARG(expected == 0 || data != nullptr, name, "null pointer for ", expected,
                  " elements");
  };
  check(weights.gate_up, weights.gate_up_elements, weights_.gate_up_elements, "weights.gate_up");
  check(weights.down, weights.down_elements, weights_.down_elements, "weights.down");
  check(weights.shared_gate_up, weights.shared_gate_up_elements, weights_.shared_gate_up_elements,
        "weights.shared_gate_up");
  check(weights.shared_down, weights.shared_down_elements, weights_.shared_down_elements,
        "weights.shared_down");
}

int LayerForward::trace_fields() { return megakernel::kTraceFields; }

void LayerForward::enable_trace() {
  if (trace_ != nullptr) return;
  trace_ = device_alloc<uint64_t>(static_cast<int64_t>(num_sms_) * trace_fields());
  MOK_CUDA_CHECK(cudaMemset(trace_, 0, static_cast<size_t>(num_sms_) * trace_fields() * 8));
}

std::vector<uint64_t> LayerForward::trace(cudaStream_t stream) const {
  if (trace_ == nullptr) return {};
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint64_t> host(static_cast<size_t>(fused_config().num_ctas) * trace_fields());
  MOK_CUDA_CHECK(cudaMemcpy(host.data(), trace_, host.size() * 8, cudaMemcpyDeviceToHost));
  return host;
}

int forward_shared_sms_beside_copy(const LayerForwardOptions& options, int num_sms) {
  if (!options.overlap_shared_with_dispatch) return 0;
  return gemm_sms_beside_copy(num_sms, options.copy.num_ctas, options.gemm.num_sms);
}

void LayerForward::run_shared_expert(const DeviceLayerWeights& weights, const bf16* x,
                                     int64_t num_tokens, cudaStream_t stream,
                                     const gemm::LaunchOptions& gemm_options) {
  const int tokens = checked_int(num_tokens, "num_tokens");
  const int hidden = static_cast<int>(shape_.hidden);
  const int shared_inter = static_cast<int>(shape_.shared_intermediate);
  write_single_group_offsets(shared_offsets_, tokens, stream);
  // (T, H) -> (T, I_s) bf16, SwiGLU in the epilogue.
  gemm::grouped_forward({1, tokens, 2 * shared_inter, hidden}, x, weights.shared_gate_up,
                        shared_offsets_, shared_hidden_, gemm::ForwardOutput::kSwiGluBf16, stream,
                        gemm_options);
  // (T, I_s) -> (T, H) fp32: the combine adds it before its one bf16 rounding.
  gemm::grouped_forward({1, tokens, hidden, shared_inter}, shared_hidden_, weights.shared_down,
                        shared_offsets_, shared_output_, gemm::ForwardOutput::kFp32, stream,
                        gemm_options);
}

void LayerForward::forward(const DeviceLayerWeights& weights, const bf16* x,
                           const int32_t* topk_idx, const float* topk_w, bf16* y,
                           int64_t num_tokens, cudaStream_t stream, const cudaEvent_t* phase_events,
                           const SavedContext* save) {
  check_device_weights(weights);
  if (save != nullptr) {
    MOK_CHECK_ARG(options_.fused.enabled, "save",
                  "save mode runs on the fused forward; the unfused composition keeps nothing");
  }
  check_saved_context(shape_, num_tokens, save, "save");
  check_forward_arguments(num_tokens, tokens_max_, x, topk_idx, topk_w, y);
  int recorded = 0;
  const std::function<void()> phase_done = [&] {
    if (phase_events != nullptr) MOK_CUDA_CHECK(cudaEventRecord(phase_events[recorded++], stream));
  };

  phase_done();
  if (!options_.fused.enabled) {
    stage_tokens(workspace_, x, num_tokens, stream);
    schedule(workspace_, topk_idx, num_tokens, stream);
    phase_done();
    phase_done();  // kFused: not run
    run_unfused(weights, x, topk_w, y, num_tokens, stream, phase_done);
    return;
  }
  const FusedForwardConfig config = fused_config();
  if (config.schedule_in_kernel) {
    // Three launches: begin_call, the fused kernel (schedule to combine push), the reduce.
    begin_call(workspace_, stream);
  } else {
    stage_tokens(workspace_, x, num_tokens, stream);
    schedule(workspace_, topk_idx, num_tokens, stream);
  }
  phase_done();  // kSchedule (in the kernel: begin_call only)
  FusedForwardBuffers buffers;
  buffers.gate_up = weights.gate_up;
  buffers.down = weights.down;
  buffers.shared_gate_up = weights.shared_gate_up;
  buffers.shared_down = weights.shared_down;
  buffers.routed_hidden = routed_hidden_;
  buffers.shared_hidden = shared_hidden_;
  buffers.shared_output = shared_output_;
  if (save != nullptr) {
    buffers.saved_gate_up = save->gate_up;
    buffers.saved_shared_gate_up = save->shared_gate_up;
  }
  fused_forward(workspace_, shape_, buffers, x, topk_idx, num_tokens, config, stream);
  phase_done();
  // kSharedExpert .. kCombinePush ran inside the fused kernel.
  for (int phase = static_cast<int>(ForwardPhase::kSharedExpert);
       phase < static_cast<int>(ForwardPhase::kCombineReduce); ++phase) {
    phase_done();
  }
  const bool has_shared = shape_.has_shared() && num_tokens > 0;
  combine_reduce(workspace_, topk_w, has_shared ? shared_output_ : nullptr, y, num_tokens, stream);
  phase_done();
}

void check_forward_arguments(int64_t num_tokens, int64_t tokens_max, const void* x,
                             const void* topk_idx, const void* topk_w, const void* y) {
  MOK_CHECK_ARG(num_tokens >= 0 && num_tokens <= tokens_max, "num_tokens", num_tokens,
                " out of range [0, ", tokens_max, "]");
  MOK_CHECK_ARG(
      num_tokens == 0 || (x != nullptr && topk_idx != nullptr && topk_w != nullptr && y != nullptr),
      "forward", "null x, topk_idx, topk_w or y for ", num_tokens, " tokens");
}

void check_saved_context(const LayerShape& shape, int64_t num_tokens, const SavedContext* context,
                         const char* name) {
  if (context == nullptr || num_tokens == 0) return;
  const std::string prefix(name);
  MOK_CHECK_ARG(context->gate_up != nullptr, prefix + ".gate_up", "null pre-activation buffer");
  MOK_CHECK_ARG(!shape.has_shared() || context->shared_gate_up != nullptr,
                prefix + ".shared_gate_up",
                "null shared pre-activation buffer (I_s = ", shape.shared_intermediate, ")");
}

int64_t saved_context_rows(int num_ranks, int64_t tokens_max, int64_t top_k, int64_t num_tokens) {
  return num_ranks == 1 ? num_tokens * top_k : num_ranks * tokens_max * top_k;
}

FusedForwardConfig LayerForward::fused_config() const {
  const FusedForwardOptions& fused = options_.fused;
  MOK_CHECK_ARG(fused.comm_ctas >= 0, "fused.comm_ctas", "must be >= 0, got ", fused.comm_ctas);
  MOK_CHECK_ARG(fused.minibatch_rows >= 0, "fused.minibatch_rows", "must be >= 0, got ",
                fused.minibatch_rows);
  FusedForwardConfig config;
  // 0: no communication CTAs; the producer warpgroups' spare warps of every CTA dispatch. Ahead
  // of the 8-32 communication CTAs the shapes had before on all four benchmark cases
  // (docs/perf-notes/layer.md).
  config.comm_ctas = fused.comm_ctas;
  config.num_ctas = options_.gemm.num_sms > 0
                        ? std::min(num_sms_, config.comm_ctas + options_.gemm.num_sms)
                        : num_sms_;
  // 8192: ahead of 2048 on all five benchmark cases (deepseek-v3 EP1 / EP2, qwen3-30b,
  // qwen3-235b, skewed) in alternated rounds (docs/perf-notes/layer.md).
  // A ring smaller than two minibatches cuts them to half the ring (ring_config).
  const int rows = fused.minibatch_rows > 0 ? fused.minibatch_rows : 8192;
  const RingBlocks ring =
      ring_config(workspace_.layout(), gemm::ceil_div(rows, gemm::TileConfig::BLOCK_M));
  config.minibatch_mblocks = ring.minibatch_mblocks;
  config.ring_mblocks = ring.ring_mblocks;
  config.schedule_in_kernel = fused.schedule_in_kernel;
  MOK_CHECK_ARG(fused.schedule_ctas >= 0, "fused.schedule_ctas", "must be >= 0, got ",
                fused.schedule_ctas);
  config.schedule_ctas =
      fused.schedule_ctas > 0
          ? std::clamp(fused.schedule_ctas, std::max(config.comm_ctas, 1), config.num_ctas)
          : config.num_ctas;
  config.trace = trace_;
  config.sm_partition = sm_partition_;  // null unless fused.l2_partition_tickets
  return config;
}

void LayerForward::run_unfused(const DeviceLayerWeights& weights, const bf16* x,
                               const float* topk_w, bf16* y, int64_t num_tokens,
                               cudaStream_t stream, const std::function<void()>& phase_done) {
  const comm::WorkspaceLayout& layout = workspace_.layout();
  const int experts_local = static_cast<int>(layout.experts_per_rank());
  const int rows = static_cast<int>(layout.rows_capacity());
  const int hidden = static_cast<int>(shape_.hidden);
  const int inter = static_cast<int>(shape_.intermediate);
  const bool has_shared = shape_.has_shared() && num_tokens > 0;
  // NOTE: beside it, the shared expert hides the dispatch, as the megakernel's task order will.
  shared_expert_and_dispatch(
      side_, stream, has_shared,
      has_shared ? forward_shared_sms_beside_copy(options_, num_sms_) : 0, options_.gemm,
      [&](const gemm::LaunchOptions& gemm_options) {
        run_shared_expert(weights, x, num_tokens, stream, gemm_options);
      },
      [&](cudaStream_t rows_stream, bool) { dispatch(workspace_, options_.copy, rows_stream); },
      phase_done);
  phase_done();
  // expert_x (rows, H) -> routed_hidden (rows, I): each expert's rows start at a tile boundary;
  // padding rows are computed but never combined.
  gemm::grouped_forward({experts_local, rows, 2 * inter, hidden}, workspace_.expert_x(),
                        weights.gate_up, workspace_.expert_offsets(), routed_hidden_,
                        gemm::ForwardOutput::kSwiGluBf16, stream, options_.gemm);
  phase_done();
  // routed_hidden (rows, I) -> expert_y (rows, H) bf16, the rows the combine moves.
  gemm::grouped_forward({experts_local, rows, hidden, inter}, routed_hidden_, weights.down,
                        workspace_.expert_offsets(), workspace_.expert_y(),
                        gemm::ForwardOutput::kBf16, stream, options_.gemm);
  phase_done();
  combine_push(workspace_, options_.copy, stream);
  phase_done();
  combine_reduce(workspace_, topk_w, has_shared ? shared_output_ : nullptr, y, num_tokens, stream);
  phase_done();
}

}  // namespace mok
