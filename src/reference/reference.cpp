// Public entry points of the CPU reference: argument checks, then the engine, then the outputs
// converted to their storage types (every value is already rounded, so conversion is exact).
#include <algorithm>

#include <optional>

#include "mok/reference.hpp"
#include "reference/engine.hpp"
#include "reference/run.hpp"

namespace mok::reference {

namespace {

void validate_inputs(const LayerShape& shape, std::span<const RankInputs> ranks, bool needs_dy,
                     Precision precision) {
  MOK_CHECK_ARG(!ranks.empty(), "ranks", "at least one rank is needed");
  const int64_t ep = static_cast<int64_t>(ranks.size());
  shape.validate(ep);
  validate_precision(shape, precision);
  for (const RankInputs& rank : ranks) {
    validate_weights(shape, ep, rank.weights);
    validate_tokens(shape, rank.tokens);
    if (needs_dy) check_shape(rank.dy, "dy", {rank.tokens.x.shape[0], shape.hidden});
  }
}

void check_output_count(std::span<const RankInputs> ranks, std::span<const RankOutputs> outputs) {
  MOK_CHECK_ARG(outputs.size() == ranks.size(), "outputs", outputs.size(), " output sets for ",
                ranks.size(), " ranks");
}

template <class Real>
GradTargets<Real> targets_of(const WeightGrads& grads) {
  return {grads.gate.data,        grads.up.data,        grads.down.data,
          grads.shared_gate.data, grads.shared_up.data, grads.shared_down.data};
}

// The recipe of options.precision; none for bf16.
std::optional<QuantRecipe> recipe_of(const Options& options) {
  if (options.precision == Precision::kBf16) return std::nullopt;
  return QuantRecipe::of(options.precision);
}

const QuantRecipe* pointer_to(const std::optional<QuantRecipe>& recipe) {
  return recipe ? &*recipe : nullptr;
}

// The checks every recipe's shape needs: a recipe that is no public mode checks against the
// public mode of its format.
Precision precision_to_validate(const Options& options, const QuantRecipe* recipe) {
  if (recipe == nullptr) return options.precision;
  if (recipe->block == 0) return Precision::kBf16;  // one block per row: any K
  return recipe->format == quantize::Format::kFp8 ? Precision::kFp8 : Precision::kMxfp8;
}

template <class Real>
std::vector<RankResult<Real>> compute_forward(const LayerShape& shape,
                                              std::span<const RankInputs> ranks,
                                              const Options& options, const QuantRecipe* recipe) {
  if (recipe == nullptr) return LayerEngine<Real>(shape, ranks, options).forward();
  return QuantizedEngine<Real>(shape, ranks, options, *recipe).forward();
}

template <class Real>
std::vector<RankResult<Real>> compute_backward(const LayerShape& shape,
                                               std::span<const RankInputs> ranks,
                                               const Options& options, const QuantRecipe* recipe,
                                               std::span<const GradTargets<Real>> targets) {
  if (recipe == nullptr) return LayerEngine<Real>(shape, ranks, options).backward(targets);
  return QuantizedEngine<Real>(shape, ranks, options, *recipe).backward(targets);
}

}  // namespace

void forward(const LayerShape& shape, std::span<const RankInputs> ranks,
             std::span<const RankOutputs> outputs, const Options& options) {
  run_forward(shape, ranks, outputs, options, pointer_to(recipe_of(options)));
}

void backward(const LayerShape& shape, std::span<const RankInputs> ranks,
              std::span<const RankOutputs> outputs, GradMode mode, const Options& options) {
  run_backward(shape, ranks, outputs, mode, options, pointer_to(recipe_of(options)));
}

std::vector<OracleResult> oracle(const LayerShape& shape, std::span<const RankInputs> ranks,
                                 bool with_backward, const Options& options) {
  return run_oracle(shape, ranks, with_backward, options, pointer_to(recipe_of(options)));
}

void run_forward(const LayerShape& shape, std::span<const RankInputs> ranks,
                 std::span<const RankOutputs> outputs, const Options& options,
                 const QuantRecipe* recipe) {
  validate_inputs(shape, ranks, /*needs_dy=*/false, precision_to_validate(options, recipe));
  check_output_count(ranks, outputs);
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    check_shape(outputs[rank].y, "y", {ranks[rank].tokens.x.shape[0], shape.hidden});
  }
  const std::vector<RankResult<float>> results =
      compute_forward<float>(shape, ranks, options, recipe);
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    std::transform(results[rank].y.begin(), results[rank].y.end(), outputs[rank].y.data,
                   [](float value) { return bf16(value); });
  }
}

void run_backward(const LayerShape& shape, std::span<const RankInputs> ranks,
                  std::span<const RankOutputs> outputs, GradMode mode, const Options& options,
                  const QuantRecipe* recipe) {
  validate_inputs(shape, ranks, /*needs_dy=*/true, precision_to_validate(options, recipe));
  check_output_count(ranks, outputs);
  const int64_t ep = static_cast<int64_t>(ranks.size());
  // Every rank's outputs are checked before any is written: a bad argument leaves them all as
  // they were.
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const int64_t num_tokens = ranks[rank].tokens.x.shape[0];
    check_shape(outputs[rank].dx, "dx", {num_tokens, shape.hidden});
    check_shape(outputs[rank].d_topk_w, "d_topk_w", {num_tokens, shape.top_k});
    validate_grads(shape, ep, outputs[rank].grads);
  }
  std::vector<GradTargets<float>> targets;
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const WeightGrads& grads = outputs[rank].grads;
    if (mode == GradMode::kOverwrite) {
      for (const View<float>* grad : {&grads.gate, &grads.up, &grads.down, &grads.shared_gate,
                                      &grads.shared_up, &grads.shared_down}) {
        if (!grad->empty()) std::fill(grad->data, grad->data + grad->numel(), 0.0f);
      }
    }
    targets.push_back(targets_of<float>(grads));
  }
  const std::vector<RankResult<float>> results =
      compute_backward<float>(shape, ranks, options, recipe, std::span(targets));
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    std::transform(results[rank].dx.begin(), results[rank].dx.end(), outputs[rank].dx.data,
                   [](float value) { return bf16(value); });
    std::copy(results[rank].d_topk_w.begin(), results[rank].d_topk_w.end(),
              outputs[rank].d_topk_w.data);
  }
}

std::vector<OracleResult> run_oracle(const LayerShape& shape, std::span<const RankInputs> ranks,
                                     bool with_backward, const Options& options,
                                     const QuantRecipe* recipe) {
  validate_inputs(shape, ranks, with_backward, precision_to_validate(options, recipe));
  const int64_t local_experts = shape.num_experts / static_cast<int64_t>(ranks.size());
  const size_t routed_size = static_cast<size_t>(local_experts * shape.intermediate * shape.hidden);
  const size_t shared_size = static_cast<size_t>(shape.shared_intermediate * shape.hidden);

  std::vector<OracleResult> results(ranks.size());
  std::vector<RankResult<double>> forward = compute_forward<double>(shape, ranks, options, recipe);
  for (size_t rank = 0; rank < ranks.size(); ++rank) results[rank].y = std::move(forward[rank].y);
  if (!with_backward) return results;

  std::vector<GradTargets<double>> targets;
  for (OracleResult& result : results) {
    for (std::vector<double>* grad : {&result.grad_gate, &result.grad_up, &result.grad_down}) {
      grad->assign(routed_size, 0.0);
    }
    for (std::vector<double>* grad :
         {&result.grad_shared_gate, &result.grad_shared_up, &result.grad_shared_down}) {
      grad->assign(shared_size, 0.0);
    }
    targets.push_back({result.grad_gate.data(), result.grad_up.data(), result.grad_down.data(),
                       result.grad_shared_gate.data(), result.grad_shared_up.data(),
                       result.grad_shared_down.data()});
  }
  std::vector<RankResult<double>> backward =
      compute_backward<double>(shape, ranks, options, recipe, std::span(targets));
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    results[rank].dx = std::move(backward[rank].dx);
    results[rank].d_topk_w = std::move(backward[rank].d_topk_w);
  }
  return results;
}

}  // namespace mok::reference
