// The progress of a long CPU run on standard error: "  check (fp64 oracle) forward: routed
// experts   1234/5678 (21%)", once the run has taken 2 s. On a terminal one line redrawn in place,
// which is cleared (clear()) before anything else is printed; elsewhere (a log) a line every 10 s.
// MOK_PROGRESS=always shows every update from the start, =never none.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace mok::cli {

class ProgressLine {
 public:
  enum class Mode { kAuto, kAlways, kNever };
  // From MOK_PROGRESS (unset: kAuto); throws mok::Error naming it for another value.
  static Mode mode_from_environment();

  explicit ProgressLine(Mode mode);

  void show(std::string_view phase, int64_t done, int64_t total);
  // Erases the line on a terminal; a no-op when none is shown.
  void clear();
  // A progress callback for the reference that shows `label` before each phase name.
  std::function<void(std::string_view, int64_t, int64_t)> labelled(std::string label);

 private:
  Mode mode_;
  std::chrono::steady_clock::time_point start_;
  bool terminal_;
  double last_line_s_ = 0;
  size_t shown_width_ = 0;  // characters on the terminal's line now
};

}  // namespace mok::cli
