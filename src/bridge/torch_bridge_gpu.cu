// The GPU half of the bridge: the torch extension's GPU layer workspaces (LayerForward, and made on
// first use LayerBackward and each FP8 mode's forward and backward), each with the NCCL
// communicator it was made from; bf16 and fp8 here, mxfp8 in torch_bridge_mxfp8.cu. Host code
// only; kernels come with libmok_cuda.
//
// Workspaces live in a process-wide registry (leaked at exit on purpose: tearing down NCCL and
// CUDA objects from static destructors, after the runtime may be gone, crashes more than it
// frees). A handle names a workspace made by create_workspace; handle 0 means the automatic
// EP = 1 workspace of (device, shape), made on first use and grown on demand.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "bridge/gpu_workspace.hpp"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/precision.hpp"
#include "mok/torch_bridge.hpp"
#include "runtime/comm_nccl_check.hpp"

namespace mok::torch_bridge {

Workspace::~Workspace() {
  backward.reset();  // collective teardown of the windows first, then the communicator under them
  fp8_backward.reset();
  fp8.reset();
  mxfp8_backward.reset();
  mxfp8.reset();
  layer.reset();
#if defined(MOK_WITH_NCCL)
  if (comm != nullptr) {
    cudaSetDevice(device);
    ncclCommDestroy(comm);  // no throwing from a destructor
  }
#endif
}

namespace {

// The smallest automatic capacity; growth goes to the next power of two, so a training run with
// varying batch sizes re-makes its workspace a handful of times at most.
constexpr int64_t kMinAutomaticTokens = 256;

using AutomaticKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Registry {
  std::mutex mutex;
  int64_t next_handle = 1;
  std::map<int64_t, std::shared_ptr<Workspace>> by_handle;
  std::map<AutomaticKey, std::shared_ptr<Workspace>> automatic;
};

Registry& registry() {
  static auto* instance = new Registry();  // leaked: see the file comment
  return *instance;
}

template <class Body>
auto translating_errors(Body&& body) {
  try {
    return body();
  } catch (const Error& error) {
    throw CoreError(error.what());
  }
}

void check_hopper(int device) {
  int num_devices = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOK_CHECK_ARG(device >= 0 && device < num_devices, "device", "cuda:", device,
                " out of range: ", num_devices, " CUDA devices visible");
  int major = 0, minor = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  MOK_CHECK_ARG(major == 9, "device", "cuda:", device, " is sm_", major, minor,
                "; mok's GPU layer is built for sm_90a (Hopper: H100, H200)");
}

std::shared_ptr<Workspace> make_workspace(const WorkspaceSpec& spec, bool automatic) {
  MOK_CHECK_ARG(spec.tokens_max > 0, "max_tokens_per_rank", "must be positive, got ",
                spec.tokens_max);
  MOK_CHECK_ARG(spec.num_ranks >= 1 && spec.rank >= 0 && spec.rank < spec.num_ranks, "group",
                "rank ", spec.rank, " of ", spec.num_ranks, " ranks");
  check_hopper(spec.device);
  MOK_CUDA_CHECK(cudaSetDevice(spec.device));
  auto workspace = std::make_shared<Workspace>();
  workspace->shape = spec.shape;
  workspace->device = spec.device;
  workspace->rank = spec.rank;
  workspace->num_ranks = spec.num_ranks;
  workspace->tokens_max = spec.tokens_max;
  workspace->automatic = automatic;
  MOK_CHECK_ARG(!spec.low_memory_backward || spec.num_ranks == 1, "low_memory_backward",
                "the chunked backward runs at EP 1 alone, not on ", spec.num_ranks, " ranks");
  workspace->low_memory_backward = spec.low_memory_backward;
  // Host checks of the shape before any collective call, so that a bad shape fails alike on every
  // rank instead of leaving the others waiting in ncclCommInitRank.
  core_shape(spec.shape).validate(spec.num_ranks);

  Communicator comm;
  if (spec.num_ranks == 1) {
    comm = Communicator::single(spec.device);
  } else {
#if defined(MOK_WITH_NCCL)
    ncclUniqueId id;
    MOK_CHECK_ARG(spec.unique_id.size() == sizeof(id), "unique_id", "expected ", sizeof(id),
                  " bytes (ncclGetUniqueId), got ", spec.unique_id.size());
    std::memcpy(&id, spec.unique_id.data(), sizeof(id));
    MOK_NCCL_CHECK(ncclCommInitRank(&workspace->comm, spec.num_ranks, id, spec.rank), nullptr);
    comm = Communicator::wrap(workspace->comm);
#else
    throw Error("group", "mok was built without NCCL: expert parallelism over " +
                             std::to_string(spec.num_ranks) + " ranks is unavailable");
#endif
  }
  LayerForwardOptions options;
  options.allocate_weights = false;  // every call brings the caller's (torch's) weights
  if (spec.copy_ctas > 0) options.copy.num_ctas = spec.copy_ctas;
  options.fused.comm_ctas = spec.copy_ctas;
  options.fused.minibatch_rows = spec.minibatch_rows;
  options.fused.ring_rows = spec.ring_rows;
  workspace->communicator = comm;
  workspace->layer =
      std::make_unique<LayerForward>(comm, core_shape(spec.shape), spec.tokens_max, options);
  return workspace;
}

int64_t next_power_of_two(int64_t value) {
  int64_t result = 1;
  while (result < value) result *= 2;
  return result;
}

// This device's automatic EP = 1 workspace for the call's shape, large enough for the call.
template <class Call>
std::shared_ptr<Workspace> automatic_workspace(const Call& call) {
  const Shape& shape = call.local_shape;  // EP = 1: local experts are all the experts
  const AutomaticKey key{call.device,        shape.hidden,
                         shape.intermediate, shape.shared_intermediate,
                         shape.num_experts,  shape.top_k};
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto found = all.automatic.find(key);
  if (found != all.automatic.end() && found->second->tokens_max >= call.num_tokens) {
    return found->second;
  }
  int64_t capacity = next_power_of_two(std::max(call.num_tokens, kMinAutomaticTokens));
  if (found != all.automatic.end()) {
    // NOTE: the old workspace may still be read by queued work (this stream or another):
    // the only host synchronisation of the torch path, once per growth.
    MOK_CUDA_CHECK(cudaSetDevice(call.device));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    all.automatic.erase(found);
  }
  WorkspaceSpec spec;
  spec.shape = shape;
  spec.tokens_max = capacity;
  spec.device = call.device;
  std::shared_ptr<Workspace> workspace = make_workspace(spec, /*automatic=*/true);
  all.automatic.emplace(key, workspace);
  return workspace;
}

std::shared_ptr<Workspace> find_workspace(int64_t handle) {
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto found = all.by_handle.find(handle);
  MOK_CHECK_ARG(found != all.by_handle.end(), "workspace", "no workspace with handle ", handle,
                " (destroyed, or made in another process?)");
  return found->second;
}

// The call's tensors against the workspace's layer: same H, I, I_s, k, this rank's share of E,
// the same device, no more tokens than the capacity.
template <class Call>
void check_call(const Workspace& workspace, const Call& call) {
  const Shape& mine = workspace.shape;
  const Shape& given = call.local_shape;
  MOK_CHECK_ARG(call.device == workspace.device, "x", "on cuda:", call.device,
                ", the workspace is for cuda:", workspace.device);
  MOK_CHECK_ARG(given.hidden == mine.hidden, "x", "H = ", given.hidden,
                ", the workspace's layer has H = ", mine.hidden);
  MOK_CHECK_ARG(given.intermediate == mine.intermediate, "w_down", "I = ", given.intermediate,
                ", the workspace's layer has I = ", mine.intermediate);
  MOK_CHECK_ARG(given.shared_intermediate == mine.shared_intermediate, "w_shared_down",
                "I_s = ", given.shared_intermediate,
                ", the workspace's layer has I_s = ", mine.shared_intermediate);
  MOK_CHECK_ARG(given.top_k == mine.top_k, "topk_idx", "k = ", given.top_k,
                ", the workspace's layer has k = ", mine.top_k);
  MOK_CHECK_ARG(given.num_experts * workspace.num_ranks == mine.num_experts, "w_gate_up",
                given.num_experts,
                " local experts; the workspace's layer has E = ", mine.num_experts, " over ",
                workspace.num_ranks, " ranks (", mine.num_experts / workspace.num_ranks, " each)");
  MOK_CHECK_ARG(call.num_tokens <= workspace.tokens_max, "x", call.num_tokens,
                " tokens; the workspace holds at most ", workspace.tokens_max,
                " per rank (max_tokens_per_rank)");
}

// The workspace `handle` names, or (handle 0) every automatic workspace of `device`.
std::vector<std::shared_ptr<Workspace>> workspaces_of(int64_t handle, int device) {
  std::vector<std::shared_ptr<Workspace>> workspaces;
  if (handle != 0) {
    workspaces.push_back(find_workspace(handle));
  } else {
    Registry& all = registry();
    std::lock_guard<std::mutex> lock(all.mutex);
    for (const auto& [key, workspace] : all.automatic) {
      if (workspace->device == device) workspaces.push_back(workspace);
    }
  }
  return workspaces;
}

}  // namespace

bool have_gpu_layer() { return true; }

bool have_nccl() {
#if defined(MOK_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

std::vector<uint8_t> nccl_unique_id() {
  return translating_errors([&] {
#if defined(MOK_WITH_NCCL)
    ncclUniqueId id;
    MOK_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    return bytes;
#else
    throw Error("group", "mok was built without NCCL: no expert parallelism over processes");
    return std::vector<uint8_t>();
#endif
  });
}

int64_t create_workspace(const WorkspaceSpec& spec) {
  return translating_errors([&] {
    std::shared_ptr<Workspace> workspace = make_workspace(spec, /*automatic=*/false);
    Registry& all = registry();
    std::lock_guard<std::mutex> lock(all.mutex);
    const int64_t handle = all.next_handle++;
    all.by_handle.emplace(handle, std::move(workspace));
    return handle;
  });
}

void destroy_workspace(int64_t handle) {
  translating_errors([&] {
    std::shared_ptr<Workspace> workspace;
    {
      Registry& all = registry();
      std::lock_guard<std::mutex> lock(all.mutex);
      auto found = all.by_handle.find(handle);
      MOK_CHECK_ARG(found != all.by_handle.end(), "workspace", "no workspace with handle ", handle);
      workspace = std::move(found->second);
      all.by_handle.erase(found);
    }
    workspace.reset();  // outside the lock: teardown is collective and may take a while
  });
}

// The fp8 forward (LayerForwardFp8) of a workspace, made on first use, and made again with the
// backward's transposed layout in its cache by the workspace's first backward (the layout then
// stays); and that cache holding `given`: quantized anew from them unless it was made from the
// same addresses at the same known version (the rule above ForwardCall in torch_bridge.hpp).
LayerForwardFp8& fp8_layer_with_weights(Workspace& workspace, const DeviceWeights& given,
                                        int64_t weights_version, cudaStream_t stream) {
  workspace.mxfp8_cached = {};  // (the torch ops now keep this call's weights alive, not those)
  if (workspace.fp8 != nullptr && workspace.fp8_trains &&
      !workspace.fp8->weight_cache().has_transposed()) {
    // NOTE: collective, as every rank's first backward is; cudaFree waits for the last forward.
    workspace.fp8.reset();
    workspace.fp8_cached = {};
  }
  if (workspace.fp8 == nullptr) {
    LayerForwardFp8Options options;
    options.layer.copy = workspace.layer->options().copy;
    options.transposed_weights = workspace.fp8_trains;  // one cache for forward and backward
    workspace.fp8 = std::make_unique<LayerForwardFp8>(
        workspace.communicator, core_shape(workspace.shape), workspace.tokens_max, options);
  }
  if (!workspace.fp8->has_weights() || !workspace.fp8_cached.holds(given, weights_version)) {
    workspace.fp8->quantize_weights(device_weights(*workspace.layer, given), stream);
    workspace.fp8_cached = {given, weights_version};
  }
  return *workspace.fp8;
}

void forward_fp8(Workspace& workspace, const ForwardCall& call) {
  const auto stream = static_cast<cudaStream_t>(call.stream);
  LayerForwardFp8& layer =
      fp8_layer_with_weights(workspace, call.weights, call.weights_version, stream);
  SavedContext save;
  layer.forward(static_cast<const bf16*>(call.x), call.topk_idx, call.topk_w,
                static_cast<bf16*>(call.y), call.num_tokens, stream, nullptr,
                saved_context(call.saved_gate_up, call.saved_shared_gate_up, save));
}

// The fp8 backward (LayerBackwardFp8, save mode with the call's context, else recompute mode) on
// the workspace's fp8 weight cache, made to hold the call's weights first where it does not (the
// rule above ForwardCall).
void backward_fp8(Workspace& workspace, const BackwardCall& call) {
  const auto stream = static_cast<cudaStream_t>(call.stream);
  workspace.fp8_trains = true;
  const LayerForwardFp8& forward =
      fp8_layer_with_weights(workspace, call.weights, call.weights_version, stream);
  if (workspace.fp8_backward == nullptr) {
    LayerBackwardFp8Options options;  // (the FP8 GEMMs' pipeline: its default, as the forward's)
    options.layer = backward_options(workspace);
    workspace.fp8_backward = std::make_unique<LayerBackwardFp8>(
        workspace.communicator, core_shape(workspace.shape), workspace.tokens_max, options);
  }
  SavedContext saved;
  workspace.fp8_backward->backward(
      forward.weight_cache(), static_cast<const bf16*>(call.x), call.topk_idx, call.topk_w,
      static_cast<const bf16*>(call.dy), static_cast<bf16*>(call.dx), call.d_topk_w,
      device_gradients(call), call.num_tokens, stream, nullptr,
      saved_context(call.saved_gate_up, call.saved_shared_gate_up, saved));
}

void forward(int64_t handle, const ForwardCall& call) {
  translating_errors([&] {
    std::shared_ptr<Workspace> workspace =
        handle == 0 ? automatic_workspace(call) : find_workspace(handle);
    check_call(*workspace, call);
    MOK_CUDA_CHECK(cudaSetDevice(call.device));
    const Precision precision = parse_precision(call.precision);
    if (precision == Precision::kFp8) {
      forgetting_cache_on_error(workspace->fp8_cached, [&] { forward_fp8(*workspace, call); });
      return;
    }
    if (precision == Precision::kMxfp8) {
      forgetting_cache_on_error(workspace->mxfp8_cached, [&] { forward_mxfp8(*workspace, call); });
      return;
    }
    SavedContext save;
    workspace->layer->forward(device_weights(*workspace->layer, call.weights),
                              static_cast<const bf16*>(call.x), call.topk_idx, call.topk_w,
                              static_cast<bf16*>(call.y), call.num_tokens,
                              static_cast<cudaStream_t>(call.stream), nullptr,
                              saved_context(call.saved_gate_up, call.saved_shared_gate_up, save));
  });
}

int64_t saved_context_rows(int64_t handle, const ForwardCall& call) {
  int64_t rows = 0;
  translating_errors([&] {
    if (handle == 0) {  // the automatic workspace: EP = 1
      rows = mok::saved_context_rows(1, call.num_tokens, call.local_shape.top_k, call.num_tokens);
      return;
    }
    const std::shared_ptr<Workspace> workspace = find_workspace(handle);
    rows = mok::saved_context_rows(workspace->num_ranks, workspace->tokens_max,
                                   call.local_shape.top_k, call.num_tokens);
  });
  return rows;
}

void backward(int64_t handle, const BackwardCall& call) {
  translating_errors([&] {
    std::shared_ptr<Workspace> workspace =
        handle == 0 ? automatic_workspace(call) : find_workspace(handle);
    check_call(*workspace, call);
    MOK_CUDA_CHECK(cudaSetDevice(call.device));
    const Precision precision = parse_precision(call.precision);
    if (precision == Precision::kFp8) {
      forgetting_cache_on_error(workspace->fp8_cached, [&] { backward_fp8(*workspace, call); });
      return;
    }
    if (precision == Precision::kMxfp8) {
      forgetting_cache_on_error(workspace->mxfp8_cached, [&] { backward_mxfp8(*workspace, call); });
      return;
    }
    if (workspace->backward == nullptr) {
      LayerBackwardOptions options = backward_options(*workspace);
      if (workspace->low_memory_backward) {
        options.chunk_rows = low_memory_chunk_rows(workspace->tokens_max);
      }
      workspace->backward = std::make_unique<LayerBackward>(
          workspace->communicator, core_shape(workspace->shape), workspace->tokens_max, options);
    }
    const DeviceLayerGradients grads = device_gradients(call);
    SavedContext saved;
    workspace->backward->backward(
        device_weights(*workspace->layer, call.weights), static_cast<const bf16*>(call.x),
        call.topk_idx, call.topk_w, static_cast<const bf16*>(call.dy), static_cast<bf16*>(call.dx),
        call.d_topk_w, grads, call.num_tokens, static_cast<cudaStream_t>(call.stream), nullptr,
        saved_context(call.saved_gate_up, call.saved_shared_gate_up, saved));
  });
}

void check(int64_t handle, int device, void* stream) {
  translating_errors([&] {
    for (const auto& workspace : workspaces_of(handle, device)) {
      workspace->layer->check(static_cast<cudaStream_t>(stream));
      if (workspace->backward != nullptr) {
        workspace->backward->check(static_cast<cudaStream_t>(stream));
      }
      if (workspace->fp8 != nullptr) workspace->fp8->check(static_cast<cudaStream_t>(stream));
      if (workspace->fp8_backward != nullptr) {
        workspace->fp8_backward->check(static_cast<cudaStream_t>(stream));
      }
      if (workspace->mxfp8 != nullptr) workspace->mxfp8->check(static_cast<cudaStream_t>(stream));
      if (workspace->mxfp8_backward != nullptr) {
        workspace->mxfp8_backward->check(static_cast<cudaStream_t>(stream));
      }
    }
  });
}

void reset_after_error(int64_t handle, int device) {
  translating_errors([&] {
    for (const auto& workspace : workspaces_of(handle, device)) {
      workspace->layer->workspace().reset_after_error();
      if (workspace->backward != nullptr) workspace->backward->workspace().reset_after_error();
      if (workspace->fp8 != nullptr) workspace->fp8->workspace().reset_after_error();
      if (workspace->fp8_backward != nullptr) {
        workspace->fp8_backward->workspace().reset_after_error();
      }
      if (workspace->mxfp8 != nullptr) workspace->mxfp8->workspace().reset_after_error();
      if (workspace->mxfp8_backward != nullptr) {
        workspace->mxfp8_backward->workspace().reset_after_error();
      }
    }
  });
}

}  // namespace mok::torch_bridge
