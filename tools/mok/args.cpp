#include "args.hpp"

#include <optional>

#include "mok/error.hpp"

namespace mok::cli {

Args::Args(const std::vector<std::string>& words, const std::set<std::string>& valued,
           const std::set<std::string>& flags) {
  for (size_t index = 0; index < words.size(); ++index) {
    std::string word = words[index];
    MOK_CHECK_ARG(word.rfind("--", 0) == 0 && word.size() > 2, word,
                  "unexpected argument (options start with --; see --help)");
    std::optional<std::string> value;
    if (const size_t equals = word.find('='); equals != std::string::npos) {
      value = word.substr(equals + 1);
      word = word.substr(0, equals);
    }
    const std::string name = word.substr(2);
    const bool is_flag = flags.count(name) > 0;
    MOK_CHECK_ARG(is_flag || valued.count(name), word, "unknown option (see --help)");
    MOK_CHECK_ARG(!values_.count(name), word, "given twice");
    if (is_flag) {
      MOK_CHECK_ARG(!value, word, "takes no value, got '", *value, "'");
      values_[name] = "";
      continue;
    }
    if (!value) {
      MOK_CHECK_ARG(index + 1 < words.size(), word, "needs a value");
      // `--json --no-check` is a forgotten value, not a file called "--no-check"; a value that
      // does start with -- can still be given as --name=VALUE.
      const std::string& next = words[index + 1];
      MOK_CHECK_ARG(next.rfind("--", 0) != 0 || next.size() == 2, word,
                    "needs a value, got the option '", next, "' (write ", word,
                    "=VALUE for a "
                    "value that starts with --)");
      value = words[++index];
    }
    values_[name] = *value;
  }
}

bool Args::wants_help(const std::vector<std::string>& words) {
  for (const std::string& word : words) {
    if (word == "--help" || word == "-h") return true;
  }
  return false;
}

std::string Args::text(const std::string& name, const std::string& fallback) const {
  const auto found = values_.find(name);
  return found == values_.end() ? fallback : found->second;
}

int64_t Args::integer(const std::string& name, int64_t fallback, int64_t min, int64_t max) const {
  const auto found = values_.find(name);
  return found == values_.end() ? fallback : parse_decimal("--" + name, found->second, min, max);
}

void Args::forbid_together(const std::string& first, const std::string& second) const {
  MOK_CHECK_ARG(!has(first) || !has(second), "--" + second, "does not go with --", first);
}

int64_t parse_decimal(const std::string& option, const std::string& text, int64_t min,
                      int64_t max) {
  bool digits = !text.empty() && (text[0] != '0' || text.size() == 1);
  for (const char letter : text) digits = digits && letter >= '0' && letter <= '9';
  MOK_CHECK_ARG(digits, option,
                "expected an integer (decimal digits, no sign or leading zero), got '", text, "'");
  // Digit by digit with an overflow check: strtoll would also take "+8", " 8", "0x8".
  int64_t value = 0;
  for (const char letter : text) {
    const int digit = letter - '0';
    MOK_CHECK_ARG(value <= (max - digit) / 10, option, "must be in [", min, ", ", max, "], got ",
                  text);
    value = value * 10 + digit;
  }
  MOK_CHECK_ARG(value >= min && value <= max, option, "must be in [", min, ", ", max, "], got ",
                value);
  return value;
}

}  // namespace mok::cli
