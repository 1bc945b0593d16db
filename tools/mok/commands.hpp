#pragma once

#include <string>
#include <vector>

namespace mok::cli {

// Each returns the process exit code: 0 done, 1 a check failed; bad arguments throw mok::Error
// (exit code 2).
int run_command(const std::vector<std::string>& words);
int presets_command(const std::vector<std::string>& words);

}  // namespace mok::cli
