// A small command-line parser: `--name value`, `--name=value` and `--flag`. Unknown options and
// missing values become mok::Error naming the option, which the program prints as one line.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mok::cli {

class Args {
 public:
  // `valued` options take a value, `flags` take none.
  Args(const std::vector<std::string>& words, const std::set<std::string>& valued,
       const std::set<std::string>& flags);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string text(const std::string& name, const std::string& fallback) const;
  int64_t integer(const std::string& name, int64_t fallback, int64_t min, int64_t max) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace mok::cli
