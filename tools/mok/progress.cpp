#include "progress.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <unistd.h>

#include "mok/error.hpp"

namespace mok::cli {

namespace {

constexpr double kFirstLineAfterS = 2.0;
constexpr double kLogLineEveryS = 10.0;

}  // namespace

ProgressLine::Mode ProgressLine::mode_from_environment() {
  const char* value = std::getenv("MOK_PROGRESS");
  const std::string text = value == nullptr ? "auto" : value;
  if (text == "auto") return Mode::kAuto;
  if (text == "always") return Mode::kAlways;
  if (text == "never") return Mode::kNever;
  throw Error("MOK_PROGRESS", "expected auto, always or never, got '" + text + "'");
}

ProgressLine::ProgressLine(Mode mode)
    : mode_(mode),
      start_(std::chrono::steady_clock::now()),
      terminal_(isatty(fileno(stderr)) != 0) {}

void ProgressLine::show(std::string_view phase, int64_t done, int64_t total) {
  if (mode_ == Mode::kNever) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const bool due =
      elapsed >= kFirstLineAfterS && (terminal_ || elapsed >= last_line_s_ + kLogLineEveryS);
  if (mode_ == Mode::kAuto && !due) return;
  last_line_s_ = elapsed;
  char line[256];
  const int length = std::snprintf(line, sizeof(line), "  %-46.*s %9lld/%-9lld (%3d%%)",
                                   static_cast<int>(phase.size()), phase.data(),
                                   static_cast<long long>(done), static_cast<long long>(total),
                                   static_cast<int>(100 * done / std::max<int64_t>(total, 1)));
  const size_t width = std::min(static_cast<size_t>(std::max(length, 0)), sizeof(line) - 1);
  if (!terminal_) {
    std::fprintf(stderr, "%s\n", line);
    return;
  }
  // Over the start of the line, with spaces over what a longer earlier line left.
  const int pad = static_cast<int>(shown_width_ > width ? shown_width_ - width : 0);
  std::fprintf(stderr, "\r%s%*s", line, pad, "");
  shown_width_ = std::max(shown_width_, width);
}

void ProgressLine::clear() {
  if (shown_width_ == 0) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(shown_width_), "");
  shown_width_ = 0;
}

std::function<void(std::string_view, int64_t, int64_t)> ProgressLine::labelled(std::string label) {
  return [this, label = std::move(label)](std::string_view phase, int64_t done, int64_t total) {
    show(label.empty() ? std::string(phase) : label + " " + std::string(phase), done, total);
  };
}

}  // namespace mok::cli
