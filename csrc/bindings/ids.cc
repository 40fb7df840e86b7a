#include "bindings/ids.h"

#include <string>

namespace py = pybind11;

namespace shadecache {

int64_t integer_id(py::handle id) {
  long long v = PyLong_AsLongLong(id.ptr());
  if (v == -1 && PyErr_Occurred()) {
    bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (overflow) throw py::index_error("sample id " + std::string(py::str(id)) + " is out of range");
    throw py::type_error(std::string("sample ids must be integers, got ") + Py_TYPE(id.ptr())->tp_name);
  }
  return v;
}

IdArray integer_ids(py::handle ids) {
  PyObject* o = ids.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {  // item by item: 2**64 is out of range, not a type
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    IdArray a(n);
    int64_t* out = a.mutable_data();
    for (Py_ssize_t i = 0; i < n; ++i) out[i] = integer_id(items[i]);
    return a;
  }
  py::array any = py::array::ensure(ids);
  if (!any) {
    PyErr_Clear();
    throw py::type_error("ids must be a sequence or array of integers");
  }
  char kind = any.dtype().kind();
  if (any.size() > 0 && kind != 'i' && kind != 'u')
    throw py::type_error("ids must be integers, got an array of dtype " + std::string(py::str(any.dtype())));
  IdArray a = IdArray::ensure(any);
  if (!a) throw py::error_already_set();
  if (a.ndim() != 1) throw py::value_error("ids must be one-dimensional");
  return a;
}

}  // namespace shadecache
