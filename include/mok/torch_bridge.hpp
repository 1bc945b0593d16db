// The torch extension's one door into the C++ core: plain pointers, sizes and ints in, no mok or
// torch types across it. The torch ops (ops.cpp, cuda_ops.cpp) include only this header, so they
// can be compiled against torch alone and linked with core libraries built elsewhere (a prebuilt
// build folder, see the MOK_BUILD_TORCH block of CMakeLists.txt): the core's own headers and
// struct layouts never have to match between the two builds.
//
// Every core error arrives as CoreError carrying the core's message ("topk_idx: expert id 99 out
// of range [0, 8) at token 5, slot 0"); the ops turn it into a Python exception.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mok::torch_bridge {

class CoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One layer's shape as the core sees it: E is the global expert count.
struct Shape {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t shared_intermediate = 0;  // 0 = no shared expert
  int64_t num_experts = 0;
  int64_t top_k = 0;
};

// A contiguous host tensor: data and sizes (sizes are checked by the core against the shape).
struct HostTensor {
  const void* data = nullptr;
  std::vector<int64_t> sizes;
};

// ---- CPU backend (the reference), one rank ------------------------------------------------------

// bf16 tensors are passed as their 16-bit patterns. gate/up are the separate (E, I, H) layouts.
struct CpuLayerInputs {
  HostTensor x;                                    // (T, H) bf16
  HostTensor topk_idx;                             // (T, k) int32
  HostTensor topk_w;                               // (T, k) fp32
  HostTensor gate, up, down;                       // (E, I, H), (E, I, H), (E, H, I) bf16
  HostTensor shared_gate, shared_up, shared_down;  // (I_s, H), (I_s, H), (H, I_s); empty = none
  HostTensor dy;                                   // (T, H) bf16, backward only
  // The precision mode: "bf16", "fp8" or "mxfp8" (mok/precision.hpp; the FP8 modes need H, I and
  // I_s multiples of their block). Checked by the core.
  std::string precision = "bf16";
};

// Fresh fp32 weight gradients in the separate layouts; shared ones null when there is none.
struct CpuLayerGradients {
  void* dx = nullptr;         // (T, H) bf16
  float* d_topk_w = nullptr;  // (T, k)
  float* gate = nullptr;
  float* up = nullptr;
  float* down = nullptr;
  float* shared_gate = nullptr;
  float* shared_up = nullptr;
  float* shared_down = nullptr;
};

void cpu_forward(const Shape& shape, const CpuLayerInputs& inputs, void* y);
void cpu_backward(const Shape& shape, const CpuLayerInputs& inputs, const CpuLayerGradients& grads);

// ---- GPU layer (LayerForward), one rank of EP --------------------------------------------------

// The smallest ring of received rows the GPU layer takes (MoKConfig.ring_rows): two row blocks.
int64_t min_ring_rows();

// True when the core was built with CUDA (and, for EP > 1, NCCL).
bool have_gpu_layer();
bool have_nccl();

// ncclGetUniqueId's bytes: rank 0 makes it, every rank of the group passes it to create_workspace.
std::vector<uint8_t> nccl_unique_id();

struct WorkspaceSpec {
  Shape shape;             // E global
  int64_t tokens_max = 0;  // the most tokens any call passes on any rank (same on every rank)
  int device = 0;
  int rank = 0, num_ranks = 1;
  std::vector<uint8_t> unique_id;  // nccl_unique_id() of rank 0; empty when num_ranks == 1
  int copy_ctas = 0;       // communication CTAs (fused kernel and unfused copies); 0 = default
  int minibatch_rows = 0;  // the fused kernel's routed rows per minibatch; 0 = default
  int64_t ring_rows = 0;   // the fused kernel's ring of received rows; 0 = every row, one round
  // The bf16 backward in chunks of whole experts (LayerBackwardOptions::chunk_rows, 1.5 T_max
  // rows): less memory, the same bits. One rank alone.
  bool low_memory_backward = false;
};

// Collective when num_ranks > 1 (every rank at once): makes the NCCL communicator from the unique
// id (ncclCommInitRank) and the layer's workspace. Returns a handle > 0.
int64_t create_workspace(const WorkspaceSpec& spec);
// Collective when num_ranks > 1. Frees the workspace and its communicator.
void destroy_workspace(int64_t handle);

// Device pointers in the GPU layer's layouts: gate/up interleaved in blocks of 8 rows.
struct DeviceWeights {
  const void* gate_up = nullptr;         // (E_l, 2I, H) bf16
  const void* down = nullptr;            // (E_l, H, I)
  const void* shared_gate_up = nullptr;  // (2I_s, H); null when I_s = 0
  const void* shared_down = nullptr;     // (H, I_s)
};

struct ForwardCall {
  // The layer as this call's tensors describe it; num_experts counts the LOCAL experts
  // (w_gate_up's first dimension). Checked against the workspace's shape.
  Shape local_shape;
  DeviceWeights weights;
  const void* x = nullptr;            // (T, H) bf16
  const int32_t* topk_idx = nullptr;  // (T, k) global expert ids
  const float* topk_w = nullptr;      // (T, k)
  void* y = nullptr;                  // (T, H) bf16
  // Save mode: the gate/up pre-activations kept for backward (saved_context_rows(..) x 2I and
  // T x 2I_s bf16), or null (recompute mode; the shared one null without a shared expert).
  void* saved_gate_up = nullptr;
  void* saved_shared_gate_up = nullptr;
  int64_t num_tokens = 0;
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
  // "bf16", "fp8" or "mxfp8". The FP8 modes' saved context has bf16's rows (fp8: its sums in the
  // fp8 weight cache's column order; mxfp8: bf16's), and they read the weights from the
  // workspace's weight cache of their mode (see the fp8 weight cache below; mxfp8's alike).
  std::string precision = "bf16";
  int64_t weights_version = -1;
};

// The fp8 weight cache: each workspace holds one cache of its layer's weights quantized 128 x 128,
// in the forward's layout and the backward dgrads' transposed one, which the fp8 forward and the
// fp8 backward both read. A call (forward or backward) quantizes it anew from the weights it
// passes when they are not the ones the cache was made from: when a weight's address differs from
// the last fp8 call's on that workspace, or weights_version does (the sum of the weights' version
// counters, which every in-place change raises), or either call's weights_version is -1 (unknown:
// every call quantizes). So a backward always differentiates the layer at the weights passed to it:
// within one autograd step those are the forward's (the same tensors, unchanged), and the backward
// reads the forward's cache as it is; weights changed in place in between, or another layer's
// fp8 call on the same workspace, make it quantize them again (the same bytes a forward would).
// The caller keeps the weights of the last call alive (the torch ops do), so that a new tensor
// cannot take a cached one's address unnoticed.

// Rows of ForwardCall::saved_gate_up for this call (T * k at EP 1, R * T_max * k at EP > 1).
int64_t saved_context_rows(int64_t workspace, const ForwardCall& call);

// Enqueues the layer forward on `stream`, no host synchronisation. workspace 0: this device's
// automatic EP = 1 workspace for the shape, which grows when a call brings more tokens (then,
// once, the device is synchronised and the workspace made anew). A workspace made by
// create_workspace has a fixed capacity: a call with more tokens is an error naming both.
void forward(int64_t workspace, const ForwardCall& call);

struct BackwardCall {
  Shape local_shape;  // as ForwardCall's
  DeviceWeights weights;
  const void* x = nullptr;            // (T, H) bf16
  const int32_t* topk_idx = nullptr;  // (T, k)
  const float* topk_w = nullptr;      // (T, k)
  const void* dy = nullptr;           // (T, H) bf16
  void* dx = nullptr;                 // (T, H) bf16
  float* d_topk_w = nullptr;          // (T, k)
  // Weight gradients in the weights' layouts (gate/up interleaved); shared ones null when I_s = 0.
  // fp32 and overwritten, or bf16 (bf16_gradients), or fp32 added into (accumulate: main_grad).
  void* grad_gate_up = nullptr;
  void* grad_down = nullptr;
  void* grad_shared_gate_up = nullptr;
  void* grad_shared_down = nullptr;
  bool bf16_gradients = false;
  bool accumulate = false;
  // Save mode: what the forward of this call kept (ForwardCall's), or null: recompute mode.
  const void* saved_gate_up = nullptr;
  const void* saved_shared_gate_up = nullptr;
  int64_t num_tokens = 0;
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
  // "bf16", "fp8" or "mxfp8", as ForwardCall's; the FP8 modes read the workspace's weight cache
  // of their mode, made anew from `weights` as described above ForwardCall's.
  std::string precision = "bf16";
  int64_t weights_version = -1;
};

// Enqueues mok's GPU backward (save mode with the forward's saved context; recompute mode, which
// computes the gate/up activations again from x, without) on `stream`, no host synchronisation.
// `workspace` as for forward; the backward's own buffers are made on its first call of each
// precision (collectively, when num_ranks > 1: every rank calls backward). fp8:
// LayerBackwardFp8 on the workspace's fp8 weight cache; mxfp8: LayerBackwardMxfp8 on its own.
void backward(int64_t workspace, const BackwardCall& call);

// Waits for `stream` and throws CoreError naming rank, phase and cause of a device fault that a
// forward recorded. workspace 0: every automatic workspace of `device`.
void check(int64_t workspace, int device, void* stream);
// After a fault: clears the error record, flags and epochs (collective when num_ranks > 1).
void reset_after_error(int64_t workspace, int device);

}  // namespace mok::torch_bridge
