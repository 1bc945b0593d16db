// A non-owning view of a contiguous, row-major tensor: a pointer and a shape. The checks that
// every entry point runs on its arguments live here, so that their messages read the same.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "mok/error.hpp"

namespace mok {

std::string format_shape(const std::vector<int64_t>& shape);

template <class T>
struct View {
  T* data = nullptr;
  std::vector<int64_t> shape;

  View() = default;
  View(T* data_ptr, std::vector<int64_t> sizes) : data(data_ptr), shape(std::move(sizes)) {}
  template <class U>
  View(const View<U>& other) : data(other.data), shape(other.shape) {}  // View<T> -> View<const T>

  int64_t numel() const {
    int64_t count = 1;
    for (int64_t size : shape) count *= size;
    return count;
  }
  bool empty() const { return data == nullptr || numel() == 0; }
  int64_t size(int dim) const { return shape.at(static_cast<size_t>(dim)); }
  T& operator[](int64_t index) const { return data[index]; }

  // The sub-tensor at `index` along dimension 0, e.g. one expert's weight or one rank's tokens.
  View slice(int64_t begin, int64_t end) const {
    std::vector<int64_t> sizes = shape;
    sizes[0] = end - begin;
    return View(data + begin * (numel() / shape[0]), sizes);
  }
};

// Throws mok::Error naming `argument` unless `view` has exactly the `expected` shape and a data
// pointer (a zero-element tensor may have none).
template <class T>
void check_shape(const View<T>& view, const char* argument, const std::vector<int64_t>& expected) {
  MOK_CHECK_ARG(view.shape == expected, argument, "shape ", format_shape(view.shape), ", expected ",
                format_shape(expected));
  int64_t count = 1;
  for (int64_t size : expected) count *= size;
  MOK_CHECK_ARG(count == 0 || view.data != nullptr, argument, "null data pointer for shape ",
                format_shape(expected));
}

}  // namespace mok
