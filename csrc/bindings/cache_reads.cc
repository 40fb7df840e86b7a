#include "bindings/cache_reads.h"

#include <atomic>
#include <new>

#include "bindings/errors.h"
#include "bindings/ids.h"
#include "bindings/sample_view.h"

namespace py = pybind11;

namespace shadecache {

BytesSink::BytesSink(uint32_t guess) {
  if (guess && !(obj_ = PyBytes_FromStringAndSize(nullptr, guess))) PyErr_Clear();  // a hint only
}

char* BytesSink::operator()(uint32_t n) {
  if (obj_ && PyBytes_GET_SIZE(obj_) == static_cast<Py_ssize_t>(n)) return PyBytes_AS_STRING(obj_);
  Py_XDECREF(obj_);
  obj_ = PyBytes_FromStringAndSize(nullptr, n);
  if (!obj_) throw std::bad_alloc();
  return PyBytes_AS_STRING(obj_);
}

py::object get_bytes(Cache& c, uint64_t id) {
  BytesSink sink;
  if (c.read(id, sink) < 0) return py::none();
  return py::reinterpret_steal<py::object>(sink.take());
}

namespace {

// ---- the raw get: `cache.get(i)` is the hottest call there is ---------------------------------
//
// pybind11's dispatcher (argument casters, overload resolution) costs about as much as copying a
// 3 KB value. get() is therefore also offered as a plain METH_O CPython function whose `self` is a
// small object holding the Cache and a reference to its pybind11 owner (so the engine cannot be
// freed while the function lives). Same semantics and errors as CacheCore.get.

struct FastGetSelf {
  PyObject_HEAD
  Cache* cache;
  PyObject* owner;  // the CacheCore object; keeps `cache` alive
  // Length of the value the previous get of this cache returned: the guess for the next one.
  // Atomic only because threads may share the function; relaxed, it is a hint.
  std::atomic<uint32_t> last_len;
};

void fast_get_dealloc(PyObject* o) {
  Py_XDECREF(reinterpret_cast<FastGetSelf*>(o)->owner);
  Py_TYPE(o)->tp_free(o);
}

PyTypeObject FastGetSelfType;  // zero-initialized (static storage); filled in by ready_fast_get_type

void ready_fast_get_type() {
  FastGetSelfType.tp_name = "shadecache._core._FastGetSelf";
  FastGetSelfType.tp_basicsize = sizeof(FastGetSelf);
  FastGetSelfType.tp_dealloc = fast_get_dealloc;
  FastGetSelfType.tp_flags = Py_TPFLAGS_DEFAULT;
  if (PyType_Ready(&FastGetSelfType) < 0) throw py::error_already_set();
}

PyObject* fast_get(PyObject* self, PyObject* arg) {
  auto* me = reinterpret_cast<FastGetSelf*>(self);
  Cache& c = *me->cache;
  long long id;
  if (!parse_id(arg, &id)) return nullptr;
  try {
    uint64_t i = checked_id(c, id);
    // Start the two dependent cache misses (the index entry, then the slot and every line of a
    // value of the length the previous get returned) and allocate the result while they are in
    // flight. With the fixed-size samples most data sets have the guess is right, so neither the
    // allocation nor the copy's first lines cost latency of their own.
    uint32_t guess = me->last_len.load(std::memory_order_relaxed);
    if (guess) c.prefetch_value(i, guess); else c.prefetch_value(i);
    BytesSink sink(guess);
    int64_t len = c.read(i, sink);
    if (len < 0) Py_RETURN_NONE;
    if (static_cast<uint32_t>(len) != guess) me->last_len.store(static_cast<uint32_t>(len), std::memory_order_relaxed);
    return sink.take();
  } catch (const Error& e) {
    set_python_error(e);
  } catch (const std::bad_alloc&) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
  }
  return nullptr;
}

PyMethodDef fast_get_def = {"get", fast_get, METH_O,
                            "get(id) -> bytes | None: a copy of sample `id`, None on a miss."};

PyObject* fast_view(PyObject* self, PyObject* arg) {
  auto* me = reinterpret_cast<FastGetSelf*>(self);
  long long id;
  if (!parse_id(arg, &id)) return nullptr;
  try {
    return make_sample_view(me->owner, *me->cache, checked_id(*me->cache, id)).release().ptr();
  } catch (const Error& e) {
    set_python_error(e);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
  }
  return nullptr;
}

PyMethodDef fast_view_def = {"view", fast_view, METH_O,
                             "view(id) -> SampleView | None: a pinned zero-copy view of sample `id`, "
                             "None on a miss."};

// A plain CPython function bound to `core` (METH_O: no pybind11 dispatch on the hot path).
py::object make_fast(py::object core, PyMethodDef* def) {
  auto* self = PyObject_New(FastGetSelf, &FastGetSelfType);
  if (!self) throw py::error_already_set();
  self->cache = &core.cast<Cache&>();
  self->owner = core.release().ptr();
  new (&self->last_len) std::atomic<uint32_t>(0);  // PyObject_New leaves the fields uninitialized
  PyObject* fn = PyCFunction_New(def, reinterpret_cast<PyObject*>(self));
  Py_DECREF(self);
  if (!fn) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace

void register_fast_calls(py::module_& m) {
  ready_fast_get_type();
  m.def("fast_view", [](py::object core) { return make_fast(core, &fast_view_def); }, py::arg("core"),
        "A plain CPython function equivalent to core.view, without pybind11's dispatch cost.");
  m.def("fast_get", [](py::object core) { return make_fast(core, &fast_get_def); }, py::arg("core"),
        "A plain CPython function equivalent to core.get, without pybind11's dispatch cost.");
}

}  // namespace shadecache
