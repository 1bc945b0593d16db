#include "json_output.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <sys/stat.h>
#include <unistd.h>

#include "mok/error.hpp"

namespace mok::cli {

namespace {

std::string cause(int error_number) { return std::strerror(error_number); }

// The folder a new file `path` would be created in.
std::string parent_folder(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void check_writable(const std::string& path) {
  MOK_CHECK_ARG(!path.empty(), "--json", "empty path (a file name, or - for standard output)");
  struct stat status {};
  if (stat(path.c_str(), &status) == 0) {
    MOK_CHECK_ARG(!S_ISDIR(status.st_mode), "--json", "'", path, "' is a directory");
    MOK_CHECK_ARG(access(path.c_str(), W_OK) == 0, "--json", "cannot write '", path,
                  "': ", cause(errno));
    return;
  }
  MOK_CHECK_ARG(errno == ENOENT, "--json", "cannot write '", path, "': ", cause(errno));
  MOK_CHECK_ARG(path.back() != '/', "--json", "'", path,
                "' names a directory, which does not exist");
  const std::string parent = parent_folder(path);
  struct stat parent_status {};
  MOK_CHECK_ARG(stat(parent.c_str(), &parent_status) == 0, "--json", "cannot create '", path,
                "': directory '", parent, "': ", cause(errno));
  MOK_CHECK_ARG(S_ISDIR(parent_status.st_mode), "--json", "cannot create '", path, "': '", parent,
                "' is not a directory");
  MOK_CHECK_ARG(access(parent.c_str(), W_OK | X_OK) == 0, "--json", "cannot create '", path,
                "' in '", parent, "': ", cause(errno));
}

}  // namespace

JsonOutput::JsonOutput(std::string path) {
  if (path == "-") {
    std::fflush(stdout);
    standard_output_ = dup(STDOUT_FILENO);
    MOK_CHECK_ARG(standard_output_ >= 0 && dup2(STDERR_FILENO, STDOUT_FILENO) >= 0, "--json",
                  "cannot set standard output aside: ", cause(errno));
    // The report now shares standard error with the progress line: whole lines, in order.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
  } else {
    check_writable(path);
  }
  path_ = std::move(path);
}

JsonOutput::~JsonOutput() {
  if (standard_output_ < 0) return;
  std::fflush(stdout);
  dup2(standard_output_, STDOUT_FILENO);
  close(standard_output_);
}

void JsonOutput::write(const std::string& text) {
  std::fflush(stdout);
  if (standard_output_ >= 0) {
    for (size_t written = 0; written < text.size();) {
      const ssize_t count = ::write(standard_output_, text.data() + written, text.size() - written);
      if (count < 0 && errno == EINTR) continue;
      MOK_CHECK_ARG(count > 0, "--json", "cannot write to standard output: ", cause(errno));
      written += static_cast<size_t>(count);
    }
    return;
  }
  std::FILE* file = std::fopen(path_.c_str(), "w");
  MOK_CHECK_ARG(file != nullptr, "--json", "cannot write '", path_, "': ", cause(errno));
  const bool written =
      std::fwrite(text.data(), 1, text.size(), file) == text.size() && std::fflush(file) == 0;
  const int error_number = errno;
  const bool closed = std::fclose(file) == 0;
  MOK_CHECK_ARG(written && closed, "--json", "cannot write '", path_,
                "': ", cause(written ? errno : error_number));
}

}  // namespace mok::cli
