// Errors mok raises. Every host-side check names the argument and the offending value, so that a
// message read alone says what to fix: "topk_idx: expert id 300 out of range [0, 256) at token 7".
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
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
// Message building without iostreams: mok is loaded into processes (PyTorch) where a second
// copy of the C++ stream machinery can sit beside ours, and a stream built across the two
// crashes. Strings, characters, integers and floating-point values (as %g) are enough here.
inline void append_part(std::string& out, std::string_view text) { out += text; }
inline void append_part(std::string& out, const char* text) { out += text; }
inline void append_part(std::string& out, const std::string& text) { out += text; }
inline void append_part(std::string& out, char letter) { out += letter; }
inline void append_part(std::string& out, const void* pointer) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", pointer);
  out += text;
}
template <class Enum>
requires std::is_enum_v<Enum>
void append_part(std::string& out, Enum value) {
  out += std::to_string(static_cast<std::underlying_type_t<Enum>>(value));
}
template <class Number>
requires std::is_arithmetic_v<Number>
void append_part(std::string& out, Number value) {
  if constexpr (std::is_floating_point_v<Number>) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
    out += text;
  } else {
    out += std::to_string(value);
  }
}

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
}
}  // namespace detail

// Throws mok::Error naming `argument` unless `condition` holds; the message parts are streamed.
#define MOK_CHECK_ARG(condition, argument, ...)                           \
  do {                                                                    \
    if (!(condition)) {                                                   \
      throw ::mok::Error((argument), ::mok::detail::concat(__VA_ARGS__)); \
    }                                                                     \
  } while (0)

}  // namespace mok
