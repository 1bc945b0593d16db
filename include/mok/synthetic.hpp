// Synthetic problems for the CLI, the tests and the benchmarks: one global batch of tokens and
// the weights of all experts, drawn from a seeded generator whose stream is the same on every
// platform, and the views that hand rank r of R its share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "mok/reference.hpp"

namespace mok {

struct Routing {
  enum class Kind { kUniform, kSkewed, kSingleExpert };
  Kind kind = Kind::kUniform;
  double alpha = 0.0;  // kSkewed: expert e is picked with weight (e + 1)^-alpha

  // "uniform", "skewed:1.2", "single-expert"; throws mok::Error("routing", ...) otherwise.
  static Routing parse(std::string_view text);
  std::string name() const;
};

struct SyntheticSpec {
  LayerShape shape;
  int64_t num_tokens = 0;  // global: tokens per rank times the number of ranks
  Routing routing;
  uint64_t seed = 0;
  bool signed_router_weights = false;  // router weights of both signs instead of a softmax
  double unused_slot_fraction = 0.0;   // share of top-k slots set to -1
};

// One global problem. Tensors are row-major in global layout: tokens (T, ..), experts (E, ..).
struct Problem {
  LayerShape shape;
  int64_t num_tokens = 0;
  std::vector<bf16> x, dy;                   // (T, H)
  std::vector<int32_t> topk_idx;             // (T, k)
  std::vector<float> topk_w;                 // (T, k)
  std::vector<bf16> gate, up;                // (E, I, H)
  std::vector<bf16> down;                    // (E, H, I)
  std::vector<bf16> shared_gate, shared_up;  // (I_s, H)
  std::vector<bf16> shared_down;             // (H, I_s)

  static Problem generate(const SyntheticSpec& spec);

  // Rank `rank` of `ep`: tokens [rank*T/ep, (rank+1)*T/ep), experts [rank*E/ep, (rank+1)*E/ep).
  reference::RankInputs rank_inputs(int64_t rank, int64_t ep) const;
  std::vector<reference::RankInputs> all_rank_inputs(int64_t ep) const;
};

// Outputs of every rank, in global layout so that runs at different EP degrees compare directly.
// The shared expert's gradients are per rank (each rank sums over its own tokens): (ep, ...).
struct ProblemOutputs {
  int64_t ep = 1;
  std::vector<bf16> y, dx;                                                // (T, H)
  std::vector<float> d_topk_w;                                            // (T, k)
  std::vector<float> grad_gate, grad_up, grad_down;                       // (E, ...)
  std::vector<float> grad_shared_gate, grad_shared_up, grad_shared_down;  // (ep, ...)

  // Allocates every output and fills it with a NaN pattern, so that an unwritten element shows.
  static ProblemOutputs poisoned(const Problem& problem, int64_t ep);
  std::vector<reference::RankOutputs> rank_outputs(const Problem& problem);
};

// FNV-1a over the bits of every output, a short fingerprint for "same bits?".
uint64_t checksum(const ProblemOutputs& outputs);

}  // namespace mok
