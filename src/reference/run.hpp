// The CPU backend's entry points behind mok/reference.hpp, for any recipe: `recipe` null runs the
// bf16 path (LayerEngine), otherwise the FP8 recipe it names (QuantizedEngine). The public
// functions pass QuantRecipe::of(options.precision); tests pass recipes that are no public mode
// (QuantRecipe::rowwise_fp8) to compare with.
#pragma once

#include <span>
#include <vector>

#include "mok/reference.hpp"
#include "reference/quantized_engine.hpp"

namespace mok::reference {

void run_forward(const LayerShape& shape, std::span<const RankInputs> ranks,
                 std::span<const RankOutputs> outputs, const Options& options,
                 const QuantRecipe* recipe);

void run_backward(const LayerShape& shape, std::span<const RankInputs> ranks,
                  std::span<const RankOutputs> outputs, GradMode mode, const Options& options,
                  const QuantRecipe* recipe);

// recipe null: the unquantized fp64 oracle; otherwise the recipe's operands in fp64.
std::vector<OracleResult> run_oracle(const LayerShape& shape, std::span<const RankInputs> ranks,
                                     bool with_backward, const Options& options,
                                     const QuantRecipe* recipe);

}  // namespace mok::reference
