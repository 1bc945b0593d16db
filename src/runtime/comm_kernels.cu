// Entry points and launchers of the standalone communication kernels; the device code lives in
// src/kernels/comm (the megakernel reuses it).
#include <algorithm>

#include "kernels/comm/combine.cuh"
#include "kernels/comm/dispatch.cuh"
#include "kernels/comm/token_schedule.cuh"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/comm_ops.hpp"

namespace mok {

namespace {

__global__ void begin_call_kernel(comm::WorkspaceView view) { comm::begin_call(view); }

// The schedule's passes (token_schedule.cuh) in one kernel, grid barriers between them (every CTA
// resident: at most one per SM of the workspace's share, and little shared memory). Shared
// memory: E_l + 1 offsets, then E_l row counters per warp.
constexpr int kScheduleThreads = 256;

__global__ void __launch_bounds__(kScheduleThreads)
    schedule_kernel(comm::WorkspaceView view, const int32_t* topk_idx, const float* topk_w,
                    int32_t num_tokens) {
  extern __shared__ int32_t scratch[];
  if (comm::cta_sees_error(view)) return;
  comm::make_schedule(view, topk_idx, topk_w, num_tokens, static_cast<int>(blockIdx.x),
                      static_cast<int>(gridDim.x), scratch);
}

// Dynamic shared memory of the sliced passes for E_l local experts; above the default 48 KB
// (E_l > ~1,300) the kernels are allowed more, up to the device's limit.
size_t slice_pass_bytes(const CommWorkspace& ws) {
  const int64_t experts = ws.layout().experts_per_rank();
  const size_t bytes = static_cast<size_t>((experts + 1 + kScheduleThreads / 32 * experts) * 4);
  constexpr size_t kDefaultLimit = 48 * 1024;
  if (bytes > kDefaultLimit) {
    static const int limit = [] {
      int device = 0, optin = 0;
      MOK_CUDA_CHECK(cudaGetDevice(&device));
      MOK_CUDA_CHECK(
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      return optin;
    }();
    MOK_CHECK_ARG(bytes <= static_cast<size_t>(limit), "num_experts", "the schedule's ", experts,
                  " local experts need ", bytes, " bytes of shared memory, more than ", limit);
    MOK_CUDA_CHECK(cudaFuncSetAttribute(
        schedule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return bytes;
}

template <comm::DispatchTensor kTensor>
__global__ void __launch_bounds__(comm::kVectorMaxThreads, 1)
    dispatch_kernel(comm::WorkspaceView view) {
  comm::dispatch_pull(view, kTensor);
}

__global__ void __launch_bounds__(comm::kVectorMaxThreads, 1)
    dispatch_tokens_kernel(comm::WorkspaceView view, const char* x, const char* dy,
                           comm::TokenRowsOut out) {
  comm::dispatch_tokens_local(view, x, dy, out);
}

__global__ void __launch_bounds__(comm::kVectorMaxThreads, 1)
    dispatch_fp8_kernel(comm::WorkspaceView view, comm::Fp8RowsOut out) {
  comm::dispatch_pull_fp8(view, out);
}

// Token t's packed row into its x slot: H E4M3 bytes, then H / 128 scales.
__global__ void stage_fp8_tokens_kernel(comm::WorkspaceView view, const uint8_t* data,
                                        const float* scales, int64_t num_tokens) {
  const int64_t hidden = view.layout.hidden;
  const int64_t num_scales = hidden / 128;
  comm::for_each_row_warp(num_tokens, [&](int64_t token, int lane) {
    char* slot = view.x_row(view.rank, token);
    comm::copy_fp8_row_warp<comm::RowLoad::kReadOnly>(
        data + token * hidden, scales + token * num_scales, reinterpret_cast<uint8_t*>(slot),
        reinterpret_cast<float*>(slot + hidden), hidden, lane);
  });
}

__global__ void __launch_bounds__(comm::kVectorMaxThreads, 1)
    combine_push_kernel(comm::WorkspaceView view) {
  comm::combine_push(view);
}

// kCollect: the backward's, which also collects d_topk_w. Three CTAs an SM (at most 85 registers
// a thread): with the collect the compiler took 88, and at two CTAs an SM the reduce kept fewer
// loads in flight and ran ~10 % slower (docs/perf-notes/backward.md v33).
template <bool kCollect>
__global__ void __launch_bounds__(comm::kReduceThreads, 3)
    combine_reduce_kernel(comm::WorkspaceView view, const float* topk_w, const float* shared_output,
                          __nv_bfloat16* y, float* d_topk_w, int32_t num_tokens) {
  comm::combine_reduce(view, topk_w, shared_output, y, kCollect ? d_topk_w : nullptr, num_tokens);
}

__global__ void rank_barrier_kernel(comm::WorkspaceView view) {
  if (threadIdx.x == 0) comm::rank_barrier(view);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_num_tokens(const CommWorkspace& ws, int64_t num_tokens) {
  MOK_CHECK_ARG(num_tokens >= 0 && num_tokens <= ws.layout().tokens_max, "num_tokens", num_tokens,
                " out of range [0, ", ws.layout().tokens_max, "]");
}

// A copy kernel's grid from config, whose CTAs and threads are checked.
int resolve_ctas(const CommWorkspace& ws, const CopyConfig& config) {
  MOK_CHECK_ARG(config.num_ctas >= 0, "num_ctas", "must be >= 0, got ", config.num_ctas);
  MOK_CHECK_ARG(config.threads_per_cta >= 32 && config.threads_per_cta <= comm::kVectorMaxThreads &&
                    config.threads_per_cta % 32 == 0,
                "threads_per_cta", "must be a multiple of 32 in [32, ", comm::kVectorMaxThreads,
                "], got ", config.threads_per_cta);
  return config.num_ctas == 0 ? ws.num_sms() : config.num_ctas;
}

// A copy kernel on config's CTAs and threads: kernel(ws.view(), args...).
template <class... Args>
void launch_copy(const CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
                 void (*kernel)(comm::WorkspaceView, Args...), Args... args) {
  const int num_ctas = resolve_ctas(ws, config);
  kernel<<<num_ctas, config.threads_per_cta, 0, stream>>>(ws.view(), args...);
  MOK_CUDA_CHECK_LAUNCH();
}

// The standalone dispatches write every row into expert_x (not a fused forward's ring of rows).
void check_every_expert_row(const CommWorkspace& ws, const char* which) {
  MOK_CHECK_ARG(ws.layout().expert_rows == ws.layout().rows_capacity(), "workspace", which,
                " needs expert_x for every row (", ws.layout().rows_capacity(), "), this one has ",
                ws.layout().expert_rows, " (a fused forward's ring)");
}

// Staging and pulling go through the window's x and dy rows, which one rank's backward does
// without (WorkspaceOptions::rows_in_expert_dy: it dispatches from the caller's tensors).
void check_window_rows(const CommWorkspace& ws, const char* which) {
  MOK_CHECK_ARG(!ws.layout().rows_in_expert_dy, "workspace", which,
                " needs x and dy rows in the window; this one (one rank's backward) has none");
}

// The fp8 rows' packed layout needs whole 128-blocks along H.
void check_fp8_rows(const CommWorkspace& ws) {
  MOK_CHECK_ARG(ws.layout().hidden % 128 == 0, "workspace",
                "fp8 rows need H a multiple of 128, got ", ws.layout().hidden);
}

}  // namespace

void stage_tokens(CommWorkspace& ws, const bf16* x, int64_t num_tokens, cudaStream_t stream) {
  check_num_tokens(ws, num_tokens);
  MOK_CHECK_ARG(num_tokens == 0 || x != nullptr, "x", "null pointer for ", num_tokens, " tokens");
  check_window_rows(ws, "staging x");
  MOK_CUDA_CHECK(cudaMemcpyAsync(ws.x(), x,
                                 static_cast<size_t>(num_tokens * ws.layout().row_bytes()),
                                 cudaMemcpyDeviceToDevice, stream));
}

void stage_fp8_tokens(CommWorkspace& ws, const uint8_t* data, const float* scales,
                      int64_t num_tokens, cudaStream_t stream) {
  check_num_tokens(ws, num_tokens);
  MOK_CHECK_ARG(num_tokens == 0 || (data != nullptr && scales != nullptr), "data",
                "null pointer for ", num_tokens, " tokens");
  check_fp8_rows(ws);
  if (num_tokens == 0) return;
  constexpr int kThreads = 256;
  const int ctas = static_cast<int>(std::clamp<int64_t>(
      ceil_div(num_tokens, int64_t{kThreads / 32}), 1, 4 * int64_t{ws.num_sms()}));
  stage_fp8_tokens_kernel<<<ctas, kThreads, 0, stream>>>(ws.view(), data, scales, num_tokens);
  MOK_CUDA_CHECK_LAUNCH();
}

void begin_call(CommWorkspace& ws, cudaStream_t stream) {
  begin_call_kernel<<<1, 256, 0, stream>>>(ws.view());
  MOK_CUDA_CHECK_LAUNCH();
}

void schedule(CommWorkspace& ws, const int32_t* topk_idx, int64_t num_tokens, cudaStream_t stream,
              const float* topk_w) {
  check_num_tokens(ws, num_tokens);
  MOK_CHECK_ARG(num_tokens == 0 || topk_idx != nullptr, "topk_idx", "null pointer for ", num_tokens,
                " tokens");
  MOK_CHECK_ARG(topk_w == nullptr || ws.layout().backward, "topk_w",
                "staged only in a workspace with the backward's regions");
  const comm::WorkspaceLayout& layout = ws.layout();
  begin_call(ws, stream);
  // Two launches: begin_call (the epoch the passes read), then the passes. CTAs for the widest
  // pass: 8 ids a thread in gather_copy, a warp a slice in count_slices and place_rows, a warp an
  // expert in scan_slices.
  const size_t shared_bytes = slice_pass_bytes(ws);
  const int64_t warps_per_cta = kScheduleThreads / 32;
  const int64_t all_ids = layout.num_ranks * layout.tokens_max * layout.top_k;
  const int64_t widest =
      std::max({ceil_div(all_ids, int64_t{kScheduleThreads} * 8),
                ceil_div(layout.num_ranks * layout.slices_per_source(), warps_per_cta),
                ceil_div(layout.experts_per_rank(), warps_per_cta)});
  const int ctas = static_cast<int>(std::clamp<int64_t>(widest, 1, ws.num_sms()));
  schedule_kernel<<<ctas, kScheduleThreads, shared_bytes, stream>>>(
      ws.view(), topk_idx, topk_w, static_cast<int32_t>(num_tokens));
  MOK_CUDA_CHECK_LAUNCH();
}

void dispatch(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
              comm::DispatchTensor tensor) {
  check_every_expert_row(ws, "the standalone dispatch");
  check_window_rows(ws, "the standalone dispatch");
  if (tensor == comm::DispatchTensor::kDy) {
    MOK_CHECK_ARG(ws.layout().backward, "workspace",
                  "dispatching dy needs a workspace with the backward's regions");
    launch_copy(ws, config, stream, dispatch_kernel<comm::DispatchTensor::kDy>);
  } else {
    launch_copy(ws, config, stream, dispatch_kernel<comm::DispatchTensor::kX>);
  }
}

void dispatch_tokens(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
                     const bf16* x, const bf16* dy) {
  MOK_CHECK_ARG(ws.num_ranks() == 1, "workspace",
                "the dispatch by tokens is one rank's alone; this workspace has ", ws.num_ranks(),
                " ranks");
  check_every_expert_row(ws, "the dispatch by tokens");
  MOK_CHECK_ARG(x != nullptr || dy != nullptr, "x", "neither x nor dy to dispatch");
  MOK_CHECK_ARG(dy == nullptr || ws.layout().backward, "workspace",
                "dispatching dy needs a workspace with the backward's regions");
  comm::TokenRowsOut out;
  out.x_rows = ws.view().expert_x_row(0);
  out.dy_rows = dy != nullptr ? ws.view().expert_dy_row(0) : nullptr;
  launch_copy(ws, config, stream, dispatch_tokens_kernel, reinterpret_cast<const char*>(x),
              reinterpret_cast<const char*>(dy), out);
}

void dispatch_tokens_window(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream,
                            const bf16* tokens, bf16* rows, const int32_t* window) {
  MOK_CHECK_ARG(ws.num_ranks() == 1, "workspace",
                "the dispatch by tokens is one rank's alone; this workspace has ", ws.num_ranks(),
                " ranks");
  MOK_CHECK_ARG(tokens != nullptr && rows != nullptr && window != nullptr, "tokens",
                "null tokens, rows or window");
  comm::TokenRowsOut out;
  out.x_rows = reinterpret_cast<char*>(rows);
  out.window = window;
  launch_copy(ws, config, stream, dispatch_tokens_kernel, reinterpret_cast<const char*>(tokens),
              static_cast<const char*>(nullptr), out);
}

void dispatch_fp8(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream, uint8_t* data,
                  float* scales) {
  MOK_CHECK_ARG(data != nullptr && scales != nullptr, "data", "null destination");
  check_fp8_rows(ws);
  launch_copy(ws, config, stream, dispatch_fp8_kernel, comm::Fp8RowsOut{data, scales});
}

void combine_push(CommWorkspace& ws, const CopyConfig& config, cudaStream_t stream) {
  MOK_CHECK_ARG(ws.layout().has_expert_y() || ws.layout().num_ranks == 1, "workspace",
                "the standalone combine push needs expert_y; this workspace (a fused forward's) "
                "has none");
  if (ws.layout().num_ranks == 1) {
    // One rank: no row to push and no flag its reduce waits for (combine.cuh): no launch (the
    // config is checked all the same).
    resolve_ctas(ws, config);
    return;
  }
  launch_copy(ws, config, stream, combine_push_kernel);
}

void combine_reduce(CommWorkspace& ws, const float* topk_w, const float* shared_output, bf16* y,
                    int64_t num_tokens, cudaStream_t stream, float* d_topk_w) {
  check_num_tokens(ws, num_tokens);
  MOK_CHECK_ARG(num_tokens == 0 || topk_w != nullptr, "topk_w", "null pointer for ", num_tokens,
                " tokens");
  MOK_CHECK_ARG(num_tokens == 0 || y != nullptr, "y", "null pointer for ", num_tokens, " tokens");
  MOK_CHECK_ARG(reinterpret_cast<uintptr_t>(y) % 16 == 0, "y", "must be 16-byte aligned");
  const int64_t items = num_tokens * (ws.layout().hidden / comm::kReduceVector);
  MOK_CHECK_ARG(items <= INT32_MAX, "num_tokens", num_tokens, " tokens of ", ws.layout().hidden,
                " columns are more 8-column vectors than the reduce indexes in 32 bits");
  // One wave of resident CTAs looping over the items: a grid of several waves left its last one
  // part-full (3 CTAs of 256 per SM: the kernels' launch bounds).
  const auto kernel =
      d_topk_w != nullptr ? combine_reduce_kernel<true> : combine_reduce_kernel<false>;
  static const int resident_per_sm = [] {  // the same for every device mok runs on (sm_90)
    int resident = 0;                      // (the same for both kernels)
    MOK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, combine_reduce_kernel<false>, comm::kReduceThreads, 0));
    return std::max(resident, 1);
  }();
  // (ranks emulated on one GPU: one CTA per SM of the rank's share, so that waiting CTAs leave
  // the other ranks' SMs free)
  const int per_sm = ws.shares_device() ? 1 : resident_per_sm;
  const int ctas = static_cast<int>(std::clamp<int64_t>(ceil_div(items, comm::kReduceThreads), 1,
                                                        int64_t{ws.num_sms()} * per_sm));
  kernel<<<ctas, comm::kReduceThreads, 0, stream>>>(ws.view(), topk_w, shared_output,
                                                    reinterpret_cast<__nv_bfloat16*>(y), d_topk_w,
                                                    static_cast<int32_t>(num_tokens));
  MOK_CUDA_CHECK_LAUNCH();
}

void rank_barrier(CommWorkspace& ws, cudaStream_t stream) {
  rank_barrier_kernel<<<1, 32, 0, stream>>>(ws.view());
  MOK_CUDA_CHECK_LAUNCH();
}

}  // namespace mok
