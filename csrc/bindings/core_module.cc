// Python bindings of the cache engine: shadecache._core. This file is the binding table of
// CacheCore and the module's constants; argument conversion is bindings/convert.h (shared with
// the _io module), get and view as hand-written CPython calls bindings/cache_reads.h, and the
// rest registers from its own file (views, batch gathers, peer replies, next uses, test hooks).
//
// GIL contract: reads (get, get_many, get_into, contains, snapshots) never wait, so they keep the
// GIL; every call that may wait for the cache mutex (put, put_many, remove, update_scores, stats,
// check) releases it first, after the arguments have been turned into native values. The one
// exception is put of a small value: it tries the mutex with the GIL held and releases the GIL
// only if the mutex is busy (then waits without it), because a GIL round trip costs more than the
// put itself. Values are only borrowed (Py_buffer) while the GIL is released; the caller's
// references keep them alive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings/batch_gather.h"
#include "bindings/cache_reads.h"
#include "bindings/convert.h"
#include "bindings/errors.h"
#include "bindings/ids.h"
#include "bindings/peer_costs.h"
#include "bindings/peer_io.h"
#include "bindings/next_use_bindings.h"
#include "bindings/sample_view.h"
#include "bindings/test_hooks.h"
#include "cache/cache.h"
#include "cache/segment.h"
#include "net/aead.h"
#include "net/peer_wire.h"

namespace py = pybind11;
using namespace shadecache;

namespace {

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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "shadecache cache engine (see shadecache.Cache for the documented API)";
  register_error_translator(m);
  register_peer_io(m);     // bindings/peer_io.cc
  register_peer_costs(m);  // bindings/peer_costs.cc

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
      // Test only (tests/cache/test_cache_views.py): the pin entry of a reader backing out.
      .def("_stale_pin", [](Cache& c, int64_t id) { return c.stale_pin_for_tests(checked_id(c, id)); })
      .def("_stale_unpin", [](Cache& c, uint32_t token) { c.stale_unpin_for_tests(token); })
      .def("get_into",
           [](Cache& c, py::handle id_arg, py::handle buf) {
             int64_t id = as_id(id_arg);
             WritableBuffer out(buf, 0, "get_into needs a writable buffer (bytearray, numpy array, ...)");
             uint64_t cap = out.size();
             char* dst = out.data();
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
      .def("would_admit",
           [](Cache& c, py::handle ids, py::handle displaced) {
             std::vector<int64_t> v = ids_of(ids);
             std::vector<int64_t> d = ids_of(displaced);
             if (d.size() != v.size())
               throw py::value_error("would_admit got " + std::to_string(v.size()) + " ids but " +
                                     std::to_string(d.size()) + " displaced counts");
             py::array_t<bool> out(static_cast<py::ssize_t>(v.size()));
             auto* o = reinterpret_cast<uint8_t*>(out.mutable_data());
             {
               py::gil_scoped_release nogil;
               c.would_admit(v.data(), d.data(), v.size(), o);
             }
             return out;
           },
           py::arg("ids"), py::arg("displaced"))
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
  register_fast_calls(m);  // bindings/cache_reads.cc

  register_test_hooks(m);
  m.attr("LAYOUT_VERSION") = kLayoutVersion;
  // Defined once here for Python: policy names by number, and the bytes a slot adds to a value.
  m.attr("POLICIES") = policy_names();
  m.attr("SLOT_HEADER_SIZE") = sizeof(SlotHeader);
  // The peer protocol's constants, defined once (net/peer_wire.h, net/aead.h): shadecache/peer/
  // wire.py takes them from here.
  py::dict wire;
  wire["MAGIC"] = py::bytes("SHCP", 4);
  wire["VERSION"] = net::kVersion;
  for (auto [name, op] : {std::pair{"HELLO", net::kHello}, {"PROOF", net::kProof}, {"GET", net::kGet},
                          {"GET_REPLY", net::kGetReply}, {"PING", net::kPing}, {"PONG", net::kPong},
                          {"ERROR", net::kError}, {"STATS", net::kStats}, {"STATS_REPLY", net::kStatsReply}})
    wire[name] = op;
  for (auto [name, code] : {std::pair{"E_BAD_MAGIC", net::kEBadMagic}, {"E_BAD_VERSION", net::kEBadVersion},
                            {"E_BAD_OPCODE", net::kEBadOpcode}, {"E_TOO_LARGE", net::kETooLarge},
                            {"E_BAD_LENGTH", net::kEBadLength}, {"E_AUTH", net::kEAuth}, {"E_BAD_ID", net::kEBadId},
                            {"E_INTERNAL", net::kEInternal}, {"E_DATASET", net::kEDataSet}, {"E_BUSY", net::kEBusy}})
    wire[name] = code;
  wire["MORE"] = net::kMore;
  wire["MAX_BATCH"] = net::kMaxBatch;
  wire["MAX_VALUE"] = net::kMaxValue;
  wire["MAX_REPLY"] = net::kMaxReply;
  wire["MAX_ERROR"] = net::kMaxError;
  wire["MAX_STATS"] = net::kMaxStats;
  wire["MISS"] = net::kMiss;
  wire["HEADER_BYTES"] = sizeof(net::Header);
  wire["ENTRY_BYTES"] = net::kEntryBytes;
  wire["TAG_BYTES"] = net::Aead::kTagBytes;
  m.attr("WIRE") = wire;
  m.def("process_start_time", &process_start_time, py::arg("pid"),
        "Start time of process `pid` in clock ticks since boot, 0 if there is no such process.");
  m.def("process_gone", &process_gone, py::arg("pid"), py::arg("start_time"),
        "True only when process `pid` (started at `start_time`, 0 = unknown) is known to be gone: no such "
        "pid, exited but not yet waited for, or the pid reused. False when in doubt.");
}
