#include "bindings/ids.h"

#include <string>

namespace py = pybind11;

namespace shadecache {

IdArray integer_ids(py::handle ids) {
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
