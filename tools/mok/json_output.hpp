// Where `--json PATH` goes. The path is checked when the options are read, before any work, so a
// typo costs no run; "-" is standard output, and then everything else the command prints goes to
// standard error, so that standard output holds the JSON alone.
#pragma once

#include <string>

namespace mok::cli {

class JsonOutput {
 public:
  // Throws mok::Error("--json", ...) when `path` is empty, a directory, or cannot be created or
  // written. For "-", points standard output at standard error until write().
  explicit JsonOutput(std::string path);
  JsonOutput(const JsonOutput&) = delete;
  JsonOutput& operator=(const JsonOutput&) = delete;
  ~JsonOutput();

  // Writes `text`; throws mok::Error("--json", ...) naming the path and the cause on any error
  // (a full disk: /dev/full), so that a lost record never looks like success.
  void write(const std::string& text);

 private:
  std::string path_;
  int standard_output_ = -1;  // for "-": the original standard output
};

}  // namespace mok::cli
