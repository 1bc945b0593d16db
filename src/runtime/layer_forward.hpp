// The unfused GPU forward of one MoE layer on one expert-parallel rank, composed from the tested
// engines: the communication steps of comm_ops.hpp and the grouped GEMMs of mok/gemm.hpp.
//
//   stage_tokens, schedule    x into the window, on-GPU all-gather of topk_idx, row order
//   shared gate/up + down     the shared expert as a one-expert group over this rank's tokens,
//                             fp32 output; enqueued before dispatch (hides the peers' skew)
//   dispatch                  pull the routed rows into expert_x (global token order)
//   routed gate/up (SwiGLU)   expert_x -> hidden (rows, I) bf16
//   routed down               hidden -> expert_y (rows, H) bf16
//   combine_push, _reduce     rows to their owners' slots; y = shared + Σ_j w_j · slot_j
//
// Everything is enqueued on the caller's stream with no host synchronisation, so a forward can be
// captured in a CUDA graph. This is the composition the fused megakernel (issue 5) must match
// bitwise. Construction and destruction are collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "mok/bf16.hpp"
#include "mok/gemm.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/fused_forward.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {

// The fused path: one persistent kernel runs dispatch, the shared and routed expert GEMMs and the
// combine push (kernels/megakernel). 0 picks the default.
struct FusedForwardOptions {
  bool enabled = true;  // off: the unfused composition (reference for the fused kernel's bits)
  // CTAs that dispatch before they compute; 0 (default): none, three otherwise idle warps of
  // every CTA's producer warpgroup dispatch beside its tiles (docs/perf-notes/layer.md).
  int comm_ctas = 0;
  int minibatch_rows = 0;  // routed rows per minibatch of gate/up then down tiles; default 8192
  // Rows of the ring that holds the dispatched rows and their hidden rows: 0 = every row a call
  // can route to this rank (R * T_max * k + padding; never a second round). Fewer bound the
  // memory: the rows then go through the ring in rounds, any routing still fits (>= 256; the
  // minibatch shrinks to at most half the ring). Fixed at construction.
  int64_t ring_rows = 0;
  // The fused kernel makes the schedule (three launches per forward: begin_call, the kernel, the
  // reduce); off: the schedule's own kernels run before it (seven). Same bits either way.
  bool schedule_in_kernel = true;
  // CTAs that make the schedule in the kernel, at least comm_ctas; the others start on the shared
  // expert's gate/up tiles meanwhile. 0 = every CTA. Same bits whatever the value.
  int schedule_ctas = 0;
  // Hand consecutive tasks to the CTAs of one L2 partition at a time (kernels/megakernel/
  // tickets.cuh), from a map of the GPU's SMs probed at construction (runtime/l2_partitions.hpp);
  // off: one pool for every CTA. Same bits either way.
  bool l2_partition_tickets = true;
};

struct LayerForwardOptions {
  CopyConfig copy{
      32};  // dispatch and combine CTAs: 32 reach the NVLink ceiling (perf-notes/comm.md)
  gemm::LaunchOptions gemm;  // expert GEMM grid; 0 SMs = every SM
  WorkspaceOptions workspace;
  // Run the dispatch beside the shared expert's GEMMs (copy CTAs on a side stream, the GEMMs on
  // the other SMs) instead of after them. Same bits either way; needs copy.num_ctas > 0.
  bool overlap_shared_with_dispatch = true;
  // Allocate device weights for load_weights. Off when every call brings the caller's weights
  // (forward(weights, ...)), e.g. a torch module's parameters: no second copy on the GPU.
  bool allocate_weights = true;
  FusedForwardOptions fused;
};

// Device weights of one rank, in the layouts the GEMM engine reads.
struct DeviceLayerWeights {
  bf16* gate_up = nullptr;         // (E_l, 2I, H), gate/up interleaved in blocks of 8 rows
  bf16* down = nullptr;            // (E_l, H, I)
  bf16* shared_gate_up = nullptr;  // (1, 2I_s, H), interleaved; null when I_s = 0
  bf16* shared_down = nullptr;     // (1, H, I_s)

  int64_t gate_up_elements = 0, down_elements = 0;
  int64_t shared_gate_up_elements = 0, shared_down_elements = 0;
};

// Save mode: what the forward keeps for the backward (DESIGN §3), in buffers the caller owns (a
// torch context, say) until that backward has run: the gate/up pre-activations (the gate/up GEMM's
// fp32 sums rounded to bf16, gate and up columns interleaved in blocks of 8), which the backward
// would otherwise recompute. The same bits either way.
struct SavedContext {
  // (saved_context_rows, 2I): row (src_rank * T_max + t) * k + j holds the routed row of token t,
  // slot j of rank src_rank that this rank's expert computed (rows of unused slots, and of slots
  // other ranks served, are not written). At EP > 1 the backward that reads it must have the
  // forward's T_max (tokens_max), as GpuLayer and the torch workspaces do.
  bf16* gate_up = nullptr;
  bf16* shared_gate_up = nullptr;  // (T, 2I_s) by token; null without a shared expert
};
// Rows of SavedContext::gate_up for a call of num_tokens tokens on one of num_ranks ranks: at
// EP 1, num_tokens * k (every row is this rank's own); at EP > 1, R * T_max * k.
int64_t saved_context_rows(int num_ranks, int64_t tokens_max, int64_t top_k, int64_t num_tokens);
// Throws mok::Error naming `name`.gate_up or `name`.shared_gate_up when a call of num_tokens > 0
// tokens passes a context (context non-null) without a buffer the shape needs.
void check_saved_context(const LayerShape& shape, int64_t num_tokens, const SavedContext* context,
                         const char* name);

// The steps of one forward, for a per-phase timing breakdown. The unfused path runs kSchedule to
// kCombineReduce but kFused; the fused one kSchedule, kFused, kCombineReduce (the phases a path
// does not run take no time).
enum class ForwardPhase : int {
  kSchedule = 0,  // stage_tokens + schedule
  kFused,         // the fused kernel: dispatch, expert GEMMs and combine push (fused path only)
  kSharedExpert,  // shared gate/up + down GEMMs (empty without a shared expert)
  kDispatch,      // with the overlap: only what the dispatch takes beyond the shared GEMMs
  kGateUp,        // routed gate/up GEMM with SwiGLU
  kDown,          // routed down GEMM
  kCombinePush,
  kCombineReduce,
};
inline constexpr int kNumForwardPhases = 8;
const char* phase_name(ForwardPhase phase);

// The SMs an unfused forward's shared-expert GEMMs get beside the dispatch's copy CTAs on a GPU
// (or share) of num_sms SMs; 0 = no overlap (LayerForwardOptions::overlap_shared_with_dispatch).
int forward_shared_sms_beside_copy(const LayerForwardOptions& options, int num_sms);

// Throws mok::Error naming the argument unless 0 <= num_tokens <= tokens_max and, when there are
// tokens, x, topk_idx, topk_w and y are given: what every layer forward checks first.
void check_forward_arguments(int64_t num_tokens, int64_t tokens_max, const void* x,
                             const void* topk_idx, const void* topk_w, const void* y);

class LayerForward {
 public:
  // tokens_max: the most tokens any call passes on any rank (the same on every rank).
  LayerForward(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
               const LayerForwardOptions& options = {});
  ~LayerForward();
  LayerForward(const LayerForward&) = delete;
  LayerForward& operator=(const LayerForward&) = delete;

  // Copies this rank's weights (host, the layouts of LayerWeights) to the device, interleaving
  // gate and up on the way (strided copies, no host copy of the weights). Synchronous.
  void load_weights(const LayerWeights& weights);
  // The device weights, e.g. for a benchmark that fills them on the device.
  const DeviceLayerWeights& device_weights() const { return weights_; }

  // x (T, H) bf16, topk_idx (T, k) int32, topk_w (T, k) fp32, y (T, H) bf16: device pointers on
  // this rank's GPU; T <= tokens_max. Every rank calls it with the same options.
  // phase_events, when given: kNumForwardPhases + 1 events, recorded on the stream before the
  // first phase and after each one. save, when given: save mode (SavedContext; fused path only).
  void forward(const bf16* x, const int32_t* topk_idx, const float* topk_w, bf16* y,
               int64_t num_tokens, cudaStream_t stream, const cudaEvent_t* phase_events = nullptr,
               const SavedContext* save = nullptr) {
    forward(weights_, x, topk_idx, topk_w, y, num_tokens, stream, phase_events, save);
  }
  // The same with the caller's device weights in the layouts of DeviceLayerWeights (e.g. a torch
  // module's parameters) instead of the ones load_weights copied; they must stay unchanged until
  // the stream has run the forward. The element counts are checked against the shape.
  void forward(const DeviceLayerWeights& weights, const bf16* x, const int32_t* topk_idx,
               const float* topk_w, bf16* y, int64_t num_tokens, cudaStream_t stream,
               const cudaEvent_t* phase_events = nullptr, const SavedContext* save = nullptr);

  // Waits for `stream` and throws mok::Error naming rank, phase and cause of a device fault.
  void check(cudaStream_t stream) const { workspace_.check(stream); }

  const LayerForwardOptions& options() const { return options_; }
  CommWorkspace& workspace() { return workspace_; }
  const LayerShape& shape() const { return shape_; }
  // (expert_rows, I): the routed gate/up tiles' output, the down tiles' input (a ring like
  // expert_x on the fused path).
  bf16* routed_hidden() const { return routed_hidden_; }
  int64_t tokens_max() const { return tokens_max_; }
  // Device bytes this object holds besides the weights (workspace and intermediates).
  int64_t buffer_bytes() const;

  // From now on the fused kernel records a per-CTA timeline (kernels/megakernel/trace.cuh).
  void enable_trace();
  // The last fused forward's timeline: (CTAs, fields) globaltimer values and sums; waits for
  // `stream`. Empty when tracing is off.
  std::vector<uint64_t> trace(cudaStream_t stream) const;
  static int trace_fields();

 private:
  void run_shared_expert(const DeviceLayerWeights& weights, const bf16* x, int64_t num_tokens,
                         cudaStream_t stream, const gemm::LaunchOptions& gemm_options);
  void check_device_weights(const DeviceLayerWeights& weights) const;
  void run_unfused(const DeviceLayerWeights& weights, const bf16* x, const float* topk_w, bf16* y,
                   int64_t num_tokens, cudaStream_t stream,
                   const std::function<void()>& phase_done);
  // The fused kernel's grid, split and minibatch from the options and this GPU.
  FusedForwardConfig fused_config() const;

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerForwardOptions options_;
  CommWorkspace workspace_;
  DeviceLayerWeights weights_;
  bf16* routed_hidden_ = nullptr;          // (expert_rows, I)
  bf16* shared_hidden_ = nullptr;          // (T_max, I_s)
  float* shared_output_ = nullptr;         // (T_max, H)
  int32_t* shared_offsets_ = nullptr;      // (2): 0, T of the current call
  int num_sms_ = 0;                        // of this rank's GPU
  uint64_t* trace_ = nullptr;              // (num_sms_, trace_fields()) when tracing
  const uint8_t* sm_partition_ = nullptr;  // L2 partition by %smid (l2_partitions.hpp), or null
  SideStream side_;                        // the dispatch, when it overlaps the shared expert
};

}  // namespace mok
