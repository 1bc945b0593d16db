#include <array>

#include "mok/error.hpp"
#include "mok/shape.hpp"
#include "mok/tensor.hpp"

namespace mok {

namespace {

// DESIGN.md §5. `tiny` is small enough for the CPU backend to run forward + backward with an fp64
// check in a few seconds on two cores.
constexpr std::array<Preset, 5> kPresets = {{
    {"tiny", {256, 128, 128, 16, 4}, 512, "a small layer for CPU runs and tests"},
    {"deepseek-v3", {7168, 2048, 2048, 256, 8}, 8192, "DeepSeek-V3 (1 shared expert)"},
    {"qwen3-30b-a3b", {2048, 768, 0, 128, 8}, 16384, "Qwen3-30B-A3B"},
    {"qwen3-235b-a22b", {4096, 1536, 0, 128, 8}, 8192, "Qwen3-235B-A22B"},
    {"mixtral-8x7b", {4096, 14336, 0, 8, 2}, 8192, "Mixtral-8x7B"},
}};

}  // namespace

void LayerShape::validate(int64_t ep) const {
  MOK_CHECK_ARG(hidden > 0, "hidden", "must be positive, got ", hidden);
  MOK_CHECK_ARG(hidden % 8 == 0, "hidden", "must be a multiple of 8 (16-byte rows), got ", hidden);
  MOK_CHECK_ARG(intermediate > 0, "intermediate", "must be positive, got ", intermediate);
  MOK_CHECK_ARG(intermediate % 8 == 0, "intermediate", "must be a multiple of 8, got ",
                intermediate);
  MOK_CHECK_ARG(shared_intermediate >= 0, "shared_intermediate", "must be >= 0, got ",
                shared_intermediate);
  MOK_CHECK_ARG(shared_intermediate % 8 == 0, "shared_intermediate",
                "must be a multiple of 8, got ", shared_intermediate);
  MOK_CHECK_ARG(num_experts > 0, "num_experts", "must be positive, got ", num_experts);
  MOK_CHECK_ARG(top_k > 0, "top_k", "must be positive, got ", top_k);
  MOK_CHECK_ARG(top_k <= num_experts, "top_k", "k = ", top_k,
                " exceeds the number of experts E = ", num_experts);
  MOK_CHECK_ARG(ep > 0, "ep", "must be positive, got ", ep);
  MOK_CHECK_ARG(num_experts % ep == 0, "ep", "E = ", num_experts, " experts do not divide over ",
                ep, " ranks");
}

std::string LayerShape::describe() const {
  return detail::concat("H ", hidden, ", I ", intermediate, ", E ", num_experts, ", top-", top_k,
                        ", I_s ", shared_intermediate);
}

std::span<const Preset> presets() { return kPresets; }

const Preset& find_preset(std::string_view name) {
  std::string known;
  for (const Preset& preset : kPresets) {
    if (preset.name == name) return preset;
    known += (known.empty() ? "" : ", ") + std::string(preset.name);
  }
  throw Error("preset", "unknown preset '" + std::string(name) + "' (known: " + known + ")");
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t dim = 0; dim < shape.size(); ++dim)
    text += detail::concat(dim ? ", " : "", shape[dim]);
  return text + "]";
}

}  // namespace mok
