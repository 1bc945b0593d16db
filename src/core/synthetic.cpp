#include "mok/synthetic.hpp"

#include <cmath>
#include <limits>

namespace mok {

namespace {

// splitmix64: tiny, fast, and the same stream on every platform (no libm involved).
class Generator {
 public:
  Generator(uint64_t seed, uint64_t stream)
      : state_(seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull + 1) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int64_t below(int64_t bound) {
    return static_cast<int64_t>(uniform() * static_cast<double>(bound));
  }
  // Irwin-Hall sum of four uniforms, scaled to unit variance: close to normal, arithmetic only.
  double normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0) * std::sqrt(3.0); }

 private:
  uint64_t state_;
};

enum Stream : uint64_t {
  kX = 1,
  kDy,
  kIdx,
  kW,
  kGate,
  kUp,
  kDown,
  kSharedGate,
  kSharedUp,
  kSharedDown
};

std::vector<bf16> normal_bf16(size_t count, double scale, uint64_t seed, Stream stream) {
  Generator generator(seed, stream);
  std::vector<bf16> values(count);
  for (bf16& value : values) value = bf16(static_cast<float>(generator.normal() * scale));
  return values;
}

// k distinct experts for one token, by drawing without replacement from `weights`.
void draw_experts(Generator& generator, std::vector<double> weights, int64_t top_k, int32_t* out) {
  for (int64_t slot = 0; slot < top_k; ++slot) {
    double total = 0;
    for (double weight : weights) total += weight;
    double target = generator.uniform() * total;
    size_t expert = 0;
    while (expert + 1 < weights.size() && (target >= weights[expert] || weights[expert] == 0)) {
      target -= weights[expert];
      ++expert;
    }
    out[slot] = static_cast<int32_t>(expert);
    weights[expert] = 0;
  }
}

}  // namespace

Routing Routing::parse(std::string_view text) {
  Routing routing;
  if (text == "uniform") return routing;
  if (text == "single-expert") {
    routing.kind = Kind::kSingleExpert;
    return routing;
  }
  if (text.substr(0, 7) == "skewed:") {
    const std::string value(text.substr(7));
    char* end = nullptr;
    routing.alpha = std::strtod(value.c_str(), &end);
    MOK_CHECK_ARG(
        !value.empty() && end && *end == '\0' && routing.alpha >= 0 && routing.alpha <= 10,
        "routing", "skewed:ALPHA needs ALPHA in [0, 10], got '", value, "'");
    routing.kind = Kind::kSkewed;
    return routing;
  }
  throw Error("routing", "unknown routing '" + std::string(text) +
                             "' (known: uniform, skewed:ALPHA, single-expert)");
}

std::string Routing::name() const {
  switch (kind) {
    case Kind::kUniform:
      return "uniform";
    case Kind::kSkewed:
      return detail::concat("skewed:", alpha);
    case Kind::kSingleExpert:
      return "single-expert";
  }
  return "?";
}

Problem Problem::generate(const SyntheticSpec& spec) {
  const LayerShape& shape = spec.shape;
  shape.validate();
  MOK_CHECK_ARG(spec.num_tokens > 0, "tokens", "must be positive, got ", spec.num_tokens);
  Problem problem;
  problem.shape = shape;
  problem.num_tokens = spec.num_tokens;
  const int64_t tokens = spec.num_tokens, hidden = shape.hidden, inter = shape.intermediate;
  const int64_t experts = shape.num_experts, top_k = shape.top_k,
                shared = shape.shared_intermediate;

  problem.x = normal_bf16(tokens * hidden, 1.0, spec.seed, kX);
  problem.dy = normal_bf16(tokens * hidden, 1.0, spec.seed, kDy);
  // Scales keep every intermediate near unit size: gate/up outputs ~ N(0, 1).
  const double in_scale = 1.0 / std::sqrt(static_cast<double>(hidden));
  problem.gate = normal_bf16(experts * inter * hidden, in_scale, spec.seed, kGate);
  problem.up = normal_bf16(experts * inter * hidden, in_scale, spec.seed, kUp);
  problem.down =
      normal_bf16(experts * hidden * inter, 1.0 / std::sqrt(double(inter)), spec.seed, kDown);
  if (shared > 0) {
    problem.shared_gate = normal_bf16(shared * hidden, in_scale, spec.seed, kSharedGate);
    problem.shared_up = normal_bf16(shared * hidden, in_scale, spec.seed, kSharedUp);
    problem.shared_down =
        normal_bf16(hidden * shared, 1.0 / std::sqrt(double(shared)), spec.seed, kSharedDown);
  }

  problem.topk_idx.assign(tokens * top_k, -1);
  problem.topk_w.assign(tokens * top_k, 0.0f);
  std::vector<double> expert_weights(experts, 1.0);
  if (spec.routing.kind == Routing::Kind::kSkewed) {
    for (int64_t expert = 0; expert < experts; ++expert) {
      expert_weights[expert] = std::pow(static_cast<double>(expert + 1), -spec.routing.alpha);
    }
  }
  Generator route(spec.seed, kIdx), weigh(spec.seed, kW);
  for (int64_t token = 0; token < tokens; ++token) {
    int32_t* row = problem.topk_idx.data() + token * top_k;
    if (spec.routing.kind == Routing::Kind::kSingleExpert) {
      row[0] = 0;
    } else {
      draw_experts(route, expert_weights, top_k, row);
    }
    for (int64_t slot = 0; slot < top_k; ++slot) {
      if (spec.unused_slot_fraction > 0 && route.uniform() < spec.unused_slot_fraction)
        row[slot] = -1;
    }
    // Router weights: a softmax over the used slots, or signed values when asked.
    float* weights = problem.topk_w.data() + token * top_k;
    double total = 0;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      const double logit = weigh.normal();
      if (row[slot] < 0) continue;
      weights[slot] = static_cast<float>(spec.signed_router_weights ? logit : std::exp(logit));
      total += weights[slot];
    }
    for (int64_t slot = 0; slot < top_k && !spec.signed_router_weights; ++slot) {
      if (row[slot] >= 0) weights[slot] = static_cast<float>(weights[slot] / total);
    }
  }
  return problem;
}

reference::RankInputs Problem::rank_inputs(int64_t rank, int64_t ep) const {
  shape.validate(ep);
  MOK_CHECK_ARG(num_tokens % ep == 0, "tokens", num_tokens, " tokens do not split evenly over ", ep,
                " ranks");
  MOK_CHECK_ARG(rank >= 0 && rank < ep, "rank", rank, " out of range [0, ", ep, ")");
  const int64_t tokens = num_tokens / ep, experts = shape.num_experts / ep;
  const int64_t hidden = shape.hidden, inter = shape.intermediate,
                shared = shape.shared_intermediate;
  const View<const bf16> all_x(x.data(), {num_tokens, hidden}),
      all_dy(dy.data(), {num_tokens, hidden});
  const View<const int32_t> all_idx(topk_idx.data(), {num_tokens, shape.top_k});
  const View<const float> all_w(topk_w.data(), {num_tokens, shape.top_k});
  const View<const bf16> all_gate(gate.data(), {shape.num_experts, inter, hidden});
  const View<const bf16> all_up(up.data(), {shape.num_experts, inter, hidden});
  const View<const bf16> all_down(down.data(), {shape.num_experts, hidden, inter});

  reference::RankInputs inputs;
  const int64_t first_token = rank * tokens, first_expert = rank * experts;
  inputs.tokens = {all_x.slice(first_token, first_token + tokens),
                   all_idx.slice(first_token, first_token + tokens),
                   all_w.slice(first_token, first_token + tokens)};
  inputs.dy = all_dy.slice(first_token, first_token + tokens);
  inputs.weights.gate = all_gate.slice(first_expert, first_expert + experts);
  inputs.weights.up = all_up.slice(first_expert, first_expert + experts);
  inputs.weights.down = all_down.slice(first_expert, first_expert + experts);
  if (shared > 0) {
    inputs.weights.shared_gate = View<const bf16>(shared_gate.data(), {shared, hidden});
    inputs.weights.shared_up = View<const bf16>(shared_up.data(), {shared, hidden});
    inputs.weights.shared_down = View<const bf16>(shared_down.data(), {hidden, shared});
  }
  return inputs;
}

std::vector<reference::RankInputs> Problem::all_rank_inputs(int64_t ep) const {
  std::vector<reference::RankInputs> ranks;
  for (int64_t rank = 0; rank < ep; ++rank) ranks.push_back(rank_inputs(rank, ep));
  return ranks;
}

ProblemOutputs ProblemOutputs::poisoned(const Problem& problem, int64_t ep) {
  const LayerShape& shape = problem.shape;
  const size_t tokens = problem.num_tokens, hidden = shape.hidden, inter = shape.intermediate;
  const size_t experts = shape.num_experts, shared = shape.shared_intermediate;
  const bf16 nan_bf16 = bf16::from_bits(0x7fc1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ProblemOutputs outputs;
  outputs.ep = ep;
  outputs.y.assign(tokens * hidden, nan_bf16);
  outputs.dx.assign(tokens * hidden, nan_bf16);
  outputs.d_topk_w.assign(tokens * shape.top_k, nan);
  for (std::vector<float>* grad : {&outputs.grad_gate, &outputs.grad_up, &outputs.grad_down}) {
    grad->assign(experts * inter * hidden, nan);
  }
  for (std::vector<float>* grad :
       {&outputs.grad_shared_gate, &outputs.grad_shared_up, &outputs.grad_shared_down}) {
    grad->assign(static_cast<size_t>(ep) * shared * hidden, nan);
  }
  return outputs;
}

std::vector<reference::RankOutputs> ProblemOutputs::rank_outputs(const Problem& problem) {
  const LayerShape& shape = problem.shape;
  const int64_t tokens = problem.num_tokens / ep, experts = shape.num_experts / ep;
  const int64_t hidden = shape.hidden, inter = shape.intermediate,
                shared = shape.shared_intermediate;
  std::vector<reference::RankOutputs> ranks(static_cast<size_t>(ep));
  for (int64_t rank = 0; rank < ep; ++rank) {
    reference::RankOutputs& out = ranks[rank];
    const int64_t token0 = rank * tokens, expert0 = rank * experts;
    out.y = View<bf16>(y.data() + token0 * hidden, {tokens, hidden});
    out.dx = View<bf16>(dx.data() + token0 * hidden, {tokens, hidden});
    out.d_topk_w = View<float>(d_topk_w.data() + token0 * shape.top_k, {tokens, shape.top_k});
    out.grads.gate =
        View<float>(grad_gate.data() + expert0 * inter * hidden, {experts, inter, hidden});
    out.grads.up = View<float>(grad_up.data() + expert0 * inter * hidden, {experts, inter, hidden});
    out.grads.down =
        View<float>(grad_down.data() + expert0 * hidden * inter, {experts, hidden, inter});
    if (shared > 0) {
      out.grads.shared_gate =
          View<float>(grad_shared_gate.data() + rank * shared * hidden, {shared, hidden});
      out.grads.shared_up =
          View<float>(grad_shared_up.data() + rank * shared * hidden, {shared, hidden});
      out.grads.shared_down =
          View<float>(grad_shared_down.data() + rank * hidden * shared, {hidden, shared});
    }
  }
  return ranks;
}

uint64_t checksum(const ProblemOutputs& outputs) {
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&hash](const void* data, size_t bytes) {
    const auto* byte = static_cast<const unsigned char*>(data);
    for (size_t index = 0; index < bytes; ++index) hash = (hash ^ byte[index]) * 0x100000001b3ull;
  };
  mix(outputs.y.data(), outputs.y.size() * sizeof(bf16));
  mix(outputs.dx.data(), outputs.dx.size() * sizeof(bf16));
  mix(outputs.d_topk_w.data(), outputs.d_topk_w.size() * sizeof(float));
  for (const std::vector<float>* grad :
       {&outputs.grad_gate, &outputs.grad_up, &outputs.grad_down}) {
    mix(grad->data(), grad->size() * sizeof(float));
  }
  return hash;
}

}  // namespace mok
