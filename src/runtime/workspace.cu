#include "runtime/workspace.hpp"

#include <algorithm>
#include <string>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/comm_nccl_check.hpp"

#if defined(MOK_WITH_NCCL)
#include <nccl_device.h>
#endif

namespace mok {

namespace {

constexpr int64_t kWindowGranularity = int64_t{2} << 20;

#if defined(MOK_WITH_NCCL)
// NOTE: ncclGetPeerPointer exists only on the device; read every rank's window base once here.
__global__ void read_window_bases(ncclWindow_t window, int num_ranks, char** bases) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < num_ranks) bases[peer] = static_cast<char*>(ncclGetPeerPointer(window, 0, peer));
}
#endif

const char* flag_kind_name(uint32_t kind) {
  switch (static_cast<comm::FlagKind>(kind)) {
    case comm::FlagKind::kGather:
      return "gather";
    case comm::FlagKind::kCombine:
      return "combine";
    case comm::FlagKind::kBarrier:
      return "barrier";
  }
  return "unknown";
}

const char* task_counter_name(uint32_t kind) {
  switch (static_cast<comm::TaskCounter>(kind)) {
    case comm::TaskCounter::kRowsArrived:
      return "dispatched-rows";
    case comm::TaskCounter::kHiddenReady:
      return "gate/up-tiles";
    case comm::TaskCounter::kSharedHiddenReady:
      return "shared-gate/up-tiles";
    case comm::TaskCounter::kDownDone:
      return "down-tiles-read";
  }
  return "unknown";
}

}  // namespace

comm::WorkspaceLayout workspace_layout(const LayerShape& shape, int num_ranks, int64_t tokens_max,
                                       const WorkspaceOptions& options) {
  return comm::WorkspaceLayout::make(num_ranks, tokens_max, shape.hidden, shape.top_k,
                                     shape.num_experts, options.block_m, options.expert_rows,
                                     options.expert_y, options.backward, options.rows_in_expert_dy);
}

CommWorkspace::CommWorkspace(const Communicator& comm, const LayerShape& shape, int64_t tokens_max,
                             const WorkspaceOptions& options)
    : comm_(comm), shape_(shape) {
  const int num_ranks = comm.num_ranks();
  MOK_CHECK_ARG(num_ranks >= 1 && num_ranks <= comm::kMaxRanks, "comm", num_ranks,
                " ranks; expert parallelism over NVLink supports 1 to ", comm::kMaxRanks);
  shape.validate(num_ranks);
  MOK_CHECK_ARG(tokens_max > 0, "tokens_max", "must be positive, got ", tokens_max);
  MOK_CHECK_ARG(options.block_m > 0, "block_m", "must be positive, got ", options.block_m);
  MOK_CHECK_ARG(options.timeout_ms > 0, "timeout_ms", "must be positive, got ", options.timeout_ms);
  MOK_CHECK_ARG(options.expert_rows >= 0, "expert_rows", "must be >= 0, got ", options.expert_rows);
  MOK_CHECK_ARG(
      !options.rows_in_expert_dy || (num_ranks == 1 && options.backward && !options.expert_y),
      "rows_in_expert_dy", "only one rank's backward without expert_y keeps its ",
      "slots and x rows in expert_dy (", num_ranks, " ranks)");
  const comm::WorkspaceLayout layout = workspace_layout(shape, num_ranks, tokens_max, options);
  MOK_CHECK_ARG(num_ranks * tokens_max * shape.top_k < (int64_t{1} << 31) &&
                    layout.rows_capacity() < (int64_t{1} << 31),
                "tokens_max", tokens_max, " tokens per rank overflow the 32-bit row indices");
  MOK_CHECK_ARG(layout.row_bytes() <= 96 * 1024, "hidden", "rows of ", layout.row_bytes(),
                " bytes exceed the 96 KiB a copy stage holds");

  MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, comm.device()));
  // Ranks emulated on one GPU: each takes a share of the SMs for the kernels that wait on peers,
  // 1 / (R + 1), so that with every rank's waiting CTAs resident a share is still free for the
  // kernels they wait for (with 1 / R, EP 4 deadlocked until the timeout).
  if (comm.ranks_on_device() > 1) num_sms_ = std::max(1, num_sms_ / (comm.ranks_on_device() + 1));
  view_.layout = layout;
  view_.rank = comm.rank();
  view_.timeout_ns = static_cast<uint64_t>(options.timeout_ms) * 1000000ull;

  const int64_t window_bytes = comm::align_up(layout.window_bytes, kWindowGranularity);
  MOK_CUDA_CHECK(cudaMalloc(&local_memory_, static_cast<size_t>(layout.local_bytes)));
  MOK_CUDA_CHECK(cudaMemset(local_memory_, 0, static_cast<size_t>(layout.local_bytes)));
  view_.local = static_cast<char*>(local_memory_);

  if (num_ranks == 1) {
    MOK_CUDA_CHECK(cudaMalloc(&window_memory_, static_cast<size_t>(window_bytes)));
    MOK_CUDA_CHECK(cudaMemset(window_memory_, 0, static_cast<size_t>(window_bytes)));
    view_.windows[0] = static_cast<char*>(window_memory_);
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    return;
  }
  if (comm.ranks_on_device() > 1) {
    // Emulated ranks: plain device memory, zeroed before any peer can reach it (the exchange is
    // a host barrier of every rank); the peers' kernels address it directly, on the same GPU.
    MOK_CUDA_CHECK(cudaMalloc(&window_memory_, static_cast<size_t>(window_bytes)));
    MOK_CUDA_CHECK(cudaMemset(window_memory_, 0, static_cast<size_t>(window_bytes)));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    comm.exchange_windows(static_cast<char*>(window_memory_), view_.windows);
    return;
  }
#if defined(MOK_WITH_NCCL)
  ncclComm_t nccl = comm.nccl();
  MOK_CHECK_ARG(nccl != nullptr, "comm", num_ranks, " ranks but no NCCL communicator");
  MOK_NCCL_CHECK(ncclMemAlloc(&window_memory_, static_cast<size_t>(window_bytes)), nccl);
  // Flags start at zero on every rank before any peer can reach them: the registration below is
  // collective, so no rank returns from it before every rank has zeroed its window.
  MOK_CUDA_CHECK(cudaMemset(window_memory_, 0, static_cast<size_t>(window_bytes)));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  ncclWindow_t window = nullptr;
  MOK_NCCL_CHECK(ncclCommWindowRegister(nccl, window_memory_, static_cast<size_t>(window_bytes),
                                        &window, NCCL_WIN_COLL_SYMMETRIC),
                 nccl);
  window_handle_ = window;

  ncclDevCommRequirements requirements{};
  requirements.lsaBarrierCount = 1;
  auto* dev_comm = new ncclDevComm{};
  dev_comm_ = dev_comm;
  MOK_NCCL_CHECK(ncclDevCommCreate(nccl, &requirements, dev_comm), nccl);
  MOK_CHECK_ARG(dev_comm->lsaSize == num_ranks, "comm", "rank ", comm.rank(), " reaches ",
                dev_comm->lsaSize, " of ", num_ranks,
                " ranks by NVLink load/store (NCCL LSA team); mok's expert parallelism needs "
                "peer-to-peer access between every pair of GPUs");

  char** bases_device = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&bases_device, sizeof(char*) * comm::kMaxRanks));
  read_window_bases<<<1, comm::kMaxRanks>>>(window, num_ranks, bases_device);
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaMemcpy(view_.windows, bases_device, sizeof(char*) * comm::kMaxRanks,
                            cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaFree(bases_device));
  for (int peer = 0; peer < num_ranks; ++peer) {
    MOK_CHECK_ARG(view_.windows[peer] != nullptr, "comm", "NCCL gave no address for rank ", peer,
                  "'s window");
  }
#else
  throw Error("comm", "mok was built without NCCL: a workspace over several ranks is unavailable");
#endif
}

CommWorkspace::~CommWorkspace() {
  cudaSetDevice(comm_.device());
  cudaDeviceSynchronize();
  // Emulated ranks: no rank frees its window while a peer's kernels may still reach it (their
  // teardown is collective too).
  if (comm_.ranks_on_device() > 1) comm_.host_barrier();
#if defined(MOK_WITH_NCCL)
  if (comm_.num_ranks() > 1 && comm_.ranks_on_device() == 1) {  // (NCCL's window)
    ncclComm_t nccl = comm_.nccl();
    if (dev_comm_ != nullptr) {
      auto* dev_comm = static_cast<ncclDevComm*>(dev_comm_);
      ncclDevCommDestroy(nccl, dev_comm);
      delete dev_comm;
    }
    if (window_handle_ != nullptr) {
      ncclCommWindowDeregister(nccl, static_cast<ncclWindow_t>(window_handle_));
    }
    if (window_memory_ != nullptr) ncclMemFree(window_memory_);
    window_memory_ = nullptr;
  }
#endif
  if (window_memory_ != nullptr) cudaFree(window_memory_);
  if (local_memory_ != nullptr) cudaFree(local_memory_);
}

void CommWorkspace::check(cudaStream_t stream) const {
  MOK_CUDA_CHECK(cudaSetDevice(comm_.device()));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  comm::ErrorRecord record{};
  MOK_CUDA_CHECK(
      cudaMemcpy(&record, &view_.state()->error, sizeof(record), cudaMemcpyDeviceToHost));
  const auto code = static_cast<comm::ErrorCode>(record.code);
  if (code == comm::ErrorCode::kNone) return;
  const std::string where = detail::concat(
      "rank ", record.rank, ", phase ", comm::phase_name(static_cast<comm::Phase>(record.phase)));
  switch (code) {
    case comm::ErrorCode::kExpertOutOfRange:
      throw Error("topk_idx", detail::concat("expert id ", record.value, " out of range [-1, ",
                                             record.expected, ") at rank ", record.peer, " token ",
                                             record.token, " slot ", record.slot,
                                             " (found on the "
                                             "device by ",
                                             where, ")"));
    case comm::ErrorCode::kExpertRepeated:
      throw Error("topk_idx", detail::concat("expert id ", record.value, " repeated at rank ",
                                             record.peer, " token ", record.token, " slot ",
                                             record.slot, " (also at slot ", record.expected,
                                             "; the ids of a row must be distinct, only -1 may "
                                             "repeat; found on the device by ",
                                             where, ")"));
    case comm::ErrorCode::kTokenCountOutOfRange:
      throw Error("num_tokens", detail::concat("rank ", record.peer, " sent ", record.value,
                                               " tokens, outside [0, ", record.expected,
                                               "] (found on the device by ", where, ")"));
    case comm::ErrorCode::kTaskTimeout:
      throw Error(
          "fused forward",
          detail::concat(where, ": timed out after ", view_.timeout_ns / 1000000ull,
                         " ms waiting for row block ", record.token, "'s ",
                         task_counter_name(record.flag_kind), " count to reach ", record.expected,
                         " (it holds ", static_cast<uint32_t>(record.value),
                         "): a CTA of the fused kernel did not run (are other kernels "
                         "holding SMs?) or a peer stalled"));
    case comm::ErrorCode::kTimeout: {
      // The flag as memory holds it now, after the wait gave up: the epoch there means the
      // signal landed but the waiter never saw it; the old value, that it never landed here.
      std::string now;
      if (record.peer < static_cast<uint32_t>(view_.layout.num_ranks) &&
          record.flag_kind < static_cast<uint32_t>(comm::kNumFlagKinds)) {
        uint32_t value = 0;
        MOK_CUDA_CHECK(
            cudaMemcpy(&value,
                       view_.flag(view_.rank, static_cast<comm::FlagKind>(record.flag_kind),
                                  static_cast<int>(record.peer)),
                       sizeof(value), cudaMemcpyDeviceToHost));
        now = detail::concat("; ", value, " in memory after the wait");
      }
      throw Error("comm", detail::concat(where, ": timed out after ", view_.timeout_ns / 1000000ull,
                                         " ms waiting for rank ", record.peer, "'s ",
                                         flag_kind_name(record.flag_kind), " flag to reach epoch ",
                                         record.expected, " (it holds ",
                                         static_cast<uint32_t>(record.value), now,
                                         "); did every rank launch this call?"));
    }
    default:
      throw Error("comm", detail::concat(where, ": device error code ", record.code));
  }
}

uint64_t CommWorkspace::call_began_ns() const {
  unsigned long long began = 0;
  MOK_CUDA_CHECK(
      cudaMemcpy(&began, &view_.state()->call_began_ns, sizeof(began), cudaMemcpyDeviceToHost));
  return began;
}

std::vector<double> CommWorkspace::schedule_pass_us() const {
  unsigned long long stamps[comm::kSchedulePasses + 1] = {};
  MOK_CUDA_CHECK(
      cudaMemcpy(stamps, view_.state()->schedule_ns, sizeof(stamps), cudaMemcpyDeviceToHost));
  std::vector<double> passes;
  for (int pass = 0; pass < comm::kSchedulePasses; ++pass) {
    passes.push_back(static_cast<double>(stamps[pass + 1] - stamps[pass]) * 1e-3);
  }
  return passes;
}

void CommWorkspace::reset_after_error() {
  MOK_CUDA_CHECK(cudaSetDevice(comm_.device()));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  MOK_CUDA_CHECK(cudaMemset(window_base() + view_.layout.flags_offset, 0,
                            sizeof(uint32_t) * comm::kNumFlagKinds * comm::kMaxRanks));
  MOK_CUDA_CHECK(cudaMemset(view_.state(), 0, sizeof(comm::DeviceState)));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace mok
