#include "args.hpp"

#include <cerrno>
#include <cstdlib>

#include "mok/error.hpp"

namespace mok::cli {

Args::Args(const std::vector<std::string>& words, const std::set<std::string>& valued,
           const std::set<std::string>& flags) {
  for (size_t index = 0; index < words.size(); ++index) {
    std::string word = words[index];
    MOK_CHECK_ARG(word.rfind("--", 0) == 0, word, "unexpected argument (options start with --; see --help)");
    std::optional<std::string> value;
    if (const size_t equals = word.find('='); equals != std::string::npos) {
      value = word.substr(equals + 1);
      word = word.substr(0, equals);
    }
    const std::string name = word.substr(2);
    if (flags.count(name)) {
      MOK_CHECK_ARG(!value, word, "takes no value");
      values_[name] = std::string(1, '1');
    } else if (valued.count(name)) {
      if (!value) {
        MOK_CHECK_ARG(index + 1 < words.size(), word, "needs a value");
        value = words[++index];
      }
      values_[name] = *value;
    } else {
      throw Error(word, "unknown option (see --help)");
    }
  }
}

std::string Args::text(const std::string& name, const std::string& fallback) const {
  const auto found = values_.find(name);
  return found == values_.end() ? fallback : found->second;
}

int64_t Args::integer(const std::string& name, int64_t fallback, int64_t min, int64_t max) const {
  const auto found = values_.find(name);
  if (found == values_.end()) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(found->second.c_str(), &end, 10);
  MOK_CHECK_ARG(!found->second.empty() && *end == '\0' && errno == 0, "--" + name,
                "expected an integer, got '", found->second, "'");
  MOK_CHECK_ARG(value >= min && value <= max, "--" + name, "must be in [", min, ", ", max,
                "], got ", value);
  return value;
}

}  // namespace mok::cli
