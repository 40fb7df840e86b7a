#include "bindings/errors.h"

#include "common/error.h"

namespace py = pybind11;

namespace shadecache {
namespace {

// Python classes from shadecache.errors, looked up once at module init and kept alive forever
// (modules are never unloaded, so leaking the references is deliberate).
PyObject* g_classes[12] = {};

PyObject* cls(const char* name) {
  py::object errors = py::module_::import("shadecache.errors");
  return py::object(errors.attr(name)).release().ptr();
}

void raise(const Error& e) {
  PyObject* type = g_classes[static_cast<int>(e.kind())];
  if (e.kind() == ErrorKind::kOs || e.kind() == ErrorKind::kNotFound ||
      e.kind() == ErrorKind::kExists) {
    // OSError(errno, message) so that .errno is set, as Python's own I/O errors do.
    PyObject* exc = PyObject_CallFunction(type, "is", e.err(), e.what());
    if (exc) {
      PyErr_SetObject(type, exc);
      Py_DECREF(exc);
    }
    return;
  }
  if (e.kind() == ErrorKind::kCorruptSample) {
    auto& c = static_cast<const CorruptSample&>(e);
    PyObject* exc = PyObject_CallFunction(type, "sKK", e.what(), c.id(), c.offset());
    if (exc) {
      PyErr_SetObject(type, exc);
      Py_DECREF(exc);
    }
    return;
  }
  PyErr_SetString(type, e.what());
}

}  // namespace

void set_python_error(const Error& e) { raise(e); }

void register_error_translator(py::module_& m) {
  g_classes[static_cast<int>(ErrorKind::kInvalidArgument)] = PyExc_ValueError;
  g_classes[static_cast<int>(ErrorKind::kOutOfRange)] = PyExc_IndexError;
  g_classes[static_cast<int>(ErrorKind::kTooLarge)] = cls("ValueTooLargeError");
  g_classes[static_cast<int>(ErrorKind::kCapacity)] = cls("CapacityError");
  g_classes[static_cast<int>(ErrorKind::kExists)] = PyExc_FileExistsError;
  g_classes[static_cast<int>(ErrorKind::kNotFound)] = PyExc_FileNotFoundError;
  g_classes[static_cast<int>(ErrorKind::kClosed)] = cls("ClosedError");
  g_classes[static_cast<int>(ErrorKind::kLayout)] = cls("LayoutVersionError");
  g_classes[static_cast<int>(ErrorKind::kCorruption)] = cls("CorruptionError");
  g_classes[static_cast<int>(ErrorKind::kFormat)] = cls("StoreFormatError");
  g_classes[static_cast<int>(ErrorKind::kCorruptSample)] = cls("CorruptSampleError");
  g_classes[static_cast<int>(ErrorKind::kOs)] = PyExc_OSError;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise(e);
    }
  });
}

}  // namespace shadecache
