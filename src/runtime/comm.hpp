// The communicator mok's expert parallelism runs on: one NCCL communicator per rank with the
// device API (NCCL >= 2.28), every rank reachable by NVLink loads and stores (one LSA team).
// EP = 1 needs no NCCL at all (`Communicator::single`).
//
// One process can drive every local GPU: `create_local` makes one communicator per device
// (ncclCommInitAll), and `for_each_rank` runs the collective calls that follow (workspace
// creation, teardown) on one host thread per GPU.
//
// Where GPUs are scarce, `emulate` puts several ranks on one GPU: each rank's window is plain
// device memory of that GPU, which the peers' kernels address directly (no NCCL), and each rank
// takes a share of the SMs for the kernels that wait on peers (CommWorkspace::num_sms), so the
// ranks' kernels, launched from their own host threads and streams, run side by side. The very
// same kernels run as across GPUs, so EP invariance can be tested on one GPU. The callers must
// not synchronise the device (cudaDeviceSynchronize, synchronous copies) while another rank's
// kernels may wait on them: the ranks meet at host_barrier() first.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(MOK_WITH_NCCL)
#include <nccl.h>
#else
typedef struct ncclComm* ncclComm_t;
#endif

namespace mok {

// The hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, CUDA's maximum) that ranks emulated on one GPU
// need, so that no two ranks' streams share one (Communicator::emulate).
inline constexpr int kEmulationHardwareQueues = 32;

class Communicator {
 public:
  // A single rank on `device`: EP = 1, no NCCL.
  static Communicator single(int device);
  // Rank i drives devices[i]; all ranks live in this process. Throws mok::Error("comm", ...) when
  // NCCL is missing, too old for the device API, or a device is absent.
  static std::vector<Communicator> create_local(const std::vector<int>& devices);
  // The caller's communicator (e.g. made from a unique id); mok never destroys it.
  static Communicator wrap(ncclComm_t comm);
  // num_ranks ranks emulated on `device` (see above); no NCCL needed. Throws mok::Error for
  // num_ranks > 1 unless the process runs with CUDA_MODULE_LOADING=EAGER and
  // CUDA_DEVICE_MAX_CONNECTIONS >= kEmulationHardwareQueues, set before CUDA starts: a lazily
  // loaded kernel's first launch, or a kernel in a hardware queue it shares with another rank's
  // stream, can wait for a peer's kernel that waits for this rank (docs/ARCHITECTURE.md).
  static std::vector<Communicator> emulate(int device, int num_ranks);

  int rank() const { return state_->rank; }
  int num_ranks() const { return state_->num_ranks; }
  int device() const { return state_->device; }
  ncclComm_t nccl() const { return state_->comm; }  // null for `single` and `emulate`
  // Ranks that share this rank's GPU: 1, or num_ranks when emulated.
  int ranks_on_device() const { return state_->group != nullptr ? state_->num_ranks : 1; }

  // Emulated ranks only: the window bases of every rank, once each rank has given its own (a
  // host barrier across the ranks' threads); and a plain barrier (a no-op for other ranks).
  // Both throw mok::Error after a minute without every rank.
  void exchange_windows(char* own, char** all) const;  // all: room for num_ranks()
  void host_barrier() const;

 private:
  struct EmulatedGroup;
  struct State {
    ncclComm_t comm = nullptr;
    bool owned = false;
    int rank = 0, num_ranks = 1, device = 0;
    std::shared_ptr<EmulatedGroup> group;  // emulated ranks: shared by all of them
    ~State();
  };
  std::shared_ptr<State> state_;
};

// The communicators of this process's first `ep` GPUs (EP = 1: one rank without NCCL), made on
// first use and kept until the process ends: NCCL communicators are costly to make, and one
// process (the CLI, a test binary) may run EP = 2 and then EP = 1. Throws mok::Error("--ep", ...)
// when fewer GPUs are visible.
const std::vector<Communicator>& local_communicators(int ep);
// The same, `ep` ranks emulated on GPU 0 (Communicator::emulate), made on first use and kept.
const std::vector<Communicator>& emulated_communicators(int ep);

// Runs fn(rank) for rank = 0..num_ranks-1 on one host thread each, joins them, and rethrows the
// first exception (in rank order), after writing the other ranks' failures to stderr.
void for_each_rank(int num_ranks, const std::function<void(int rank)>& fn);

namespace detail {
// "NCCL 2.28.9", or the reason NCCL is not there.
std::string nccl_version_text();
}  // namespace detail

}  // namespace mok
