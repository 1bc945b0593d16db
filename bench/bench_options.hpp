// The benchmarks' command lines: `--name value` pairs, --help (or -h) for the usage text. A wrong
// command line is a UsageError (exit status 2); anything that fails while measuring, a mok::Error
// (exit status 1).
#pragma once

#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "mok/error.hpp"

namespace mok::bench {

class UsageError : public Error {
 public:
  UsageError(std::string argument, const std::string& message)
      : Error(std::move(argument), message + " (see --help)") {}
};

// Calls take(name, value) for each `--name value` pair, in order; take returns false for a name it
// does not know. Returns false after printing `usage` when asked for help (the caller exits 0).
template <class Take>
bool parse_options(int argc, char** argv, const char* usage, Take&& take) {
  for (int index = 1; index < argc; ++index) {
    const std::string name = argv[index];
    if (name == "--help" || name == "-h") {
      std::fputs(usage, stdout);
      return false;
    }
    if (name.rfind("--", 0) != 0) {
      throw UsageError("", detail::concat("expected --name value, got '", name, "'"));
    }
    if (index + 1 >= argc) throw UsageError(name, "needs a value");
    const std::string value = argv[++index];
    if (!take(name, value)) throw UsageError(name, "unknown option");
  }
  return true;
}

// The whole of `value` as an integer, or a UsageError naming the option.
inline long long integer_option(const std::string& name, const std::string& value) {
  size_t used = 0;
  long long result = 0;
  try {
    result = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (value.empty() || used != value.size()) {
    throw UsageError(name, detail::concat("expected an integer, got '", value, "'"));
  }
  return result;
}

// "a,b,c" as its parts; a UsageError for an empty list.
inline std::vector<std::string> list_option(const std::string& name, const std::string& value) {
  std::vector<std::string> parts;
  std::stringstream stream(value);
  for (std::string part; std::getline(stream, part, ',');) parts.push_back(part);
  if (parts.empty()) throw UsageError(name, "expected a comma-separated list, got ''");
  return parts;
}

inline std::vector<int> integer_list_option(const std::string& name, const std::string& value) {
  std::vector<int> values;
  for (const std::string& part : list_option(name, value)) {
    values.push_back(static_cast<int>(integer_option(name, part)));
  }
  return values;
}

// main's body with the exit statuses above: `program: error: ...` on stderr.
template <class Body>
int run_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const UsageError& error) {
    std::fprintf(stderr, "%s: error: %s\n", program, error.what());
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s: error: %s\n", program, error.what());
    return 1;
  }
}

}  // namespace mok::bench
