// Reading cache values into Python objects (the hottest calls there are): the id check Cache::read
// leaves to its caller, a bytes object that receives a value, and get / view as plain CPython
// functions without pybind11's dispatch (register_fast_calls). Used by the binding table of
// CacheCore (core_module.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "cache/cache.h"

namespace shadecache {

// The checks Cache::read leaves to its caller: the cache is open and the id in range.
inline uint64_t checked_id(Cache& c, int64_t id) {
  c.check_open();
  c.check_id_signed(id);
  return static_cast<uint64_t>(id);
}

// Receives a value from Cache::read as a bytes object. It reuses the object it holds when the
// length matches (a guess made before the read, or the previous attempt when a writer raced the
// copy) and releases whatever it still holds when it goes out of scope.
class BytesSink {
 public:
  explicit BytesSink(uint32_t guess = 0);
  BytesSink(const BytesSink&) = delete;
  BytesSink& operator=(const BytesSink&) = delete;
  ~BytesSink() { Py_XDECREF(obj_); }
  char* operator()(uint32_t n);
  PyObject* take() {
    PyObject* o = obj_;
    obj_ = nullptr;
    return o;
  }

 private:
  PyObject* obj_ = nullptr;
};

// Copies the value of `id` (already checked) into a new bytes object; None on a miss.
pybind11::object get_bytes(Cache& c, uint64_t id);

// fast_get(core) / fast_view(core): CacheCore.get / CacheCore.view as plain METH_O functions
// bound to one cache (same semantics and errors), for sc.Cache's hot paths.
void register_fast_calls(pybind11::module_& m);

}  // namespace shadecache
