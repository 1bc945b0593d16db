// The GPU's SM clock and power draw, sampled from a background thread while a benchmark's timed
// loops run: the C++ counterpart of bench/baselines/gpu_monitor.py, so that mok's loops carry the
// clock they ran at beside the baseline's (under the 700 W cap the clock settles where the power
// drawn meets the cap, and a time means little without it).
//
// NVML is opened at run time (libnvidia-ml.so.1, which the driver installs): nothing to link, and
// a machine without it (CI, no GPU) gets a note instead of samples. start(name) and stop(name)
// mark a window; windows(prefix) gives the median clock and power of the samples taken in it.
// NVML's power reading is the driver's average over its last second on Hopper, so a loop shorter
// than that includes the warm-up just before it, which runs the same work.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mok::bench {

class GpuMonitor {
 public:
  struct Window {
    double clock_mhz = 0;  // medians of the window's samples
    double power_w = 0;
    int samples = 0;
  };

  // Samples CUDA device `device` every `period` from now until destruction.
  explicit GpuMonitor(int device, std::chrono::milliseconds period = std::chrono::milliseconds(5))
      : period_(period) {
    if (!open_nvml(device)) return;
    thread_ = std::thread([this] { sample_loop(); });
  }
  ~GpuMonitor() {
    stopping_.store(true);
    if (thread_.joinable()) thread_.join();
    if (shutdown_ != nullptr) shutdown_();
    if (library_ != nullptr) dlclose(library_);
  }
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  bool sampling() const { return thread_.joinable(); }
  // Why nothing is sampled (empty while sampling).
  const std::string& note() const { return note_; }

  void start(const std::string& name) {
    const std::lock_guard<std::mutex> lock(mutex_);
    starts_[name] = Clock::now();
  }
  // Closes the window `name` opened by start (a stop without a start is ignored).
  void stop(const std::string& name) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto start = starts_.find(name);
    if (start == starts_.end()) return;
    const Clock::time_point end = Clock::now();
    std::vector<double> clocks, powers;
    for (const Sample& sample : samples_) {
      if (sample.time < start->second || sample.time > end) continue;
      clocks.push_back(sample.clock_mhz);
      powers.push_back(sample.power_w);
    }
    starts_.erase(start);
    if (clocks.empty()) return;
    windows_[name] = {median(clocks), median(powers), static_cast<int>(clocks.size())};
  }
  // The medians of the windows whose names begin with `prefix`, by the rest of their names; a
  // window without samples (not sampling, or shorter than the period) is not among them.
  std::map<std::string, Window> windows(const std::string& prefix) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, Window> found;
    for (const auto& [name, window] : windows_) {
      if (name.compare(0, prefix.size(), prefix) == 0) found[name.substr(prefix.size())] = window;
    }
    return found;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Sample {
    Clock::time_point time;
    double clock_mhz, power_w;
  };
  // NVML's C interface, the few calls used (nvml.h's signatures; 0 is NVML_SUCCESS).
  using Device = struct NvmlDevice*;
  using InitFn = int (*)();
  using ShutdownFn = int (*)();
  using HandleByBusIdFn = int (*)(const char*, Device*);
  using ClockInfoFn = int (*)(Device, int, unsigned int*);
  using PowerUsageFn = int (*)(Device, unsigned int*);
  static constexpr int kClockSm = 1;  // NVML_CLOCK_SM

  static double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    const size_t mid = values.size() / 2;
    return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
  }

  template <class Fn>
  bool symbol(const char* name, Fn& fn) {
    fn = reinterpret_cast<Fn>(dlsym(library_, name));
    if (fn == nullptr) note_ = std::string("NVML has no ") + name;
    return fn != nullptr;
  }

  bool open_nvml(int device) {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) {
      note_ = "no NVML (libnvidia-ml.so.1 did not load)";
      return false;
    }
    InitFn init = nullptr;
    HandleByBusIdFn by_bus_id = nullptr;
    if (!symbol("nvmlInit_v2", init) || !symbol("nvmlShutdown", shutdown_) ||
        !symbol("nvmlDeviceGetHandleByPciBusId_v2", by_bus_id) ||
        !symbol("nvmlDeviceGetClockInfo", clock_info_) ||
        !symbol("nvmlDeviceGetPowerUsage", power_usage_)) {
      shutdown_ = nullptr;
      return false;
    }
    if (init() != 0) {
      note_ = "nvmlInit failed";
      shutdown_ = nullptr;
      return false;
    }
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) != cudaSuccess) {
      cudaGetLastError();
      note_ = "no PCI bus id for CUDA device " + std::to_string(device);
      return false;
    }
    if (by_bus_id(bus_id, &device_) != 0) {
      note_ = std::string("NVML does not know the GPU at ") + bus_id;
      return false;
    }
    return true;
  }

  void sample_loop() {
    while (!stopping_.load()) {
      unsigned int mhz = 0, milliwatts = 0;
      if (clock_info_(device_, kClockSm, &mhz) == 0 && power_usage_(device_, &milliwatts) == 0) {
        const std::lock_guard<std::mutex> lock(mutex_);
        samples_.push_back({Clock::now(), static_cast<double>(mhz), milliwatts * 1e-3});
      }
      std::this_thread::sleep_for(period_);
    }
  }

  std::chrono::milliseconds period_;
  std::string note_;
  void* library_ = nullptr;
  ShutdownFn shutdown_ = nullptr;
  ClockInfoFn clock_info_ = nullptr;
  PowerUsageFn power_usage_ = nullptr;
  Device device_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::vector<Sample> samples_;
  std::map<std::string, Clock::time_point> starts_;
  std::map<std::string, Window> windows_;
};

}  // namespace mok::bench
