#include "cpu_memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace mok::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// What the count leaves out: the program itself, thread stacks, and the allocator's slack (freed
// blocks it keeps for reuse instead of giving back).
constexpr double kSlackFraction = 0.05;
constexpr double kSlackBytes = 64.0 * 1024 * 1024;

// The buffers of one forward or backward of the reference engine (src/reference/engine.cpp) in
// `real_bytes` arithmetic (4: the reference, 8: the oracle), over `ranks` ranks of
// `tokens / ranks` tokens each; the larger of the two passes, which do not overlap.
double engine_bytes(const LayerShape& shape, double tokens, double ranks, double real_bytes,
                    double threads) {
  const double hidden = static_cast<double>(shape.hidden);
  const double inter = static_cast<double>(shape.intermediate);
  const double shared = static_cast<double>(shape.shared_intermediate);
  const double top_k = static_cast<double>(shape.top_k), rows = tokens * top_k;
  const double schedule = rows * 16;  // RowRef and the expert of each row
  // Combine slots (T, k, H); the shared expert's output and y (T, H); per-thread scratch.
  const double forward = real_bytes * (rows * hidden + 2 * tokens * hidden +
                                       threads * (3 * hidden + 3 * inter + 3 * shared));
  // d_topk_w (T, k), dx slots (T, k, H), per-row d_gate, d_up, w·h (rows, I), one rank's shared
  // expert operands (T_r, 3 I_s) and dx (T_r, H), dx of every rank (T, H), scratch.
  const double backward = real_bytes * (rows + rows * hidden + 3 * rows * inter +
                                        tokens / ranks * (3 * shared + hidden) + tokens * hidden +
                                        threads * (3 * hidden + 4 * std::max(inter, shared)));
  return schedule + std::max(forward, backward);
}

// What an FP8 mode adds to a pass of engine_bytes (src/reference/quantized_engine.cpp): every
// quantized operand keeps its E4M3 bytes and their decoded fp32 values (5 bytes an element): the
// weights twice (forward and dgrad layouts) and x and dy; and each thread's expert being reduced
// into weight gradients holds its rows' operands transposed (at most all rows at once).
double quantized_bytes(const LayerShape& shape, double tokens, double real_bytes, double threads) {
  const double hidden = static_cast<double>(shape.hidden);
  const double inter = static_cast<double>(shape.intermediate);
  const double shared = static_cast<double>(shape.shared_intermediate);
  const double weights =
      3.0 * static_cast<double>(shape.num_experts) * inter * hidden + 3.0 * shared * hidden;
  const double rows = tokens * static_cast<double>(shape.top_k);
  const double transposed_rows = std::min(threads * tokens, rows);
  return 5 * (2 * weights + 2 * tokens * hidden) +
         transposed_rows * (3 * std::max(inter, shared) * real_bytes + 8 * hidden);
}

}  // namespace

double CpuMemory::peak() const {
  const double counted = weights + outputs + std::max({run, ep1_run, oracle});
  return counted * (1 + kSlackFraction) + kSlackBytes;
}

std::string format_bytes(double bytes) {
  char text[32];
  if (bytes >= kGiB) {
    std::snprintf(text, sizeof(text), "%.1f GiB", bytes / kGiB);
  } else {
    std::snprintf(text, sizeof(text), "%.0f MiB", std::ceil(bytes / (1024.0 * 1024.0)));
  }
  return text;
}

std::string CpuMemory::describe() const {
  std::string text = "weights and inputs " + format_bytes(weights) +
                     ", outputs and fp32 gradients " + format_bytes(outputs) + ", run buffers " +
                     format_bytes(run);
  if (ep1_run > 0) text += ", EP 1 comparison run " + format_bytes(ep1_run);
  if (oracle > 0) text += ", fp64 oracle " + format_bytes(oracle);
  return text;
}

CpuMemory cpu_memory(const LayerShape& shape, int64_t tokens_per_rank, int64_t ep, bool check,
                     int num_threads, Precision precision) {
  const double hidden = static_cast<double>(shape.hidden), top_k = static_cast<double>(shape.top_k);
  const double tokens = static_cast<double>(tokens_per_rank) * static_cast<double>(ep);
  const double ranks = static_cast<double>(ep), threads = std::max(num_threads, 1);
  const double routed = 3.0 * static_cast<double>(shape.num_experts) *
                        static_cast<double>(shape.intermediate) * hidden;
  const double shared = 3.0 * static_cast<double>(shape.shared_intermediate) * hidden;

  CpuMemory memory;
  // Problem: bf16 weights, x and dy (T, H) bf16, topk_idx and topk_w (T, k).
  memory.weights = 2 * (routed + shared) + 4 * tokens * hidden + 8 * tokens * top_k;
  // ProblemOutputs: y and dx (T, H) bf16, d_topk_w (T, k) fp32, fp32 gradients of the routed
  // experts and of each rank's shared expert.
  const double token_outputs = 4 * tokens * hidden + 4 * tokens * top_k;
  memory.outputs = token_outputs + 4 * (routed + ranks * shared);
  const bool quantized = precision != Precision::kBf16;
  const double quantized_run = quantized ? quantized_bytes(shape, tokens, 4, threads) : 0;
  memory.run = engine_bytes(shape, tokens, ranks, 4, threads) + quantized_run;
  if (!check) return memory;
  if (ep > 1) {
    memory.ep1_run = token_outputs + 4 * (routed + shared) +
                     engine_bytes(shape, tokens, 1, 4, threads) + quantized_run;
  }
  // The oracle (one rank): fp64 gradients, and y while its backward runs (the engine's buffers
  // count dx and d_topk_w); then the comparison's fp32 sums of the shared gradients over ranks.
  const double oracle_result = 8 * (routed + shared) + 8 * tokens * hidden;
  memory.oracle = oracle_result + engine_bytes(shape, tokens, 1, 8, threads) + 4 * shared;
  // An FP8 mode's yardstick, the quantized oracle, runs while the exact one's result (with dx
  // and d_topk_w) is kept for the comparison.
  if (quantized) {
    memory.oracle +=
        oracle_result + 8 * tokens * (hidden + top_k) + quantized_bytes(shape, tokens, 8, threads);
  }
  return memory;
}

double peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  double kilobytes = 0;
  while (status >> key) {
    if (key == "VmHWM:" && status >> kilobytes) return kilobytes * 1024.0;
    status.ignore(4096, '\n');
  }
  return 0;
}

double available_memory_bytes() {
  double available = 0;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kilobytes = 0;
  while (meminfo >> key >> kilobytes) {
    if (key == "MemAvailable:") {
      available = kilobytes * 1024.0;
      break;
    }
    meminfo.ignore(256, '\n');
  }
  // A container's limit (cgroup v2) may be far below what the machine has free; of its usage,
  // only anonymous memory is not reclaimed for us (the page cache is).
  std::ifstream limit_file("/sys/fs/cgroup/memory.max");
  double limit = 0;
  if (limit_file >> limit) {  // "max": no limit
    double used = 0;
    std::ifstream stat_file("/sys/fs/cgroup/memory.stat");
    while (stat_file >> key >> used) {
      if (key == "anon") break;
      used = 0;
    }
    if (used == 0) std::ifstream("/sys/fs/cgroup/memory.current") >> used;
    const double left = std::max(limit - used, 0.0);
    available = available > 0 ? std::min(available, left) : left;
  }
  return available;
}

}  // namespace mok::cli
