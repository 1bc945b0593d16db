#include <cstdio>

#include "args.hpp"
#include "commands.hpp"
#include "mok/shape.hpp"

namespace mok::cli {

int presets_command(const std::vector<std::string>& words) {
  if (Args::wants_help(words)) {
    std::puts(
        "usage: mok presets\n\nLists each preset: hidden size H, expert intermediate size I, "
        "shared-expert size I_s,\nexperts E, top-k, useful forward GFLOP per token "
        "(6·H·(k·I + I_s)) and default tokens per rank.");
    return 0;
  }
  const Args args(words, {}, {});  // takes no options: anything else is an error
  std::printf("%-16s %6s %6s %6s %5s %4s %12s %10s  %s\n", "preset", "H", "I", "I_s", "E", "k",
              "GFLOP/token", "tokens", "model");
  for (const Preset& preset : presets()) {
    const LayerShape& shape = preset.shape;
    std::printf("%-16.*s %6lld %6lld %6lld %5lld %4lld %12.3f %10lld  %.*s\n",
                static_cast<int>(preset.name.size()), preset.name.data(),
                static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate),
                static_cast<long long>(shape.shared_intermediate),
                static_cast<long long>(shape.num_experts), static_cast<long long>(shape.top_k),
                static_cast<double>(shape.forward_flops_per_token()) * 1e-9,
                static_cast<long long>(preset.default_tokens_per_rank),
                static_cast<int>(preset.model.size()), preset.model.data());
  }
  return 0;
}

}  // namespace mok::cli
