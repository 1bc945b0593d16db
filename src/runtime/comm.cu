#include "runtime/comm.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "runtime/comm_nccl_check.hpp"

namespace mok {

namespace {

#if defined(MOK_WITH_NCCL)
// The device API (ncclDevCommCreate, LSA windows) first shipped in NCCL 2.28.
constexpr int kMinNcclVersion = 22800;

void check_nccl_version() {
  int version = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&version), nullptr);
  MOK_CHECK_ARG(version >= kMinNcclVersion, "comm", "NCCL ", detail::nccl_version_text(),
                " has no device API; mok's expert parallelism needs NCCL >= 2.28");
}
#endif

}  // namespace

namespace detail {
std::string nccl_version_text() {
#if defined(MOK_WITH_NCCL)
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return "(unknown version)";
  return concat(version / 10000, ".", (version / 100) % 100, ".", version % 100);
#else
  return "(mok was built without NCCL)";
#endif
}
}  // namespace detail

Communicator::State::~State() {
#if defined(MOK_WITH_NCCL)
  if (owned && comm != nullptr) {
    cudaSetDevice(device);
    ncclCommDestroy(comm);  // no throwing from a destructor; a failure here leaks the comm
  }
#endif
}

Communicator Communicator::single(int device) {
  int num_devices = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOK_CHECK_ARG(device >= 0 && device < num_devices, "device", "device ", device,
                " out of range [0, ", num_devices, ")");
  Communicator result;
  result.state_ = std::make_shared<State>();
  result.state_->device = device;
  return result;
}

std::vector<Communicator> Communicator::create_local(const std::vector<int>& devices) {
#if defined(MOK_WITH_NCCL)
  check_nccl_version();
  int num_devices = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOK_CHECK_ARG(!devices.empty(), "devices", "needs at least one device");
  for (int device : devices) {
    MOK_CHECK_ARG(device >= 0 && device < num_devices, "devices", "device ", device,
                  " out of range [0, ", num_devices, ")");
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  MOK_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()),
                 nullptr);
  std::vector<Communicator> result(devices.size());
  for (size_t rank = 0; rank < devices.size(); ++rank) {
    result[rank].state_ = std::make_shared<State>();
    State& state = *result[rank].state_;
    state.comm = comms[rank];
    state.owned = true;
    state.rank = static_cast<int>(rank);
    state.num_ranks = static_cast<int>(devices.size());
    state.device = devices[rank];
  }
  return result;
#else
  throw Error("comm", "mok was built without NCCL: expert parallelism over " +
                          std::to_string(devices.size()) + " GPUs is unavailable");
#endif
}

// The emulated ranks' host rendezvous: each rank's window base, and a reusable barrier.
struct Communicator::EmulatedGroup {
  explicit EmulatedGroup(int ranks) : num_ranks(ranks), windows(static_cast<size_t>(ranks)) {}
  // Throws after a minute without every rank: a rank that failed (and so never arrives) must not
  // hang the others.
  void barrier(int rank) {
    std::unique_lock<std::mutex> lock(mutex);
    const uint64_t generation = generations;
    if (++arrived == num_ranks) {
      arrived = 0;
      ++generations;
      turned.notify_all();
      return;
    }
    if (!turned.wait_for(lock, std::chrono::seconds(60),
                         [&] { return generations != generation; })) {
      throw Error("comm", detail::concat("rank ", rank, " of ", num_ranks,
                                         " emulated ranks waited a minute in a host barrier for "
                                         "the others (did one fail?)"));
    }
  }
  const int num_ranks;
  std::mutex mutex;
  std::condition_variable turned;
  int arrived = 0;
  uint64_t generations = 0;
  std::vector<char*> windows;
};

namespace {

// Ranks emulated on one GPU wait on each other's kernels, which two CUDA defaults can deadlock
// (docs/ARCHITECTURE.md, "Expert parallelism emulated on one GPU"): refuse to start without the
// environment that prevents it, naming what to set.
void check_emulation_environment() {
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  MOK_CHECK_ARG(loading != nullptr && std::string_view(loading) == "EAGER", "CUDA_MODULE_LOADING",
                "ranks emulated on one GPU need CUDA_MODULE_LOADING=EAGER in the environment "
                "before CUDA starts (lazy loading can hold a kernel's first launch behind a "
                "peer's waiting kernel); it is ",
                loading != nullptr ? loading : "unset");
  const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  MOK_CHECK_ARG(
      queues != nullptr && std::atoi(queues) >= kEmulationHardwareQueues,
      "CUDA_DEVICE_MAX_CONNECTIONS",
      "ranks emulated on one GPU need CUDA_DEVICE_MAX_CONNECTIONS=", kEmulationHardwareQueues,
      " in the environment before CUDA starts (with the default 8 hardware queues two "
      "ranks' streams can share one, where a kernel waits behind its peer's waiting "
      "kernel); it is ",
      queues != nullptr ? queues : "unset");
}

}  // namespace

std::vector<Communicator> Communicator::emulate(int device, int num_ranks) {
  if (num_ranks > 1) check_emulation_environment();
  int num_devices = 0;
  MOK_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOK_CHECK_ARG(device >= 0 && device < num_devices, "device", "device ", device,
                " out of range [0, ", num_devices, ")");
  MOK_CHECK_ARG(num_ranks >= 1 && num_ranks <= 8, "num_ranks", "must be in [1, 8], got ",
                num_ranks);
  auto group = std::make_shared<EmulatedGroup>(num_ranks);
  std::vector<Communicator> result(static_cast<size_t>(num_ranks));
  for (int rank = 0; rank < num_ranks; ++rank) {
    result[rank].state_ = std::make_shared<State>();
    State& state = *result[rank].state_;
    state.rank = rank;
    state.num_ranks = num_ranks;
    state.device = device;
    state.group = group;
  }
  return result;
}

void Communicator::exchange_windows(char* own, char** all) const {
  EmulatedGroup& group = *state_->group;
  {
    std::lock_guard<std::mutex> lock(group.mutex);
    group.windows[static_cast<size_t>(state_->rank)] = own;
  }
  group.barrier(state_->rank);  // every rank has written its base
  {
    std::lock_guard<std::mutex> lock(group.mutex);
    for (int peer = 0; peer < group.num_ranks; ++peer) all[peer] = group.windows[peer];
  }
  group.barrier(state_->rank);  // every rank has read them (the next exchange may overwrite)
}

void Communicator::host_barrier() const {
  if (state_->group != nullptr) state_->group->barrier(state_->rank);
}

Communicator Communicator::wrap(ncclComm_t comm) {
#if defined(MOK_WITH_NCCL)
  MOK_CHECK_ARG(comm != nullptr, "comm", "null NCCL communicator");
  check_nccl_version();
  Communicator result;
  result.state_ = std::make_shared<State>();
  State& state = *result.state_;
  state.comm = comm;
  MOK_NCCL_CHECK(ncclCommUserRank(comm, &state.rank), comm);
  MOK_NCCL_CHECK(ncclCommCount(comm, &state.num_ranks), comm);
  MOK_NCCL_CHECK(ncclCommCuDevice(comm, &state.device), comm);
  return result;
#else
  throw Error("comm", "mok was built without NCCL: cannot wrap an NCCL communicator");
#endif
}

namespace {

// The communicators of `ep` ranks (emulated on one GPU or not), made by make() on first use and
// kept until the process ends: NCCL communicators are costly to make.
const std::vector<Communicator>& kept_communicators(
    bool emulated, int ep, const std::function<std::vector<Communicator>()>& make) {
  static std::mutex mutex;
  static auto* made = new std::map<std::pair<bool, int>, std::vector<Communicator>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = made->find({emulated, ep});
  if (found != made->end()) return found->second;
  return made->emplace(std::make_pair(emulated, ep), make()).first->second;
}

}  // namespace

const std::vector<Communicator>& local_communicators(int ep) {
  return kept_communicators(/*emulated=*/false, ep, [ep] {
    int num_devices = 0;
    MOK_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
    MOK_CHECK_ARG(ep >= 1 && ep <= num_devices, "--ep", "EP ", ep, " needs ", ep,
                  " GPUs in this process, ", num_devices, " visible");
    if (ep == 1) return std::vector<Communicator>{Communicator::single(0)};
    std::vector<int> devices;
    for (int device = 0; device < ep; ++device) devices.push_back(device);
    return Communicator::create_local(devices);
  });
}

const std::vector<Communicator>& emulated_communicators(int ep) {
  return kept_communicators(/*emulated=*/true, ep, [ep] {
    return ep == 1 ? std::vector<Communicator>{Communicator::single(0)}
                   : Communicator::emulate(0, ep);
  });
}

void for_each_rank(int num_ranks, const std::function<void(int rank)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_ranks));
  for (int rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        errors[static_cast<size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  // The first failure is rethrown; the other ranks' go to stderr first: when one rank stalls, its
  // own error (not its peers' timeouts waiting for it) says where.
  int first = -1;
  for (int rank = 0; rank < num_ranks; ++rank) {
    const std::exception_ptr& error = errors[static_cast<size_t>(rank)];
    if (!error) continue;
    if (first < 0) {
      first = rank;
      continue;
    }
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& other) {
      std::fprintf(stderr, "mok: rank %d of %d failed too: %s\n", rank, num_ranks, other.what());
    } catch (...) {
      std::fprintf(stderr, "mok: rank %d of %d failed too (not a std::exception)\n", rank,
                   num_ranks);
    }
  }
  if (first >= 0) std::rethrow_exception(errors[static_cast<size_t>(first)]);
}

}  // namespace mok
