// The GPU backward of one MoE layer on one expert-parallel rank, composed from the tested engines
// (the communication steps of comm_ops.hpp, the grouped GEMMs of mok/gemm.hpp) and one SwiGLU
// backward kernel (kernels/megakernel/swiglu_backward.cuh). Two modes with the same bits:
// recompute (the context is the forward's inputs x, topk_idx, topk_w alone; the routed and shared
// gate/up pre-activations are computed again here) and save (the forward kept them: SavedContext,
// and both gate/up GEMMs below are skipped).
//
//   stage x, dy           into the window, for the expert ranks to pull
//   schedule              on-GPU all-gather of topk_idx, each local expert's rows in global order;
//                         topk_w into the window beside the ids, for the expert ranks to read
//   shared expert         gate/up (bf16) | down dgrad g (fp32) | SwiGLU backward | gate/up dgrad
//                         (fp32 dx, added by the combine) | both wgrads
//   dispatch x, dy        into expert_x and expert_dy (the same rows)
//   routed gate/up        recomputed, rounded to bf16 as a saved context holds it (rows, 2I);
//                         save mode: read from the context instead
//   routed down dgrad     g = W_downᵀ dy, fp32 (rows, I)
//   SwiGLU backward       d_topk_w = <g, h> into the owner's window; d_gate_up (bf16), w·h (bf16)
//   routed gate/up dgrad  dx rows (bf16) into expert_y
//   combine push          dx rows to their owners' slots (one rank alone: none)
//   wgrads                down: dyᵀ · (w·h); gate/up: d_gate_upᵀ · x, each over the expert's rows
//                         in global token order (the same K order at any EP degree)
//   combine reduce        dx = Σ_j slot_j (j in order, fp32) + shared dx, rounded once; in the
//                         same launch d_topk_w, collected from the window (0 for unused slots)
//
// One rank alone reads x and dy from the caller's tensors and keeps its expert rows of x, of dy
// and the dx rows in one region, in turn (kOneRankBackwardPhaseOrder): x's rows for the gate/up
// recompute first, dy's for the down dgrad and wgrad, the dx rows over them for the reduce, and
// x's rows again, over those, for the gate/up wgrad last (save mode: x's rows once). Where they
// hold it (k·I >= 2H), w·h's bytes take the shared expert's fp32 dx once the down wgrad has read
// them (shared_dx_in_weighted_hidden).
//
// Every GEMM reads only each expert's real rows (the schedule's counts), so the experts' rows need
// no padding to whole tiles (bf16_backward_workspace): a tile's rows past its expert's are the
// next expert's, which cost no MMA in the dgrads and wgrads (or are zeroed in a wgrad's last
// block) and never reach a result. Everything is enqueued on the caller's stream with no host
// synchronisation (CUDA-graph capturable).
// Construction and destruction are collective (see CommWorkspace).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "mok/bf16.hpp"
#include "mok/gemm.hpp"
#include "mok/layer.hpp"
#include "runtime/comm.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/layer_forward.hpp"
#include "runtime/side_stream.hpp"
#include "runtime/workspace.hpp"

namespace mok {
namespace megakernel {
struct SwiGluBackwardRows;
struct RoutedRowSet;
}  // namespace megakernel

struct LayerBackwardOptions {
  CopyConfig copy{32};         // dispatch and combine CTAs (as the unfused forward's)
  gemm::LaunchOptions gemm;    // expert GEMM grid; 0 SMs = every SM
  WorkspaceOptions workspace;  // (LayerBackward's rows are unpadded: bf16_backward_workspace)
  // Dispatch x and dy beside the shared expert's GEMMs (the copy CTAs on a side stream, the GEMMs
  // on the other SMs) instead of after them. Same bits either way; needs copy.num_ctas > 0.
  bool overlap_shared_with_dispatch = true;
  // At EP 1 the dispatch moves rows within this GPU's memory only: it runs after the shared
  // expert's GEMMs (not beside them, whatever overlap_shared_with_dispatch says) and copies on
  // every SM instead of copy.num_ctas. Same bits either way.
  bool local_dispatch_on_every_sm = true;
  // Rows the routed chain's buffers hold. 0 (the default): every routed row at once. Else the
  // routed experts run in chunks of whole experts of at most this many rows (at least tokens_max:
  // an expert gets up to T rows), so that the buffers hold the combine's slots and one chunk's
  // rows instead of every row's intermediates (perf-notes/backward.md); the same bits, for more
  // launches. One rank alone (EP 1); a chunked backward takes no phase marks.
  int64_t chunk_rows = 0;
};

// The chunk the low-memory backward takes for a layer of tokens_max tokens: 1.5 T_max rows, at
// most ceil(2k) chunks (perf-notes/backward.md).
inline int64_t low_memory_chunk_rows(int64_t tokens_max) { return tokens_max + tokens_max / 2; }

// Weight gradients in the layouts of DeviceLayerWeights (gate/up interleaved in blocks of 8
// rows): fresh fp32, fresh bf16 (what autograd gives bf16 parameters; the fp32 sums rounded once),
// or fp32 main_grad buffers added into. Shared ones null when I_s = 0.
struct DeviceLayerGradients {
  void* gate_up = nullptr;         // (E_l, 2I, H)
  void* down = nullptr;            // (E_l, H, I)
  void* shared_gate_up = nullptr;  // (2I_s, H)
  void* shared_down = nullptr;     // (H, I_s)
  gemm::WgradOutput output = gemm::WgradOutput::kFp32;
};

// The steps of one backward, for a per-phase timing breakdown.
enum class BackwardPhase : int {
  kSchedule = 0,    // x, dy, topk_w into the window; the schedule
  kSharedExpert,    // the shared expert's recompute, dgrads, SwiGLU backward and wgrads
                    // (with the overlap: beside the dispatch; its dx dgrad in kGateUpDgrad when
                    // shared_dx_in_weighted_hidden)
  kDispatch,        // x and dy rows to the experts (with the overlap: what it takes beyond
                    // the shared expert); one rank alone: dy's
  kDispatchX,       // one rank alone: x's rows, for the gate/up wgrad (else in kDispatch)
  kGateUp,          // routed gate/up recomputed (bf16; nothing in save mode; one rank alone:
                    // with its x rows, dispatched first)
  kDownDgrad,       // g = W_downᵀ dy (fp32)
  kSwiGluBackward,  // d_topk_w, d_gate_up, w·h
  kGateUpDgrad,     // dx rows (and the shared expert's dx, see kSharedExpert)
  kCombinePush,
  kWgradDown,
  kWgradGateUp,
  kCombineReduce,  // dx, d_topk_w
};
inline constexpr int kNumBackwardPhases = 12;
const char* phase_name(BackwardPhase phase);
// The order a backward runs its phases in (its phase marks follow it): the enum's, or, at one
// rank, where x's, dy's, the dx and x's rows again take expert_dy's bytes in turn
// (WorkspaceOptions::rows_in_expert_dy): the gate/up recompute (on x's rows) first, the down
// wgrad before the gate/up dgrad (whose dx rows go over dy's), the reduce before x's rows go over
// the dx rows, and the gate/up wgrad on them last.
using BackwardPhaseOrder = std::array<BackwardPhase, kNumBackwardPhases>;
inline constexpr BackwardPhaseOrder kBackwardPhaseOrder = {
    BackwardPhase::kSchedule,       BackwardPhase::kSharedExpert, BackwardPhase::kDispatch,
    BackwardPhase::kDispatchX,      BackwardPhase::kGateUp,       BackwardPhase::kDownDgrad,
    BackwardPhase::kSwiGluBackward, BackwardPhase::kGateUpDgrad,  BackwardPhase::kCombinePush,
    BackwardPhase::kWgradDown,      BackwardPhase::kWgradGateUp,  BackwardPhase::kCombineReduce};
inline constexpr BackwardPhaseOrder kOneRankBackwardPhaseOrder = {
    BackwardPhase::kSchedule,      BackwardPhase::kGateUp,      BackwardPhase::kSharedExpert,
    BackwardPhase::kDispatch,      BackwardPhase::kDownDgrad,   BackwardPhase::kSwiGluBackward,
    BackwardPhase::kWgradDown,     BackwardPhase::kGateUpDgrad, BackwardPhase::kCombinePush,
    BackwardPhase::kCombineReduce, BackwardPhase::kDispatchX,   BackwardPhase::kWgradGateUp};

// The rows a routed expert gets in a call of num_tokens tokens, on average (T k / E_l, every rank
// taken to hold T tokens), for kAuto's engine choice (gemm::LaunchOptions::group_rows): not the
// workspace's capacity, which a larger max_tokens_per_rank inflates.
int routed_group_rows(const comm::WorkspaceLayout& layout, int64_t num_tokens);

// A backward's workspace: every row at once, expert_y for the dx rows, the backward's regions.
WorkspaceOptions backward_workspace(const LayerBackwardOptions& options);
// LayerBackward's: each expert's rows unpadded (block_m 1, whatever options.workspace says: every
// GEMM reads an expert's rows wherever they start and stops at its count); one rank alone has no
// expert_y (the gate/up dgrad writes each dx row straight into its slot), and dy's, the dx and
// x's rows share expert_dy (rows_in_expert_dy).
WorkspaceOptions bf16_backward_workspace(const LayerBackwardOptions& options, int num_ranks);
// Whether one rank's shared expert keeps its dx (T_max, H) fp32 in w·h's bytes (rows_capacity, I)
// bf16, which are dead once the down wgrad has read them: one rank alone (rows_in_expert_dy), with
// room (k·I >= 2H). Its dx dgrad then runs after the down wgrad, in the gate/up dgrad's phase.
bool shared_dx_in_weighted_hidden(const LayerShape& shape, const comm::WorkspaceLayout& layout);
// A chunked backward's routed buffers (LayerBackwardOptions::chunk_rows): one chunk's expert rows
// (x's or dy's, bf16), g (fp32; then d_gate_up in its bytes) and w·h (bf16), each `rows` rows,
// in one allocation; where it holds the shared expert's dx (T_max, H) fp32, that goes there after
// the last chunk (shared_dx_in_chunk).
struct ChunkBuffers {
  int64_t rows_offset = 0, grad_hidden_offset = 0, weighted_hidden_offset = 0, bytes = 0;
  static ChunkBuffers make(const LayerShape& shape, int64_t rows);
};
bool shared_dx_in_chunk(const LayerShape& shape, int64_t tokens_max, int64_t chunk_rows);

// The steps the bf16 and fp8 backwards share (layer_backward_steps.cu; each on `stream`, no host
// synchronisation):
// topk_w, and x and dy where peers pull them (EP > 1: one rank alone reads the caller's x and dy
// where they lie), into the window and the schedule ...
void stage_backward_inputs(CommWorkspace& workspace, const bf16* x, const int32_t* topk_idx,
                           const float* topk_w, const bf16* dy, int64_t num_tokens,
                           cudaStream_t stream);
// ... (no token) the shared expert's gradients zero, unless they accumulate ...
void zero_shared_gradients(const LayerShape& shape, const DeviceLayerGradients& grads,
                           cudaStream_t stream);
// (count) floats of 1.0f (the reduce's weights for dx: exact), made synchronously.
float* make_ones(int64_t count, int device);
// The arguments every backward takes, with errors that name them (nothing is enqueued).
void check_backward_arguments(const LayerShape& shape, int64_t tokens_max, int64_t num_tokens,
                              const void* x, const int32_t* topk_idx, const float* topk_w,
                              const void* dy, const void* dx, const float* d_topk_w,
                              const DeviceLayerGradients& grads);
// The backward's GEMM options on `comm`: with ranks emulated on one GPU, single-CTA wgrads unless
// the caller chose a cluster (clusters can find no free GPC beside the waiting ranks' kernels).
gemm::LaunchOptions wgrads_for_ranks_on_device(const Communicator& comm, gemm::LaunchOptions gemm);
// The SMs the shared expert's GEMMs get beside the dispatch's copy CTAs; 0: one after the other
// (LayerBackwardOptions' overlap_shared_with_dispatch and local_dispatch_on_every_sm).
int backward_shared_sms_beside_copy(const LayerBackwardOptions& options, int num_sms,
                                    int num_ranks);

// The dispatch of x and dy rows (beside the shared expert: on options.copy's CTAs; else at EP 1,
// with local_dispatch_on_every_sm, on every SM), for shared_expert_and_dispatch (side_stream.hpp);
// one rank alone copies its rows by token from the caller's x and dy (T, H) (dispatch_tokens).
void dispatch_x_and_dy(CommWorkspace& workspace, const LayerBackwardOptions& options,
                       cudaStream_t stream, bool beside, const bf16* x, const bf16* dy);

class LayerBackward {
 public:
  // tokens_max: the most tokens any call passes on any rank (the same on every rank).
  LayerBackward(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                const LayerBackwardOptions& options = {});
  ~LayerBackward();
  LayerBackward(const LayerBackward&) = delete;
  LayerBackward& operator=(const LayerBackward&) = delete;

  // x, dy, dx (T, H) bf16; topk_idx (T, k) int32; topk_w, d_topk_w (T, k) fp32: device pointers
  // on this rank's GPU, T <= tokens_max, the same routing as the forward. Every rank calls it
  // with the same options. phase_events, when given: kNumBackwardPhases + 1 events, recorded on
  // the stream before the first phase and after each one, in phase_order(). saved: the context
  // the forward of these tokens kept (save mode), or null (recompute mode); the gate/up phase then
  // takes no time.
  // The first recompute-mode call allocates that mode's buffers (recompute_bytes; the device
  // synchronises once, so make it before capturing a graph); save mode never needs them.
  void backward(const DeviceLayerWeights& weights, const bf16* x, const int32_t* topk_idx,
                const float* topk_w, const bf16* dy, bf16* dx, float* d_topk_w,
                const DeviceLayerGradients& grads, int64_t num_tokens, cudaStream_t stream,
                const cudaEvent_t* phase_events = nullptr, const SavedContext* saved = nullptr);

  // Makes recompute mode's buffers now (synchronous), which the first recompute-mode call does
  // otherwise; a no-op once made.
  void allocate_recompute_buffers();

  // Waits for `stream` and throws mok::Error naming rank, phase and cause of a device fault.
  void check(cudaStream_t stream) const { workspace_.check(stream); }
  CommWorkspace& workspace() { return workspace_; }
  const LayerShape& shape() const { return shape_; }
  int64_t tokens_max() const { return tokens_max_; }
  const BackwardPhaseOrder& phase_order() const {
    return workspace_.layout().rows_in_expert_dy ? kOneRankBackwardPhaseOrder : kBackwardPhaseOrder;
  }
  // Device bytes this object holds (workspace and intermediates; recompute mode's buffers once
  // a recompute-mode call made them).
  int64_t buffer_bytes() const;
  // The same for a layer of `shape` on one of `num_ranks` ranks, before making one; recompute:
  // with recompute mode's buffers.
  static int64_t buffer_bytes(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                              const LayerBackwardOptions& options = {}, bool recompute = true);
  // Recompute mode's own buffers (the gate/up pre-activations of `rows` routed rows and of
  // tokens_max tokens of the shared expert, bf16).
  static int64_t recompute_bytes(const LayerShape& shape, int64_t rows, int64_t tokens_max);

 private:
  // saved_gate_up: the shared expert's saved pre-activations, or null (recompute them). Its dx
  // dgrad too, unless shared_dx_after_wgrad_down.
  void run_shared_expert(const DeviceLayerWeights& weights, const bf16* x, const bf16* dy,
                         const bf16* saved_gate_up, const DeviceLayerGradients& grads, int tokens,
                         cudaStream_t stream, const gemm::LaunchOptions& gemm_options);
  // Whether the shared expert's dx lives in the routed chain's bytes (w·h's:
  // shared_dx_in_weighted_hidden; a chunked backward's: shared_dx_in_chunk), so that its dgrad
  // waits for the down wgrad (of the last chunk).
  bool shared_dx_after_wgrad_down() const {
    return shared_dx_deferred(shape_, workspace_.layout(), options_);
  }
  static bool shared_dx_deferred(const LayerShape& shape, const comm::WorkspaceLayout& layout,
                                 const LayerBackwardOptions& options);
  // The shared expert's dx (fp32, for the reduce) from its d_gate_up.
  void shared_dx_dgrad(const DeviceLayerWeights& weights, int tokens, cudaStream_t stream,
                       const gemm::LaunchOptions& gemm_options);
  // The routed gate/up pre-activations again, from expert_x into gate_up_ (recompute mode).
  // group_rows: the rows a routed expert gets in this call (gemm::LaunchOptions::group_rows).
  void recompute_gate_up(const DeviceLayerWeights& weights, int group_rows, cudaStream_t stream);
  // Every routed step after the dispatch and the gate/up recompute, the reduce (reduce(): dx and
  // d_topk_w) included, in phase_order(); x: the caller's, whose rows one rank alone dispatches
  // again before the gate/up wgrad. mark(): the end of a phase (an event when the caller asked
  // for them).
  // group_rows: as for recompute_gate_up. saved_gate_up: the routed rows' saved pre-activations
  // (by source), or null (recompute them).
  // shared_dx(): one rank alone, between the down wgrad and the gate/up dgrad (the shared
  // expert's dx dgrad, when its dx lives in w·h's bytes).
  template <class SharedDx, class Reduce, class Mark>
  void run_routed_experts(const DeviceLayerWeights& weights, const bf16* x, int group_rows,
                          const bf16* saved_gate_up, const DeviceLayerGradients& grads,
                          const SharedDx& shared_dx, const Reduce& reduce, cudaStream_t stream,
                          const Mark& mark);

  // The routed chain a chunk of whole experts at a time (LayerBackwardOptions::chunk_rows), every
  // step after the schedule and the shared expert but the shared dx and the reduce
  // (layer_backward_chunks.cu).
  void run_routed_chunks(const DeviceLayerWeights& weights, const bf16* x, const bf16* dy,
                         const bf16* saved_gate_up, const DeviceLayerGradients& grads,
                         int64_t num_tokens, cudaStream_t stream);
  // The routed rows the buffers below hold: rows_capacity, or a chunk's (chunk_rows).
  int64_t routed_buffer_rows() const;
  // The SwiGLU backward's buffers over the routed rows (saved_gate_up: save mode's context, else
  // the recomputed pre-activations).
  megakernel::SwiGluBackwardRows routed_swiglu_rows(const bf16* saved_gate_up) const;
  // The SwiGLU backward of the set's routed rows (megakernel/swiglu_backward.cuh).
  void swiglu_backward_routed(const CommWorkspace& workspace,
                              const megakernel::SwiGluBackwardRows& rows,
                              const megakernel::RoutedRowSet& set, cudaStream_t stream) const;

  LayerShape shape_;
  int64_t tokens_max_ = 0;
  LayerBackwardOptions options_;
  CommWorkspace workspace_;
  int num_sms_ = 0;
  SideStream side_;  // the dispatch, when it overlaps the shared expert
  // Routed rows (rows_capacity of the workspace):
  bf16* gate_up_ = nullptr;          // (rows, 2I) bf16, recomputed, interleaved (recompute mode)
  float* grad_hidden_ = nullptr;     // (rows, I) fp32, g = W_downᵀ dy
  bf16* d_gate_up_ = nullptr;        // (rows, 2I) bf16, interleaved: in g's bytes (see below)
  bf16* weighted_hidden_ = nullptr;  // (rows, I) bf16, w · h
  float* ones_ = nullptr;            // (T_max, k) 1.0f: the reduce's weights for dx
  // Shared expert (T_max rows; null without one):
  bf16* shared_gate_up_ = nullptr;       // (T_max, 2I_s) bf16 (recompute mode)
  float* shared_grad_hidden_ = nullptr;  // (T_max, I_s) fp32
  bf16* shared_d_gate_up_ = nullptr;     // (T_max, 2I_s) bf16, in shared_grad_hidden_'s bytes
  bf16* shared_hidden_ = nullptr;        // (T_max, I_s) bf16
  float* shared_dx_ = nullptr;           // (T_max, H) fp32; one rank alone, in w·h's bytes
                                         // when they hold it (shared_dx_after_wgrad_down)
  int32_t* shared_offsets_ = nullptr;    // (2): 0, T of the current call
  // Chunked (options_.chunk_rows > 0): the chunk's buffers (ChunkBuffers; g and w·h above point
  // into it) and the current chunk's tables (megakernel::ExpertChunk).
  char* chunk_buffers_ = nullptr;
  bf16* chunk_rows_ = nullptr;  // (chunk_rows, H) bf16: dy's, then x's rows
  int32_t* chunk_tables_ = nullptr;
};

}  // namespace mok
