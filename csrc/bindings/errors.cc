#include "bindings/errors.h"

#include <cstring>

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

// The message as str. Messages name paths, and a Linux path is bytes: one that is not UTF-8 comes
// back as os.fsdecode would show it (surrogateescape), never as a UnicodeDecodeError instead.
PyObject* message(const Error& e) {
  return PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())),
                              "surrogateescape");
}

void raise(const Error& e) {
  PyObject* type = g_classes[static_cast<int>(e.kind())];
  PyObject* msg = message(e);
  if (msg == nullptr) return;  // MemoryError set
  PyObject* exc = nullptr;
  if (e.kind() == ErrorKind::kOs || e.kind() == ErrorKind::kNotFound ||
      e.kind() == ErrorKind::kExists) {
    // OSError(errno, message) so that .errno is set, as Python's own I/O errors do.
    exc = PyObject_CallFunction(type, "iO", e.err(), msg);
  } else if (e.kind() == ErrorKind::kCorruptSample) {
    auto& c = static_cast<const CorruptSample&>(e);
    exc = PyObject_CallFunction(type, "OKK", msg, c.id(), c.offset());
  } else {
    PyErr_SetObject(type, msg);
  }
  Py_DECREF(msg);
  if (exc) {
    PyErr_SetObject(type, exc);
    Py_DECREF(exc);
  }
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
