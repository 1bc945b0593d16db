// What `mok run` prints and writes: timings, the accuracy check, the JSON record.
#pragma once

#include <string>

#include "mok/synthetic.hpp"

namespace mok::cli {

struct RunConfig {
  std::string preset;
  LayerShape shape;
  int64_t tokens_per_rank = 0;
  int64_t ep = 1;
  Routing routing;
  uint64_t seed = 0;
  int num_threads = 0;
  bool check = true;
  std::string backend;
};

struct RunResult {
  ProblemOutputs outputs;
  double forward_ms = 0;
  double backward_ms = 0;
  bool has_backward = true;       // false: backward was not run (the GPU backend is forward only)
  bool times_per_rank = false;    // true: the ms are per rank (GPU ranks run at once), else the
                                  // sum over the virtual ranks (CPU backend, one after another)
  std::string device = "cpu (reference backend)";
};

void print_timings(const RunConfig& config, const RunResult& result);

// Compares every output with the fp64 oracle and, when EP > 1, bitwise with an EP=1 run.
// Prints one line per tensor; returns whether all passed.
bool check_against_oracle(const RunConfig& config, const Problem& problem, const RunResult& result,
                          const reference::Options& options);

void write_json(const std::string& path, const RunConfig& config, const RunResult& result);

}  // namespace mok::cli
