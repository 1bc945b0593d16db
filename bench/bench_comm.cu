// Expert-parallel dispatch and combine on two GPUs at a preset's shape: GB/s of NVLink payload per
// direction against the number of SMs that move rows, for each number of threads per copy CTA.
//
//   bench_comm [options]   (bench_comm --help lists them)
// (vector:N = one warp per row, N threads per CTA)
//
// Each iteration runs the whole sequence on both GPUs (schedule, dispatch, combine push, reduce),
// with a device-side barrier before each timed kernel so that both ranks move data at once (both
// link directions busy, as in a real layer). Reported per phase: the median over iterations of
// the kernel time, the maximum over ranks; GB/s = bytes that crossed NVLink into (dispatch) or out
// of (combine) the slower rank / that time. `--splits` writes the row counts each rank sends to
// each peer, for the torch all_to_all_single baseline to move the same bytes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_options.hpp"
#include "mok/comm.hpp"
#include "mok/cuda_check.hpp"
#include "mok/error.hpp"
#include "mok/gpu.hpp"
#include "mok/shape.hpp"

namespace {

struct Args {
  std::string preset = "deepseek-v3";
  int64_t tokens = 8192;
  std::vector<int> sms = {4, 8, 16, 24, 32, 132};
  std::vector<std::string> methods = {"vector:1024", "vector:512"};
  int iters = 20, warmup = 3;
  std::string out = "comm.json", splits;
};

constexpr char kUsage[] =
    R"(bench_comm: expert-parallel dispatch and combine on two Hopper GPUs at a preset's shape, GB/s of
NVLink payload per direction against the SMs that move rows, for each copy setting.

usage: bench_comm [options]

  --preset NAME      layer shape (default deepseek-v3; `mok presets` lists them)
  --tokens N         tokens per rank (default 8192)
  --sms N,...        SM counts to sweep (default 4,8,16,24,32,132)
  --methods M,...    vector:THREADS: one warp per row, THREADS per CTA (default
                     vector:1024,vector:512)
  --iters N          timed iterations (default 20)
  --out FILE         results JSON (default comm.json)
  --splits FILE      also write the rows each rank sends each peer (for the torch baseline)
)";

// Returns false when --help was asked for.
bool parse(int argc, char** argv, Args& args) {
  return mok::bench::parse_options(
      argc, argv, kUsage, [&](const std::string& key, const std::string& value) {
        if (key == "--preset")
          args.preset = value;
        else if (key == "--tokens")
          args.tokens = mok::bench::integer_option(key, value);
        else if (key == "--iters")
          args.iters = static_cast<int>(mok::bench::integer_option(key, value));
        else if (key == "--out")
          args.out = value;
        else if (key == "--splits")
          args.splits = value;
        else if (key == "--methods") {
          args.methods = mok::bench::list_option(key, value);
          for (const std::string& method : args.methods) {
            if (method.rfind("vector:", 0) != 0) {
              throw mok::bench::UsageError(key, "unknown method '" + method + "' (vector:THREADS)");
            }
            const long long threads = mok::bench::integer_option(key, method.substr(7));
            if (threads < 32 || threads > mok::kVectorMaxThreads || threads % 32 != 0) {
              throw mok::bench::UsageError(key, "vector:THREADS needs a multiple of 32 in [32, " +
                                                    std::to_string(mok::kVectorMaxThreads) +
                                                    "], got " + method.substr(7));
            }
          }
        } else if (key == "--sms")
          args.sms = mok::bench::integer_list_option(key, value);
        else
          return false;
        return true;
      });
}

// Uniform routing: k distinct experts per token.
std::vector<int32_t> uniform_routing(int64_t tokens, int64_t experts, int64_t top_k,
                                     uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
  for (int64_t token = 0; token < tokens; ++token) {
    for (int64_t slot = 0; slot < top_k; ++slot) {
      int32_t expert;
      bool fresh;
      do {
        expert = static_cast<int32_t>(generator() % static_cast<uint64_t>(experts));
        fresh = std::find(&ids[token * top_k], &ids[token * top_k + slot], expert) ==
                &ids[token * top_k + slot];
      } while (!fresh);
      ids[token * top_k + slot] = expert;
    }
  }
  return ids;
}

__global__ void fill_pseudo_random(uint16_t* values, int64_t count, uint32_t seed) {
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t hash = static_cast<uint32_t>(index) * 2654435761u ^ seed;
    hash ^= hash >> 15;
    hash *= 2246822519u;
    hash ^= hash >> 13;
    values[index] = static_cast<uint16_t>(0x3c00u | (hash & 0x83ffu));  // bf16 in ±[0.0078, 0.0156)
  }
}

double median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// One measured configuration: a copy method and a number of SMs; both phases per iteration.
struct Config {
  std::string method;  // "vector-1024"
  mok::CommCopyConfig copy;
  int num_sms;
  std::vector<float> dispatch_ms[2], combine_ms[2], reduce_ms[2],
      schedule_ms[2];  // [rank][iteration]
};

void write_json(const Args& args, const mok::LayerShape& shape, const std::string& device,
                const std::vector<Config>& configs,
                const std::vector<std::vector<int64_t>>& rows_sent, int64_t row_bytes) {
  std::FILE* file = std::fopen(args.out.c_str(), "w");
  MOK_CHECK_ARG(file != nullptr, "--out", "cannot write ", args.out);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const char* commit = std::getenv("MOK_COMMIT");
  std::fprintf(file,
               "{\n  \"schema\": \"mok-bench/1\",\n  \"commit\": \"%s\",\n  \"device\": \"%s\",\n",
               commit ? commit : "unknown", device.c_str());
  std::fprintf(file, "  \"date\": \"%s\",\n  \"cases\": [\n", date);
  bool first = true;
  for (const Config& config : configs) {
    for (const char* phase : {"dispatch", "combine"}) {
      const bool is_dispatch = std::strcmp(phase, "dispatch") == 0;
      double worst_ms = 0, worst_gbps = 1e30;
      for (int rank = 0; rank < 2; ++rank) {
        const double ms = median(is_dispatch ? config.dispatch_ms[rank] : config.combine_ms[rank]);
        // Dispatch pulls the peer's rows into this rank; combine pushes the peer's rows back.
        const int64_t remote_rows = rows_sent[1 - rank][rank];
        worst_ms = std::max(worst_ms, ms);
        worst_gbps = std::min(worst_gbps, remote_rows * row_bytes / (ms * 1e6));
      }
      const double reduce = std::max(median(config.reduce_ms[0]), median(config.reduce_ms[1]));
      const double schedule =
          std::max(median(config.schedule_ms[0]), median(config.schedule_ms[1]));
      std::fprintf(file,
                   "%s    {\"name\": \"%s-%s-sms%d\", \"preset\": \"%s\", \"ep\": 2, "
                   "\"tokens_per_rank\": %lld, \"precision\": \"bf16\", \"phase\": \"%s\", "
                   "\"method\": \"%s\", \"num_sms\": %d, \"mok_ms\": %.4f, \"baseline\": null, "
                   "\"baseline_ms\": null, \"speedup\": null, \"useful_tflops\": null, "
                   "\"gbps\": %.1f, \"dense_gemm_tflops\": null, \"reduce_ms\": %.4f, "
                   "\"schedule_ms\": %.4f, "
                   "\"payload_bytes\": [%lld, %lld]}",
                   first ? "" : ",\n", phase, config.method.c_str(), config.num_sms,
                   args.preset.c_str(), static_cast<long long>(args.tokens), phase,
                   config.method.c_str(), config.num_sms, worst_ms, worst_gbps, reduce, schedule,
                   static_cast<long long>(rows_sent[1][0] * row_bytes),
                   static_cast<long long>(rows_sent[0][1] * row_bytes));
      std::printf("%-8s %-11s sms %3d  %8.3f ms  %6.1f GB/s  (reduce %.3f ms, schedule %.3f ms)\n",
                  phase, config.method.c_str(), config.num_sms, worst_ms, worst_gbps, reduce,
                  schedule);
      first = false;
    }
  }
  std::fprintf(file, "\n  ]\n}\n");
  std::fclose(file);
}

}  // namespace

int run(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) return 0;
  if (args.iters < 1) throw mok::bench::UsageError("--iters", "must be >= 1");
  if (args.tokens < 1) throw mok::bench::UsageError("--tokens", "must be >= 1");
  const mok::GpuSummary gpus = mok::query_gpus();
  if (gpus.num_hopper_gpus < 2) {
    throw mok::Error("", "needs 2 Hopper GPUs; found " + gpus.description);
  }
  const mok::LayerShape shape = mok::find_preset(args.preset).shape;
  const int ep = 2;
  const int64_t tokens = args.tokens, top_k = shape.top_k, experts_local = shape.num_experts / ep;
  const int64_t row_bytes = shape.hidden * 2;

  std::vector<std::vector<int32_t>> routing(ep);
  for (int rank = 0; rank < ep; ++rank) {
    routing[rank] = uniform_routing(tokens, shape.num_experts, top_k, 1000 + rank);
  }
  std::vector<std::vector<int64_t>> rows_sent(ep, std::vector<int64_t>(ep, 0));  // [source][dest]
  for (int source = 0; source < ep; ++source) {
    for (int32_t expert : routing[source]) ++rows_sent[source][expert / experts_local];
  }
  if (!args.splits.empty()) {
    std::FILE* file = std::fopen(args.splits.c_str(), "w");
    MOK_CHECK_ARG(file != nullptr, "--splits", "cannot write ", args.splits);
    std::fprintf(file, "{\"row_bytes\": %lld, \"rows_sent\": [[%lld, %lld], [%lld, %lld]]}\n",
                 static_cast<long long>(row_bytes), static_cast<long long>(rows_sent[0][0]),
                 static_cast<long long>(rows_sent[0][1]), static_cast<long long>(rows_sent[1][0]),
                 static_cast<long long>(rows_sent[1][1]));
    std::fclose(file);
  }

  const std::vector<std::unique_ptr<mok::CommEngine>> engines =
      mok::CommEngine::create_local({0, 1}, shape, tokens);
  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<Config> configs;
  for (const std::string& method : args.methods) {
    mok::CommCopyConfig copy;
    std::string label = method;
    // vector:THREADS, checked by parse()
    copy.threads_per_cta =
        static_cast<int>(mok::bench::integer_option("--methods", method.substr(7)));
    label = "vector-" + method.substr(7);
    for (int sms : args.sms) {
      copy.num_ctas = sms;
      configs.push_back(Config{label, copy, sms, {}, {}, {}, {}});
    }
  }

  mok::CommEngine::for_each_rank(ep, [&](int rank) {
    mok::CommEngine& engine = *engines[rank];
    MOK_CUDA_CHECK(cudaSetDevice(engine.device()));
    int32_t* topk_idx = nullptr;
    float* topk_w = nullptr;
    mok::bf16* y = nullptr;
    MOK_CUDA_CHECK(cudaMalloc(&topk_idx, routing[rank].size() * 4));
    MOK_CUDA_CHECK(cudaMemcpy(topk_idx, routing[rank].data(), routing[rank].size() * 4,
                              cudaMemcpyHostToDevice));
    const std::vector<float> weights(routing[rank].size(), 1.0f / static_cast<float>(top_k));
    MOK_CUDA_CHECK(cudaMalloc(&topk_w, weights.size() * 4));
    MOK_CUDA_CHECK(cudaMemcpy(topk_w, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
    MOK_CUDA_CHECK(cudaMalloc(&y, tokens * row_bytes));
    fill_pseudo_random<<<1024, 256>>>(reinterpret_cast<uint16_t*>(engine.x()),
                                      tokens * shape.hidden, 7u + rank);
    fill_pseudo_random<<<1024, 256>>>(reinterpret_cast<uint16_t*>(engine.expert_y()),
                                      engine.rows_capacity() * shape.hidden, 99u + rank);
    MOK_CUDA_CHECK_LAUNCH();
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    cudaStream_t stream;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t marks[7];
    for (cudaEvent_t& mark : marks) MOK_CUDA_CHECK(cudaEventCreate(&mark));
    for (Config& config : configs) {
      const mok::CommCopyConfig& copy = config.copy;
      for (int iteration = 0; iteration < args.warmup + args.iters; ++iteration) {
        MOK_CUDA_CHECK(cudaEventRecord(marks[5], stream));
        engine.schedule(topk_idx, tokens, stream);  // includes waiting for the peer's ids
        MOK_CUDA_CHECK(cudaEventRecord(marks[6], stream));
        engine.rank_barrier(stream);  // both ranks start the pull together
        MOK_CUDA_CHECK(cudaEventRecord(marks[0], stream));
        engine.dispatch(copy, stream);
        MOK_CUDA_CHECK(cudaEventRecord(marks[1], stream));
        engine.rank_barrier(stream);
        MOK_CUDA_CHECK(cudaEventRecord(marks[2], stream));
        engine.combine_push(copy, stream);
        MOK_CUDA_CHECK(cudaEventRecord(marks[3], stream));
        engine.combine_reduce(topk_w, y, tokens, stream);
        MOK_CUDA_CHECK(cudaEventRecord(marks[4], stream));
        engine.check(stream);
        if (iteration < args.warmup) continue;
        float elapsed[4];
        MOK_CUDA_CHECK(cudaEventElapsedTime(&elapsed[3], marks[5], marks[6]));
        config.schedule_ms[rank].push_back(elapsed[3]);
        MOK_CUDA_CHECK(cudaEventElapsedTime(&elapsed[0], marks[0], marks[1]));
        MOK_CUDA_CHECK(cudaEventElapsedTime(&elapsed[1], marks[2], marks[3]));
        MOK_CUDA_CHECK(cudaEventElapsedTime(&elapsed[2], marks[3], marks[4]));
        config.dispatch_ms[rank].push_back(elapsed[0]);
        config.combine_ms[rank].push_back(elapsed[1]);
        config.reduce_ms[rank].push_back(elapsed[2]);
      }
    }
    for (cudaEvent_t& mark : marks) MOK_CUDA_CHECK(cudaEventDestroy(mark));
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
    MOK_CUDA_CHECK(cudaFree(topk_idx));
    MOK_CUDA_CHECK(cudaFree(topk_w));
    MOK_CUDA_CHECK(cudaFree(y));
  });
  std::printf("%s, %s, EP 2, %lld tokens/rank; rows 0->1 %lld, 1->0 %lld (%lld bytes each)\n",
              args.preset.c_str(), shape.describe().c_str(), static_cast<long long>(tokens),
              static_cast<long long>(rows_sent[0][1]), static_cast<long long>(rows_sent[1][0]),
              static_cast<long long>(row_bytes));
  write_json(args, shape, std::string("2x ") + prop.name, configs, rows_sent, row_bytes);
  return 0;
}

int main(int argc, char** argv) {
  return mok::bench::run_main("bench_comm", [&] { return run(argc, argv); });
}
