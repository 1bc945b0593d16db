// The L2 partition probe of l2_partitions.hpp: the kernel, its launch and the cached maps.
#include "runtime/l2_partitions.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "kernels/comm/flags.cuh"
#include "kernels/megakernel/tickets.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/special_registers.cuh"
#include "mok/cuda_check.hpp"

namespace mok::runtime {
namespace {

constexpr int kProbeLines = 64;  // lines each SM times
constexpr int kLineWords = 16;   // 128-byte lines of uint64
constexpr int kLineStride = 37;  // lines between two probed ones, to spread them over slices
constexpr int kMinGapCycles = 30;
constexpr uint64_t kTimeoutNs = 200'000'000;  // a CTA that never gets its turn: give up

// Waits until *flag >= target; false after kTimeoutNs.
__device__ bool wait_at_least(const int* flag, int target) {
  const uint64_t start = ptx::global_timer_ns();
  while (*reinterpret_cast<const volatile int*>(flag) < target) {
    if (ptx::global_timer_ns() - start > kTimeoutNs) return false;
    __nanosleep(256);
  }
  return true;
}

// One thread per CTA, one CTA per SM (the shared memory request keeps two off one SM). Turn k:
// CTA 0 reads set k (its SM's partition now holds every line of it), then CTA k chases through
// the same lines (each address depends on the last value loaded, all zero) and records the mean
// latency. *failed is set when a CTA was not resident.
__global__ void l2_probe_kernel(const uint64_t* lines, uint32_t* mean_cycles, int* sm_ids,
                                int* turn, int* done, int* failed) {
  extern __shared__ uint8_t unused[];
  if (threadIdx.x != 0) return;
  const int cta = static_cast<int>(blockIdx.x), ctas = static_cast<int>(gridDim.x);
  sm_ids[cta] = static_cast<int>(ptx::sm_id());
  unused[0] = 0;
  const auto set_of = [&](int k) {
    return lines + static_cast<size_t>(k) * kProbeLines * kLineStride * kLineWords;
  };
  if (cta == 0) {
    uint64_t sum = 0;
    for (int k = 1; k < ctas; ++k) {
      const uint64_t* set = set_of(k);
      for (int line = 0; line < kProbeLines; ++line)
        sum += ptx::load_l2_only(set + line * kLineStride * kLineWords);
      __threadfence();
      atomicExch(turn, k + static_cast<int>(sum));  // sum is 0: the loads completed first
      if (!wait_at_least(done, k)) {
        atomicExch(failed, 1);
        return;
      }
    }
  } else {
    if (!wait_at_least(turn, cta)) {
      atomicExch(failed, 1);
      return;
    }
    const uint64_t* set = set_of(cta);
    uint64_t chase = 0;
    const long long start = clock64();
    for (int line = 0; line < kProbeLines; ++line)
      chase += ptx::load_l2_only(set + line * kLineStride * kLineWords + chase);
    const long long stop = clock64();
    mean_cycles[cta] =
        static_cast<uint32_t>((stop - start) / kProbeLines) + static_cast<uint32_t>(chase);
    __threadfence();
    atomicAdd(done, 1);
  }
}

// Device memory the probe frees whatever happens; null when the allocation failed (the probe then
// does not run: a full GPU must not stop the layer, which only loses the map).
class ProbeBuffer {
 public:
  explicit ProbeBuffer(size_t bytes) {
    if (cudaMalloc(&pointer_, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the allocation error
      pointer_ = nullptr;
    }
  }
  ~ProbeBuffer() {
    if (pointer_ != nullptr) cudaFree(pointer_);
  }
  ProbeBuffer(const ProbeBuffer&) = delete;
  ProbeBuffer& operator=(const ProbeBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(pointer_);
  }

 private:
  void* pointer_ = nullptr;
};

// Runs the probe once; false when it could not (no memory for it, or not every CTA resident).
bool probe_once(int num_sms, std::vector<int>* sm_ids, std::vector<double>* latency) {
  cudaDeviceProp properties{};
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  const size_t line_bytes =
      static_cast<size_t>(num_sms) * kProbeLines * kLineStride * kLineWords * sizeof(uint64_t);
  const ProbeBuffer lines(line_bytes), cycles(num_sms * sizeof(uint32_t));
  const ProbeBuffer ints((num_sms + 3) * sizeof(int));  // sm ids, then turn, done, failed
  if (lines.as<void>() == nullptr || cycles.as<void>() == nullptr || ints.as<void>() == nullptr) {
    return false;
  }
  MOK_CUDA_CHECK(cudaMemset(lines.as<void>(), 0, line_bytes));
  MOK_CUDA_CHECK(cudaMemset(cycles.as<void>(), 0, num_sms * sizeof(uint32_t)));
  MOK_CUDA_CHECK(cudaMemset(ints.as<void>(), 0, (num_sms + 3) * sizeof(int)));
  {
    // Evict what the memset left in L2 (perhaps in both partitions), so that the reference SM's
    // reads are the first ones: write twice the L2's size elsewhere.
    const size_t flush_bytes = 2 * static_cast<size_t>(properties.l2CacheSize);
    const ProbeBuffer flush(flush_bytes);
    if (flush.as<void>() == nullptr) return false;
    MOK_CUDA_CHECK(cudaMemset(flush.as<void>(), 1, flush_bytes));
  }
  // More than half an SM's shared memory: one CTA per SM.
  const int shared_bytes = static_cast<int>(properties.sharedMemPerMultiprocessor / 2 + 1024);
  MOK_CUDA_CHECK(cudaFuncSetAttribute(l2_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      shared_bytes));
  int* const flags = ints.as<int>();
  l2_probe_kernel<<<num_sms, 32, shared_bytes>>>(lines.as<uint64_t>(), cycles.as<uint32_t>(), flags,
                                                 flags + num_sms, flags + num_sms + 1,
                                                 flags + num_sms + 2);
  MOK_CUDA_CHECK_LAUNCH();
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int> host_ints(num_sms + 3);
  std::vector<uint32_t> host_cycles(num_sms);
  MOK_CUDA_CHECK(cudaMemcpy(host_ints.data(), ints.as<int>(), host_ints.size() * sizeof(int),
                            cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaMemcpy(host_cycles.data(), cycles.as<uint32_t>(), num_sms * sizeof(uint32_t),
                            cudaMemcpyDeviceToHost));
  if (host_ints[num_sms + 2] != 0) return false;
  sm_ids->assign(host_ints.begin(), host_ints.begin() + num_sms);
  latency->assign(num_sms, 0.0);
  for (int cta = 1; cta < num_sms; ++cta) (*latency)[cta] = host_cycles[cta];
  return true;
}

// Probes twice, with different reference SMs as it happens: both must give the same split. On
// success fills map's table and counts; false leaves them (one partition).
bool probe_split(int num_sms, L2PartitionMap* map) {
  std::vector<uint8_t> table[2];
  for (int run = 0; run < 2; ++run) {
    std::vector<int> sm_ids;
    std::vector<double> latency;
    if (num_sms < 2 || !probe_once(num_sms, &sm_ids, &latency)) return false;
    if (run == 0) {
      for (int cta = 0; cta < num_sms; ++cta) {
        if (sm_ids[cta] >= 0 && sm_ids[cta] < kMaxSmIds) {
          map->probe_latency[sm_ids[cta]] = cta == 0 ? -1 : static_cast<int>(latency[cta]);
        }
      }
    }
    int partitions = 1;
    const std::vector<uint8_t> by_cta = classify_l2_partitions(latency, kMinGapCycles, &partitions);
    if (partitions != 2) return false;
    table[run].assign(kMaxSmIds, 2);  // 2: not seen
    for (int cta = 0; cta < num_sms; ++cta) {
      if (sm_ids[cta] < 0 || sm_ids[cta] >= kMaxSmIds) return false;
      table[run][sm_ids[cta]] = by_cta[cta];
    }
  }
  // The second run's partition numbers are swapped when its reference SM sat on the other side.
  bool swapped = false;
  for (int id = 0; id < kMaxSmIds; ++id) {
    if (table[0][id] != 2 && table[1][id] != 2) {
      swapped = table[0][id] != table[1][id];
      break;
    }
  }
  for (int id = 0; id < kMaxSmIds; ++id) {
    const uint8_t second = table[1][id] == 2 ? 2 : swapped ? 1 - table[1][id] : table[1][id];
    if (second != table[0][id]) return false;  // the runs disagree: do not trust either
  }
  for (int id = 0; id < kMaxSmIds; ++id) {
    if (table[0][id] == 2)
      table[0][id] = 0;
    else
      ++map->sms_per_partition[table[0][id]];
  }
  uint8_t* device_table = nullptr;
  MOK_CUDA_CHECK(cudaMalloc(&device_table, kMaxSmIds));
  MOK_CUDA_CHECK(cudaMemcpy(device_table, table[0].data(), kMaxSmIds, cudaMemcpyHostToDevice));
  map->device_table = device_table;  // kept for the process
  map->num_partitions = 2;
  return true;
}

std::unique_ptr<L2PartitionMap> probe_map() {
  auto map = std::make_unique<L2PartitionMap>();
  int device = 0, num_sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  // The probe times L2 reads: work still running on the device (another stream's kernels, a peer's
  // reads over NVLink) can blur them or keep CTAs off SMs, so it starts on an idle device and has
  // a few tries.
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  constexpr int kAttempts = 3;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    map->probe_latency.assign(kMaxSmIds, 0);
    map->sms_per_partition[0] = map->sms_per_partition[1] = 0;
    if (probe_split(num_sms, map.get())) break;
  }
  return map;
}

}  // namespace

const L2PartitionMap& l2_partition_map() {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<L2PartitionMap>> maps;
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<L2PartitionMap>& entry = maps[device];
  if (!entry) entry = probe_map();
  return *entry;
}

}  // namespace mok::runtime
