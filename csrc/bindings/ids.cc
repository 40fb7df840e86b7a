#include "bindings/ids.h"

#include <string>

namespace py = pybind11;

namespace shadecache {

IdArray integer_ids(py::handle ids) {
  PyObject* o = ids.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {  // item by item: 2**64 is out of range, not a type
    // A tuple copy of a list: as_id may run __index__, which may change the list.
    py::object keep = py::reinterpret_steal<py::object>(PyList_Check(o) ? PyList_AsTuple(o)
                                                                         : (Py_INCREF(o), o));
    if (!keep) throw py::error_already_set();
    Py_ssize_t n = PyTuple_GET_SIZE(keep.ptr());
    PyObject** items = &PyTuple_GET_ITEM(keep.ptr(), 0);
    IdArray a(n);
    int64_t* out = a.mutable_data();
    for (Py_ssize_t i = 0; i < n; ++i) out[i] = as_id(items[i]);
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

bool parse_id(PyObject* arg, long long* id) {
  *id = PyLong_AsLongLong(arg);
  if (*id == -1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
      PyErr_Clear();
      PyObject* text = PyObject_Str(arg);
      PyErr_Format(PyExc_IndexError, "sample id %U is out of range", text);
      Py_XDECREF(text);
    } else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "sample ids must be integers, got %s", Py_TYPE(arg)->tp_name);
    }
    return false;
  }
  return true;
}

int64_t as_id(py::handle arg) {
  long long id;
  if (!parse_id(arg.ptr(), &id)) throw py::error_already_set();
  return id;
}

}  // namespace shadecache
