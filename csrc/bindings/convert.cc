#include "bindings/convert.h"

#include <pybind11/numpy.h>

#include "bindings/ids.h"

namespace py = pybind11;

namespace shadecache {

namespace {

// True when a struct-module format string holds an 'O' (a Python object pointer) code. Field
// names of a structured array stand between colons ("T{i:Offset:f:x:}") and are skipped: a name
// holding the letter O is not an object field.
bool format_has_objects(const char* f) {
  for (; *f; ++f) {
    if (*f == ':') {
      while (*++f && *f != ':') {
      }
      if (!*f) return false;
    } else if (*f == 'O') {
      return true;
    }
  }
  return false;
}

}  // namespace

Borrowed::Borrowed(PyObject* o) {
  // With strides and format (one request): contiguity is checked here, and the format tells an
  // object array (its bytes are pointers into this process: garbage in every other one).
  if (PyObject_GetBuffer(o, &view_, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    throw py::type_error(std::string("cache values must be bytes-like (bytes, bytearray, memoryview, "
                                     "contiguous numpy array), got ") + Py_TYPE(o)->tp_name);
  }
  std::string bad;
  if (!PyBuffer_IsContiguous(&view_, 'C'))
    bad = std::string("cache values must be contiguous, got a strided ") + Py_TYPE(o)->tp_name;
  else if (view_.format && format_has_objects(view_.format))
    bad = "cache values must hold plain bytes, got a buffer of Python objects (format '" + std::string(view_.format) + "')";
  if (!bad.empty()) {
    PyBuffer_Release(&view_);  // a constructor that throws runs no destructor
    throw py::type_error(bad);
  }
  held_ = true;
}

Borrowed::~Borrowed() {
  if (held_) PyBuffer_Release(&view_);
}

WritableBuffer::WritableBuffer(py::handle obj, int flags, const std::string& refusal) {
  // PyObject_GetBuffer directly: py::buffer::request builds a buffer_info (shape and stride
  // vectors) that costs more than a 3 KB copy.
  if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_WRITABLE | flags) != 0) {
    PyErr_Clear();
    throw py::type_error(refusal + ", got " + Py_TYPE(obj.ptr())->tp_name);
  }
}

std::vector<int64_t> ids_of(py::handle ids) {
  std::vector<int64_t> out;
  PyObject* o = ids.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) out[i] = as_id(items[i]);  // as single ids are
    return out;
  }
  IdArray arr = integer_ids(ids);
  out.assign(arr.data(), arr.data() + arr.size());
  return out;
}

PyObject* const* fast_items(py::handle seq, Py_ssize_t* n, py::object* keep) {
  *keep = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), "values must be a sequence"));
  if (!*keep) throw py::error_already_set();
  *n = PySequence_Fast_GET_SIZE(keep->ptr());
  return PySequence_Fast_ITEMS(keep->ptr());
}

float score_of(py::handle s) {
  double d = PyFloat_AsDouble(s.ptr());
  if (d == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string("score must be a real number, got ") + Py_TYPE(s.ptr())->tp_name);
  }
  return static_cast<float>(d);
}

std::vector<float> scores_of(py::handle s, size_t n, const char* what) {
  py::array any = py::array::ensure(s);
  char kind = any ? any.dtype().kind() : 'O';
  if (!any || (any.size() > 0 && kind != 'f' && kind != 'i' && kind != 'u' && kind != 'b')) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an array or sequence of numbers");
  }
  auto arr = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(any);
  if (!arr) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an array or sequence of numbers");
  }
  if (arr.ndim() != 1 || static_cast<size_t>(arr.size()) != n)
    throw py::value_error(std::string(what) + " must be one-dimensional with one entry per id (" + std::to_string(n) +
                          "), got shape of size " + std::to_string(arr.size()));
  return std::vector<float>(arr.data(), arr.data() + arr.size());
}

}  // namespace shadecache
