// Errors mok raises. Every host-side check names the argument and the offending value, so that a
// message read alone says what to fix: "topk_idx: expert id 300 out of range [0, 256) at token 7".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mok {

class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message)
      : std::runtime_error(argument.empty() ? message : argument + ": " + message),
        argument_(std::move(argument)) {}

  // The argument (or subsystem) the error is about, e.g. "topk_idx"; may be empty.
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream stream;
  (stream << ... << parts);
  return stream.str();
}
}  // namespace detail

// Throws mok::Error naming `argument` unless `condition` holds; the message parts are streamed.
#define MOK_CHECK_ARG(condition, argument, ...)                            \
  do {                                                                     \
    if (!(condition)) {                                                    \
      throw ::mok::Error((argument), ::mok::detail::concat(__VA_ARGS__)); \
    }                                                                      \
  } while (0)

}  // namespace mok
