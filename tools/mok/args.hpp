// The command-line parser of every mok command: `--name value`, `--name=value` and `--flag`.
// Strict, so that a typo never silently changes a run: an unknown option, a repeated one, a
// missing value, a flag given a value, and a number that is not plain decimal digits are each a
// mok::Error whose message starts with the option as typed ("--ep: given twice"); the program
// prints it as one line and exits with status 2.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace mok::cli {

class Args {
 public:
  // `valued` options take a value, `flags` take none; names without the leading "--".
  Args(const std::vector<std::string>& words, const std::set<std::string>& valued,
       const std::set<std::string>& flags);

  // Whether the words ask for help (--help or -h anywhere): a command answers that before it
  // parses the rest, so that help works even beside a mistake.
  static bool wants_help(const std::vector<std::string>& words);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string text(const std::string& name, const std::string& fallback) const;
  // The option's value as a plain decimal integer in [min, max], or `fallback` when not given.
  int64_t integer(const std::string& name, int64_t fallback, int64_t min, int64_t max) const;
  // Throws naming `second` when both options are given.
  void forbid_together(const std::string& first, const std::string& second) const;

 private:
  std::map<std::string, std::string> values_;
};

// `text` as a number for `option` ("--tokens"): decimal digits only, no sign, no leading zero
// (but "0"), no exponent or hex, within [min, max]; else a mok::Error naming the option.
int64_t parse_decimal(const std::string& option, const std::string& text, int64_t min, int64_t max);

}  // namespace mok::cli
