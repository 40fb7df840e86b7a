// Python arguments as native values, shared by the bindings of both extension modules: borrowed
// read-only and writable buffers, id lists, scores. (Single ids and id arrays: bindings/ids.h.)
// Every helper runs with the GIL held; a buffer is only borrowed: the caller's reference keeps
// the object alive while the GIL is released around the native work.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shadecache {

// A borrowed, read-only view of a bytes-like object (bytes, bytearray, memoryview, contiguous
// numpy array of plain numbers), released when it goes out of scope. TypeError for anything
// else: a strided buffer has no single run of bytes, a buffer of Python objects holds pointers
// that mean nothing outside this process.
class Borrowed {
 public:
  explicit Borrowed(PyObject* o);
  Borrowed(Borrowed&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
  Borrowed(const Borrowed&) = delete;
  ~Borrowed();
  const char* data() const { return static_cast<const char*>(view_.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// A borrowed writable buffer (PyBUF_WRITABLE plus `flags`), released when it goes out of scope.
// TypeError "<refusal>, got <type>" when the object offers none.
class WritableBuffer {
 public:
  WritableBuffer(pybind11::handle obj, int flags, const std::string& refusal);
  WritableBuffer(const WritableBuffer&) = delete;
  WritableBuffer& operator=(const WritableBuffer&) = delete;
  ~WritableBuffer() { PyBuffer_Release(&view_); }
  char* data() const { return static_cast<char*>(view_.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
};

// Ids from a list/tuple of ints (each as a single id is taken) or anything numpy turns into
// int64: a copy, since the caller's array may change while the GIL is released.
std::vector<int64_t> ids_of(pybind11::handle ids);

// The items of a sequence without a copy; *keep holds the sequence they belong to.
PyObject* const* fast_items(pybind11::handle seq, Py_ssize_t* n, pybind11::object* keep);

// One score: a real number (float() of it), else TypeError. The engine refuses NaN and values
// beyond float32 (ValueError).
float score_of(pybind11::handle s);

// `n` scores from an array or sequence of numbers (not strings: "0.5" is no score), copied:
// they are checked, then used with the GIL released. ValueError for another length or shape.
std::vector<float> scores_of(pybind11::handle s, size_t n, const char* what);

}  // namespace shadecache
