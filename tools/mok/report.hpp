// What `mok run` prints and writes: timings, the accuracy check, the JSON record.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/compare.hpp"
#include "mok/precision.hpp"
#include "mok/synthetic.hpp"

namespace mok::cli {

struct RunConfig {
  std::string preset;       // the preset that gave the shape's defaults
  std::string shape_flags;  // the shape flags that overrode them ("--hidden 512 --top-k 2"), or ""
  LayerShape shape;
  Precision precision = Precision::kBf16;
  int64_t tokens_per_rank = 0;
  int64_t ep = 1;
  Routing routing;
  uint64_t seed = 0;
  int num_threads = 0;
  bool check = true;
  // cuda, bf16, EP 1: the low-memory backward (LayerBackwardOptions::chunk_rows) timed too, its
  // outputs compared bitwise with the default backward's.
  bool low_memory_backward = false;
  std::string backend;
};

struct RunResult {
  ProblemOutputs outputs;
  double forward_ms = 0;
  double backward_ms = 0;
  bool has_backward = true;     // false: backward was not run (the GPU backend is forward only)
  bool times_per_rank = false;  // true: the ms are per rank (GPU ranks run at once), else the
                                // sum over the virtual ranks (CPU backend, one after another)
  std::string device = "cpu (reference backend)";
};

void print_timings(const RunConfig& config, const RunResult& result);

// The CPU run's check: every output against the fp64 oracle and, when EP > 1, bitwise against an
// EP=1 run. In an FP8 mode each output's error is judged against the yardstick's, the error of the
// same quantized operands computed in fp64 (reference::oracle with the precision). Computed first,
// printed after, so that nothing is printed while a progress line shows.
struct OracleCheck {
  struct Line {
    const char* name;
    ErrorStats stats;
    double yardstick = 0;  // FP8 modes: the yardstick's rel-L2 against the fp64 oracle

    // tokens: the run's tokens over all ranks (mok/compare.hpp: the bounds widen as they get
    // fewer, and an FP8 mode's errors are not judged below kFp8JudgedTokens).
    bool passed(Precision precision, int64_t tokens) const;
  };
  std::vector<Line> lines;
  bool ep_compared = false;  // EP > 1: the EP=1 run was made
  bool ep_equal = false;
  uint64_t ep1_checksum = 0;
};

// The EP=1 run (its outputs freed once fingerprinted) comes before the oracle, so that the two
// never take memory at once; each reports progress through its own options (the oracles'
// precision is set here: the exact oracle is bf16's, the yardstick config.precision's).
OracleCheck check_against_oracle(const RunConfig& config, const Problem& problem,
                                 const RunResult& result, const reference::Options& ep1_options,
                                 const reference::Options& oracle_options,
                                 const reference::Options& yardstick_options);
// One line per tensor; returns whether all passed.
bool print_check(const RunConfig& config, const OracleCheck& check);

// The run's figures as a JSON record (schema mok-bench/1). A shape changed by flags is named
// "custom".
std::string json_record(const RunConfig& config, const RunResult& result);

}  // namespace mok::cli
