// mok — the command-line program: run the layer on synthetic data, list presets.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.hpp"
#include "mok/error.hpp"

namespace {

constexpr const char* kUsage = R"(mok — deterministic Mixture-of-Experts layer (forward + backward)

usage: mok <command> [options]

commands:
  run       run one MoE layer forward + backward on synthetic data, time it, check it
  presets   list the layer shapes of the benchmark presets

'mok <command> --help' describes each command's options. Bad arguments exit with code 2,
a failed --check with code 1.
)";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  if (words.empty() || words[0] == "--help" || words[0] == "-h" || words[0] == "help") {
    std::fputs(kUsage, words.empty() ? stderr : stdout);
    return words.empty() ? 2 : 0;
  }
  const std::string command = words[0];
  words.erase(words.begin());
  try {
    if (command == "run") return mok::cli::run_command(words);
    if (command == "presets") return mok::cli::presets_command(words);
    std::fprintf(stderr, "mok: unknown command '%s' (commands: run, presets; see mok --help)\n",
                 command.c_str());
    return 2;
  } catch (const mok::Error& error) {
    std::fprintf(stderr, "mok %s: error: %s\n", command.c_str(), error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "mok %s: internal error: %s\n", command.c_str(), error.what());
    return 3;
  }
}
