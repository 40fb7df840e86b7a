// A packed store's directory as numpy arrays, for every binding that exposes one (the file reader
// in io_module.cc, the object store's directory in store_directory_bindings.cc).
#pragma once

#include <pybind11/numpy.h>

#include <cstring>
#include <vector>

#include "io/store_format.h"

namespace shadecache {

// One field of every entry, in id order.
template <typename T>
pybind11::array_t<T> directory_column(const std::vector<store::Entry>& d, T store::Entry::*field) {
  pybind11::array_t<T> a(static_cast<pybind11::ssize_t>(d.size()));
  T* out = a.mutable_data();
  for (size_t i = 0; i < d.size(); ++i) out[i] = d[i].*field;
  return a;
}

// Ids in some order (disk order, a placement) as an int64 array.
inline pybind11::array_t<int64_t> id_order_array(const std::vector<uint64_t>& order) {
  pybind11::array_t<int64_t> a(static_cast<pybind11::ssize_t>(order.size()));
  std::memcpy(a.mutable_data(), order.data(), order.size() * sizeof(uint64_t));
  return a;
}

}  // namespace shadecache
