// mok::CommEngine (mok/comm.hpp): the standalone communication steps (runtime/comm_ops.hpp) over
// one rank's CommWorkspace, behind the public header.
#include "mok/comm.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/comm.hpp"
#include "runtime/comm_ops.hpp"
#include "runtime/workspace.hpp"

namespace mok {
namespace {

static_assert(kVectorMaxThreads == comm::kVectorMaxThreads,
              "mok/comm.hpp states the copy kernels' limit");

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

CopyConfig as_copy(const CommCopyConfig& copy) { return {copy.num_ctas, copy.threads_per_cta}; }

// The ranks of one create_local call. Their workspaces are made and destroyed together: at EP > 1
// both are collective (window registration, ncclDevComm), so each rank's runs on a thread of its
// own, and no rank's is destroyed while a peer may still reach its window.
struct LocalRanks {
  std::vector<Communicator> comms;
  std::vector<std::unique_ptr<CommWorkspace>> workspaces;  // (num_ranks)

  ~LocalRanks() {
    try {
      for_each_rank(static_cast<int>(workspaces.size()),
                    [&](int rank) { workspaces[static_cast<size_t>(rank)].reset(); });
    } catch (...) {
      // NOTE: CommWorkspace's destructor does not throw; nothing else here can fail usefully.
    }
    // The communicators (ncclCommDestroy) go after every workspace, on this thread.
  }
};

void check_devices(const std::vector<int>& devices) {
  MOK_CHECK_ARG(!devices.empty(), "devices", "needs at least one device");
  MOK_CHECK_ARG(static_cast<int64_t>(devices.size()) <= comm::kMaxRanks, "devices", devices.size(),
                " devices; expert parallelism over NVLink supports 1 to ", comm::kMaxRanks);
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error of a later call
    num_devices = 0;
  }
  for (size_t index = 0; index < devices.size(); ++index) {
    const int device = devices[index];
    MOK_CHECK_ARG(device >= 0 && device < num_devices, "devices", "device ", device,
                  " out of range [0, ", num_devices, ")");
    MOK_CHECK_ARG(
        std::find(devices.begin(), devices.begin() + index, device) == devices.begin() + index,
        "devices", "device ", device, " listed twice (one rank per GPU)");
  }
}

}  // namespace

struct CommEngine::Impl {
  std::shared_ptr<LocalRanks> ranks;  // shared by every engine of the create_local call
  int rank = 0;

  CommWorkspace& workspace() const { return *ranks->workspaces[static_cast<size_t>(rank)]; }

  // Kernels launch on the current device: a stream of another device would fail far from here.
  void require_device() const {
    int current = -1;
    MOK_CUDA_CHECK(cudaGetDevice(&current));
    MOK_CHECK_ARG(current == workspace().device(), "device", "the current CUDA device is ", current,
                  ", rank ", rank, "'s engine is on device ", workspace().device(),
                  ": call cudaSetDevice(engine.device()) first");
  }
};

std::vector<std::unique_ptr<CommEngine>> CommEngine::create_local(
    const std::vector<int>& devices, const LayerShape& shape, int64_t tokens_max,
    const CommEngineOptions& options) {
  check_devices(devices);
  const int num_ranks = static_cast<int>(devices.size());
  shape.validate(num_ranks);
  MOK_CHECK_ARG(tokens_max > 0, "tokens_max", "must be positive, got ", tokens_max);
  MOK_CHECK_ARG(options.block_m > 0, "block_m", "must be positive, got ", options.block_m);
  MOK_CHECK_ARG(options.timeout_ms > 0, "timeout_ms", "must be positive, got ", options.timeout_ms);
  WorkspaceOptions workspace_options;
  workspace_options.block_m = options.block_m;
  workspace_options.timeout_ms = options.timeout_ms;

  auto ranks = std::make_shared<LocalRanks>();
  ranks->comms = num_ranks == 1 ? std::vector<Communicator>{Communicator::single(devices[0])}
                                : Communicator::create_local(devices);
  ranks->workspaces.resize(static_cast<size_t>(num_ranks));
  ::mok::for_each_rank(num_ranks, [&](int rank) {
    const Communicator& comm = ranks->comms[static_cast<size_t>(rank)];
    MOK_CUDA_CHECK(cudaSetDevice(comm.device()));
    ranks->workspaces[static_cast<size_t>(rank)] =
        std::make_unique<CommWorkspace>(comm, shape, tokens_max, workspace_options);
  });

  std::vector<std::unique_ptr<CommEngine>> engines;
  for (int rank = 0; rank < num_ranks; ++rank) {
    auto impl = std::make_unique<Impl>();
    impl->ranks = ranks;
    impl->rank = rank;
    engines.push_back(std::unique_ptr<CommEngine>(new CommEngine(std::move(impl))));
  }
  return engines;
}

void CommEngine::for_each_rank(int num_ranks, const std::function<void(int rank)>& fn) {
  MOK_CHECK_ARG(num_ranks >= 0, "num_ranks", "must be >= 0, got ", num_ranks);
  ::mok::for_each_rank(num_ranks, fn);
}

CommEngine::CommEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CommEngine::~CommEngine() = default;

int CommEngine::rank() const { return impl_->rank; }
int CommEngine::num_ranks() const { return impl_->workspace().num_ranks(); }
int CommEngine::device() const { return impl_->workspace().device(); }
const LayerShape& CommEngine::shape() const { return impl_->workspace().shape(); }
int64_t CommEngine::tokens_max() const { return impl_->workspace().layout().tokens_max; }
int64_t CommEngine::rows_capacity() const { return impl_->workspace().layout().rows_capacity(); }

bf16* CommEngine::x() const { return impl_->workspace().x(); }
bf16* CommEngine::expert_x() const { return impl_->workspace().expert_x(); }
bf16* CommEngine::expert_y() const { return impl_->workspace().expert_y(); }
const int32_t* CommEngine::expert_counts() const { return impl_->workspace().expert_counts(); }
const int32_t* CommEngine::expert_offsets() const { return impl_->workspace().expert_offsets(); }
const int32_t* CommEngine::row_source() const { return impl_->workspace().row_source(); }

void CommEngine::stage_tokens(const bf16* x, int64_t num_tokens, void* stream) {
  impl_->require_device();
  ::mok::stage_tokens(impl_->workspace(), x, num_tokens, as_stream(stream));
}

void CommEngine::schedule(const int32_t* topk_idx, int64_t num_tokens, void* stream) {
  impl_->require_device();
  ::mok::schedule(impl_->workspace(), topk_idx, num_tokens, as_stream(stream));
}

void CommEngine::rank_barrier(void* stream) {
  impl_->require_device();
  ::mok::rank_barrier(impl_->workspace(), as_stream(stream));
}

void CommEngine::dispatch(const CommCopyConfig& copy, void* stream) {
  impl_->require_device();
  ::mok::dispatch(impl_->workspace(), as_copy(copy), as_stream(stream));
}

void CommEngine::combine_push(const CommCopyConfig& copy, void* stream) {
  impl_->require_device();
  ::mok::combine_push(impl_->workspace(), as_copy(copy), as_stream(stream));
}

void CommEngine::combine_reduce(const float* topk_w, bf16* y, int64_t num_tokens, void* stream,
                                const float* shared_output) {
  impl_->require_device();
  ::mok::combine_reduce(impl_->workspace(), topk_w, shared_output, y, num_tokens,
                        as_stream(stream));
}

void CommEngine::check(void* stream) const { impl_->workspace().check(as_stream(stream)); }

void CommEngine::reset_after_error() { impl_->workspace().reset_after_error(); }

}  // namespace mok
