#include "bindings/sample_view.h"

#include <unistd.h>

#include "bindings/errors.h"
#include "cache/cache.h"

namespace py = pybind11;

namespace shadecache {
namespace {

struct SampleViewObject {
  PyObject_HEAD
  PyObject* owner;  // the CacheCore; keeps `cache` (and its mapping) alive
  Cache* cache;
  const char* data;
  Py_ssize_t len;
  uint64_t id;
  uint32_t token;
  int64_t pid;      // the process that pinned it: release() in a forked child unpins nothing
  uint64_t fork_gen;  // g_fork_generation when pinned: another value means a forked child holds it
  uint64_t seq, gen;  // what Cache::repin checks in a forked child
  Py_ssize_t exports;
  bool released;
};

PyTypeObject SampleViewType;  // zero-initialized; filled in by register_sample_view

void do_release(SampleViewObject* v) {
  if (v->released) return;
  v->released = true;
  v->cache->unpin(v->token, v->pid);
}

void view_dealloc(PyObject* o) {
  auto* v = reinterpret_cast<SampleViewObject*>(o);
  do_release(v);  // no export can be alive: each holds a reference to the view
  Py_XDECREF(v->owner);
  Py_TYPE(o)->tp_free(o);
}

// A view inherited by fork shows bytes its parent pinned and may release at once: the child pins
// them itself on first use, or refuses to show them when the parent's pin went and the value
// changed in between. (Buffers exported before the fork are plain memory: they cannot follow.)
bool own_inherited(SampleViewObject* v) {
  if (__builtin_expect(v->fork_gen == g_fork_generation.load(std::memory_order_relaxed), 1)) return true;
  Cache::Pinned p{v->data, static_cast<uint32_t>(v->len), 0, v->seq, v->gen};
  try {
    if (!v->cache->repin(v->id, &p)) {
      PyErr_Format(PyExc_ValueError,
                   "the view of sample %llu was inherited from process %lld, which released it, and the "
                   "value changed before this process used the view; take a new view here",
                   static_cast<unsigned long long>(v->id), static_cast<long long>(v->pid));
      return false;
    }
  } catch (const Error& e) {
    set_python_error(e);
    return false;
  }
  v->token = p.token;
  v->pid = ::getpid();
  v->fork_gen = g_fork_generation.load(std::memory_order_relaxed);
  return true;
}

int view_getbuffer(PyObject* o, Py_buffer* view, int flags) {
  auto* v = reinterpret_cast<SampleViewObject*>(o);
  if (v->released) {
    PyErr_Format(PyExc_ValueError, "the view of sample %llu was released", static_cast<unsigned long long>(v->id));
    view->obj = nullptr;
    return -1;
  }
  if (!own_inherited(v)) {
    view->obj = nullptr;
    return -1;
  }
  // Read-only: the bytes belong to the cache, shared by every process on the node.
  if (PyBuffer_FillInfo(view, o, const_cast<char*>(v->data), v->len, /*readonly=*/1, flags) < 0) return -1;
  ++v->exports;
  return 0;
}

void view_releasebuffer(PyObject* o, Py_buffer*) { --reinterpret_cast<SampleViewObject*>(o)->exports; }

PyBufferProcs view_as_buffer = {view_getbuffer, view_releasebuffer};

PyObject* view_release(PyObject* o, PyObject*) {
  auto* v = reinterpret_cast<SampleViewObject*>(o);
  if (v->exports > 0) {
    PyErr_Format(PyExc_BufferError,
                 "cannot release the view of sample %llu: %zd buffer(s) exported from it (a memoryview, "
                 "numpy array or tensor) still exist",
                 static_cast<unsigned long long>(v->id), v->exports);
    return nullptr;
  }
  do_release(v);
  Py_RETURN_NONE;
}

PyObject* view_enter(PyObject* o, PyObject*) {
  Py_INCREF(o);
  return o;
}

PyObject* view_exit(PyObject* o, PyObject*) { return view_release(o, nullptr); }

PyMethodDef view_methods[] = {
    {"release", view_release, METH_NOARGS,
     "Ends the view: the cache may free or reuse the slot. Idempotent; raises BufferError while "
     "buffers exported from the view exist."},
    {"__enter__", view_enter, METH_NOARGS, nullptr},
    {"__exit__", view_exit, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyObject* view_get_id(PyObject* o, void*) {
  return PyLong_FromUnsignedLongLong(reinterpret_cast<SampleViewObject*>(o)->id);
}

PyObject* view_get_released(PyObject* o, void*) {
  return PyBool_FromLong(reinterpret_cast<SampleViewObject*>(o)->released);
}

PyGetSetDef view_getset[] = {
    {"id", view_get_id, nullptr, "the sample id", nullptr},
    {"released", view_get_released, nullptr, "True once release() ran (or the view was collected)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

Py_ssize_t view_len(PyObject* o) { return reinterpret_cast<SampleViewObject*>(o)->len; }

PySequenceMethods view_as_sequence;  // zero-initialized; sq_length set in register_sample_view

PyObject* view_repr(PyObject* o) {
  auto* v = reinterpret_cast<SampleViewObject*>(o);
  return PyUnicode_FromFormat("<SampleView id=%llu len=%zd%s>", static_cast<unsigned long long>(v->id), v->len,
                              v->released ? " released" : "");
}

}  // namespace

void register_sample_view(py::module_& m) {
  SampleViewType.tp_name = "shadecache._core.SampleView";
  SampleViewType.tp_basicsize = sizeof(SampleViewObject);
  SampleViewType.tp_dealloc = view_dealloc;
  SampleViewType.tp_flags = Py_TPFLAGS_DEFAULT;
  SampleViewType.tp_doc =
      "A read-only, zero-copy view of one cached sample (buffer protocol). While it is held no "
      "process frees, rewrites or moves the bytes it shows; release() (or `with`, or garbage "
      "collection) ends it.";
  SampleViewType.tp_as_buffer = &view_as_buffer;
  view_as_sequence.sq_length = view_len;
  SampleViewType.tp_as_sequence = &view_as_sequence;
  SampleViewType.tp_methods = view_methods;
  SampleViewType.tp_getset = view_getset;
  SampleViewType.tp_repr = view_repr;
  if (PyType_Ready(&SampleViewType) < 0) throw py::error_already_set();
  Py_INCREF(&SampleViewType);
  m.attr("SampleView") = py::handle(reinterpret_cast<PyObject*>(&SampleViewType));
}

py::object make_sample_view(py::handle owner, Cache& cache, uint64_t id) {
  Cache::Pinned p;
  if (!cache.pin(id, &p)) return py::none();
  auto* v = PyObject_New(SampleViewObject, &SampleViewType);
  if (!v) {
    cache.unpin(p.token, ::getpid());
    throw py::error_already_set();
  }
  v->owner = owner.inc_ref().ptr();
  v->cache = &cache;
  v->data = p.data;
  v->len = static_cast<Py_ssize_t>(p.len);
  v->id = id;
  v->token = p.token;
  v->pid = ::getpid();
  v->fork_gen = g_fork_generation.load(std::memory_order_relaxed);
  v->seq = p.seq;
  v->gen = p.gen;
  v->exports = 0;
  v->released = false;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(v));
}

}  // namespace shadecache
