// Python bindings of the cache engine: shadecache._core.CacheCore.
//
// GIL contract: reads (get, get_many, get_into, contains, snapshots) never wait, so they keep the
// GIL; every call that may wait for the cache mutex (put, put_many, remove, update_scores, stats,
// check) releases it first, after the arguments have been turned into native values. The one
// exception is put of a small value: it tries the mutex with the GIL held and releases the GIL
// only if the mutex is busy (then waits without it), because a GIL round trip costs more than the
// put itself. Values are only
// borrowed (Py_buffer) while the GIL is released; the caller's references keep them alive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <new>
#include <vector>

#include "bindings/batch_gather.h"
#include "bindings/peer_io.h"
#include "bindings/errors.h"
#include "bindings/ids.h"
#include "bindings/next_use_bindings.h"
#include "bindings/sample_view.h"
#include "bindings/test_hooks.h"
#include "cache/cache.h"
#include "cache/segment.h"

namespace py = pybind11;
using namespace shadecache;

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

// A borrowed, read-only view of any bytes-like object, released when it goes out of scope.
class Borrowed {
 public:
  explicit Borrowed(PyObject* o) {
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
  Borrowed(Borrowed&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
  Borrowed(const Borrowed&) = delete;
  ~Borrowed() {
    if (held_) PyBuffer_Release(&view_);
  }
  const char* data() const { return static_cast<const char*>(view_.buf); }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// The checks Cache::read leaves to its caller: the cache is open and the id in range.
uint64_t checked_id(Cache& c, int64_t id) {
  c.check_open();
  c.check_id_signed(id);
  return static_cast<uint64_t>(id);
}

// Receives a value from Cache::read as a bytes object. It reuses the object it holds when the
// length matches (a guess made before the read, or the previous attempt when a writer raced the
// copy) and releases whatever it still holds when it goes out of scope.
class BytesSink {
 public:
  explicit BytesSink(uint32_t guess = 0) {
    if (guess && !(obj_ = PyBytes_FromStringAndSize(nullptr, guess))) PyErr_Clear();  // a hint only
  }
  BytesSink(const BytesSink&) = delete;
  BytesSink& operator=(const BytesSink&) = delete;
  ~BytesSink() { Py_XDECREF(obj_); }
  char* operator()(uint32_t n) {
    if (obj_ && PyBytes_GET_SIZE(obj_) == static_cast<Py_ssize_t>(n)) return PyBytes_AS_STRING(obj_);
    Py_XDECREF(obj_);
    obj_ = PyBytes_FromStringAndSize(nullptr, n);
    if (!obj_) throw std::bad_alloc();
    return PyBytes_AS_STRING(obj_);
  }
  PyObject* take() {
    PyObject* o = obj_;
    obj_ = nullptr;
    return o;
  }

 private:
  PyObject* obj_ = nullptr;
};

// Copies the value of `id` (already checked) into a new bytes object; None on a miss.
py::object get_bytes(Cache& c, uint64_t id) {
  BytesSink sink;
  if (c.read(id, sink) < 0) return py::none();
  return py::reinterpret_steal<py::object>(sink.take());
}

// Ids from a list/tuple of ints (fast path) or anything numpy turns into int64.
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
  out.assign(arr.data(), arr.data() + arr.size());  // a copy: the caller's array may change later
  return out;
}

PyObject* const* fast_items(py::handle seq, Py_ssize_t* n, py::object* keep) {
  *keep = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), "values must be a sequence"));
  if (!*keep) throw py::error_already_set();
  *n = PySequence_Fast_GET_SIZE(keep->ptr());
  return PySequence_Fast_ITEMS(keep->ptr());
}

// One score, by the rule scores_of applies to each: a number (float() of it), else TypeError; the
// engine then refuses NaN and values beyond float32 (ValueError).
float score_of(py::handle s) {
  double d = PyFloat_AsDouble(s.ptr());
  if (d == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string("score must be a real number, got ") + Py_TYPE(s.ptr())->tp_name);
  }
  return static_cast<float>(d);
}

// A copy, not a view of the caller's array: the scores are checked, then used with the GIL
// released, when another thread could change that array.
std::vector<float> scores_of(py::handle s, size_t n, const char* what) {
  // Numbers only: a cast would turn strings ("0.5") into scores where put refuses them.
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

const char* policy_name(Policy p) {
  const EvictionPolicy* e = policy_by_id(static_cast<uint32_t>(p));
  return e ? e->name() : "unknown";
}

// Sample sizes for Cache::create (numpy uint64, checked by the Python layer); empty = none given.
using SizesArray = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

CacheOptions options(uint64_t num_samples, uint64_t capacity_bytes, uint64_t max_item_bytes, uint32_t policy,
                     const SizesArray& sizes) {
  CacheOptions o;
  o.num_samples = num_samples;
  o.capacity_bytes = capacity_bytes;
  o.max_item_bytes = max_item_bytes;
  o.policy = static_cast<Policy>(policy);
  o.sizes.assign(sizes.data(), sizes.data() + sizes.size());
  return o;
}

py::dict stats_dict(const CacheStats& s) {
  py::dict d;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["read_retries"] = s.read_retries;
  d["inserts"] = s.inserts;
  d["updates"] = s.updates;
  d["evictions"] = s.evictions;
  d["rejected"] = s.rejected;
  d["page_moves"] = s.page_moves;
  d["relocations"] = s.relocations;
  d["recoveries"] = s.recoveries;
  d["score_updates"] = s.score_updates;
  d["items"] = s.items;
  d["bytes_used"] = s.bytes_used;
  d["capacity_bytes"] = s.capacity_bytes;
  d["value_bytes"] = s.bytes_used;
  d["efficiency"] = s.capacity_bytes ? static_cast<double>(s.bytes_used) / s.capacity_bytes : 0.0;
  d["data_bytes"] = s.data_bytes;
  d["num_samples"] = s.num_samples;
  d["page_size"] = s.page_size;
  d["chunk_size"] = s.chunk_size;
  d["heap_pages"] = s.heap_pages;
  d["num_pages"] = s.num_pages;
  d["free_pages"] = s.free_pages;
  d["segment_bytes"] = s.segment_bytes;
  d["max_item_bytes"] = s.max_item_bytes;
  d["pinned"] = s.pinned;
  d["zombies"] = s.zombies;
  d["creator_pid"] = s.creator_pid;
  d["policy"] = policy_name(static_cast<Policy>(s.policy));
  uint64_t lookups = s.hits + s.misses;
  d["hit_ratio"] = lookups ? static_cast<double>(s.hits) / lookups : 0.0;
  return d;
}

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

PYBIND11_MODULE(_core, m) {
  m.doc() = "shadecache cache engine (see shadecache.Cache for the documented API)";
  register_error_translator(m);
  register_peer_io(m);  // bindings/peer_io.cc

  py::class_<Cache>(m, "CacheCore")
      .def_static(
          "create",
          [](const std::string& name, uint64_t num_samples, uint64_t capacity_bytes, uint64_t max_item_bytes,
             uint32_t policy, const SizesArray& sizes, bool persist, const std::string& fingerprint,
             uint64_t item_limit) {
            CacheOptions o = options(num_samples, capacity_bytes, max_item_bytes, policy, sizes);
            o.item_limit = item_limit;
            o.persist = persist;
            o.fingerprint = fingerprint;
            py::gil_scoped_release nogil;  // reserving and zeroing the segment can take a while
            return Cache::create(name, o);
          },
          py::arg("name"), py::arg("num_samples"), py::arg("capacity_bytes"), py::arg("max_item_bytes"),
          py::arg("policy"), py::arg("sizes"), py::arg("persist") = false, py::arg("fingerprint") = "",
          py::arg("item_limit") = 0)
      .def_static("attach", [](const std::string& name, bool touch) { return Cache::attach(name, touch); },
                  py::arg("name"), py::arg("touch") = true)
      .def_static("unlink", &Segment::unlink, py::arg("name"))
      .def_static("list", &Segment::list)
      .def_static("path", &Segment::path, py::arg("name"))
      .def_static(
          "segment_bytes",
          [](uint64_t num_samples, uint64_t capacity_bytes, uint64_t max_item_bytes, uint32_t policy,
             const SizesArray& sizes) {
            return Cache::segment_bytes(options(num_samples, capacity_bytes, max_item_bytes, policy, sizes));
          })
      .def_static(
          "capacity_for",
          [](uint64_t items, const SizesArray& sizes, uint64_t num_samples, uint32_t policy) {
            CacheOptions o = options(num_samples, 1, 1, policy, sizes);
            return capacity_for(items, o.sizes, num_samples, o.policy);
          },
          py::arg("items"), py::arg("sizes"), py::arg("num_samples"), py::arg("policy"))
      .def_static("read_creator",
                  [](const std::string& name) -> py::object {
                    int64_t pid;
                    uint64_t start;
                    if (!Cache::read_creator(name, &pid, &start)) return py::none();
                    return py::make_tuple(pid, start);
                  })
      .def_property_readonly("name", &Cache::name)
      .def_property_readonly("num_samples", &Cache::num_samples)
      .def_property_readonly("max_item_bytes", [](Cache& c) { c.check_open(); return c.max_item_bytes(); })
      .def_property_readonly("page_size", [](Cache& c) { c.check_open(); return c.page_size(); })
      .def_property_readonly("closed", &Cache::closed)
      .def_property_readonly("policy", [](Cache& c) { c.check_open(); return policy_name(c.policy()); })
      .def_property_readonly("capacity_bytes", [](Cache& c) { c.check_open(); return c.capacity_bytes(); })
      .def_property_readonly("persist", [](Cache& c) { c.check_open(); return c.persist(); })
      .def_property_readonly("fingerprint", [](Cache& c) { c.check_open(); return c.fingerprint(); })
      .def_property_readonly("created_unix_ns", [](Cache& c) { c.check_open(); return c.created_unix_ns(); })
      .def_property_readonly("last_attach_unix_ns", [](Cache& c) { c.check_open(); return c.last_attach_unix_ns(); })
      .def("get", [](Cache& c, py::handle id) { return get_bytes(c, checked_id(c, as_id(id))); }, py::arg("id"))
      .def("get_many",
           [](Cache& c, py::handle ids) {
             std::vector<int64_t> v = ids_of(ids);
             c.check_open();
             for (int64_t id : v) c.check_id_signed(id);  // a bad id fails the batch up front
             py::list out(v.size());
             const size_t n = v.size();
             // Software pipeline: index entries 8 ahead, values 4 ahead, copy the current one.
             for (size_t i = 0; i < n && i < 8; ++i) c.prefetch_index(v[i]);
             for (size_t i = 0; i < n && i < 4; ++i) c.prefetch_value(v[i]);
             for (size_t i = 0; i < n; ++i) {
               if (i + 8 < n) c.prefetch_index(v[i + 8]);
               if (i + 4 < n) c.prefetch_value(v[i + 4]);
               py::object b = get_bytes(c, static_cast<uint64_t>(v[i]));
               PyList_SET_ITEM(out.ptr(), i, b.release().ptr());
             }
             return out;
           },
           py::arg("ids"))
      .def("view",
           [](py::object self, py::handle id) {
             Cache& c = self.cast<Cache&>();
             return make_sample_view(self, c, checked_id(c, as_id(id)));
           },
           py::arg("id"))
      // Test only (tests/test_cache_views.py): the pin entry of a reader backing out.
      .def("_stale_pin", [](Cache& c, int64_t id) { return c.stale_pin_for_tests(checked_id(c, id)); })
      .def("_stale_unpin", [](Cache& c, uint32_t token) { c.stale_unpin_for_tests(token); })
      .def("get_into",
           [](Cache& c, py::handle id_arg, py::handle buf) {
             int64_t id = as_id(id_arg);
             // PyObject_GetBuffer directly: py::buffer::request builds a buffer_info (shape and
             // stride vectors) that costs more than a 3 KB copy.
             Py_buffer view;
             if (PyObject_GetBuffer(buf.ptr(), &view, PyBUF_WRITABLE) != 0) {
               PyErr_Clear();
               throw py::type_error("get_into needs a writable buffer (bytearray, numpy array, ...), got " +
                                    std::string(Py_TYPE(buf.ptr())->tp_name));
             }
             struct Release {
               Py_buffer* v;
               ~Release() { PyBuffer_Release(v); }
             } release{&view};
             uint64_t cap = static_cast<uint64_t>(view.len);
             char* dst = static_cast<char*>(view.buf);
             // A length offered before the read is validated may belong to a racing writer's value:
             // copy an oversize one aside and judge the buffer on the length the read confirms.
             std::vector<char> aside;
             int64_t len = c.read(checked_id(c, id), [&](uint32_t n) -> char* {
               if (n <= cap) return dst;
               aside.resize(n);
               return aside.data();
             });
             if (len > static_cast<int64_t>(cap))
               throw py::value_error("buffer of " + std::to_string(cap) + " bytes is too small for sample id " +
                                     std::to_string(id) + " (" + std::to_string(len) + " bytes)");
             return len;
           },
           py::arg("id"), py::arg("buffer"))
      .def("contains", [](Cache& c, py::handle id) { return c.contains(checked_id(c, as_id(id))); }, py::arg("id"))
      .def("put",
           [](Cache& c, py::handle id, py::handle data, py::object score) {
             int64_t raw = as_id(id);
             Borrowed b(data.ptr());
             uint64_t i = checked_id(c, raw);
             float s = score.is_none() ? 0.0f : score_of(score);
             const float* sp = score.is_none() ? nullptr : &s;
             // Small values on an uncontended mutex: keep the GIL (releasing it costs more than
             // the whole put). Large values, or a busy mutex: release it for the copy / the wait.
             constexpr uint64_t kKeepGilBelow = 64 * 1024;
             if (b.size() < kKeepGilBelow) {
               PutItem it = c.make_item(i, b.data(), b.size());
               int r = c.try_put(it, sp);
               if (r >= 0) return r == 1;
               py::gil_scoped_release nogil;
               return c.put(it, sp);
             }
             Cache::Use use(c);  // make_item reads the segment: a close() from another thread waits
             py::gil_scoped_release nogil;
             return c.put(c.make_item(i, b.data(), b.size()), sp);
           },
           py::arg("id"), py::arg("data"), py::arg("score") = py::none())
      .def("put_many",
           [](Cache& c, py::handle ids, py::handle values, py::object scores) {
             std::vector<int64_t> v = ids_of(ids);
             py::object keep;
             Py_ssize_t n;
             PyObject* const* vals = fast_items(values, &n, &keep);
             if (static_cast<size_t>(n) != v.size())
               throw py::value_error("put_many got " + std::to_string(v.size()) + " ids but " + std::to_string(n) +
                                     " values");
             std::vector<Borrowed> bufs;
             bufs.reserve(n);
             std::vector<PutItem> items;
             items.reserve(n);
             for (Py_ssize_t i = 0; i < n; ++i) {
               bufs.emplace_back(vals[i]);
               items.push_back(c.make_item(checked_id(c, v[i]), bufs.back().data(), bufs.back().size()));
             }
             std::vector<float> sc;
             if (!scores.is_none()) sc = scores_of(scores, v.size(), "scores");
             py::array_t<bool> admitted(static_cast<py::ssize_t>(v.size()));
             auto* out = reinterpret_cast<uint8_t*>(admitted.mutable_data());
             const float* sp = scores.is_none() ? nullptr : sc.data();
             {
               py::gil_scoped_release nogil;
               c.put_many(items, sp, out);
             }
             return admitted;
           },
           py::arg("ids"), py::arg("values"), py::arg("scores") = py::none())
      .def("remove",
           [](Cache& c, py::handle id) {
             uint64_t i = checked_id(c, as_id(id));
             py::gil_scoped_release nogil;
             return c.remove(i);
           },
           py::arg("id"))
      .def("update_scores",
           [](Cache& c, py::handle ids, py::handle scores) {
             // ids_of and scores_of return copies: used with the GIL released (see scores_of).
             std::vector<int64_t> v = ids_of(ids);
             std::vector<float> sc = scores_of(scores, v.size(), "scores");
             py::gil_scoped_release nogil;
             c.update_scores(v.data(), sc.data(), v.size());
           },
           py::arg("ids"), py::arg("scores"))
      .def("cached_mask",
           [](Cache& c) {
             py::array_t<bool> out(static_cast<py::ssize_t>(c.num_samples()));
             c.cached_mask(reinterpret_cast<uint8_t*>(out.mutable_data()));
             return out;
           })
      .def("scores",
           [](Cache& c) {
             py::array_t<float> out(static_cast<py::ssize_t>(c.num_samples()));
             c.scores_snapshot(out.mutable_data());
             return out;
           })
      .def("stats",
           [](Cache& c) {
             CacheStats s;
             {
               py::gil_scoped_release nogil;
               s = c.stats();
             }
             return stats_dict(s);
           })
      .def("check",
           [](Cache& c) {
             py::gil_scoped_release nogil;
             c.check();
           })
      .def("close", &Cache::close);

  register_next_use(m);
  register_sample_view(m);
  register_batch_gather(m);
  m.attr("MAX_VIEWS_PER_PROCESS") = kPinsPerOwner;
  m.attr("MAX_VIEW_PROCESSES") = kPinOwners;
  ready_fast_get_type();
  m.def("fast_view", [](py::object core) { return make_fast(core, &fast_view_def); }, py::arg("core"),
        "A plain CPython function equivalent to core.view, without pybind11's dispatch cost.");
  m.def("fast_get", [](py::object core) { return make_fast(core, &fast_get_def); }, py::arg("core"),
        "A plain CPython function equivalent to core.get, without pybind11's dispatch cost.");

  register_test_hooks(m);
  m.attr("LAYOUT_VERSION") = kLayoutVersion;
  // Defined once here for Python: policy names by number, and the bytes a slot adds to a value.
  m.attr("POLICIES") = policy_names();
  m.attr("SLOT_HEADER_SIZE") = sizeof(SlotHeader);
  m.def("process_start_time", &process_start_time, py::arg("pid"),
        "Start time of process `pid` in clock ticks since boot, 0 if there is no such process.");
  m.def("process_gone", &process_gone, py::arg("pid"), py::arg("start_time"),
        "True only when process `pid` (started at `start_time`, 0 = unknown) is known to be gone: no such "
        "pid, exited but not yet waited for, or the pid reused. False when in doubt.");
}
