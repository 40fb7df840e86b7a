// shadecache._io: the packed-store writer and readers, and the folder reader.
//
// GIL contract (docs/store_format.md): every method that waits on I/O releases the GIL for the
// whole native batch. Result bytes objects of a packed read are allocated, with the GIL held,
// BEFORE the batch (their sizes are in the directory) and filled without it, as os.read() does:
// they are private to this call until returned. Folder reads learn sizes only during the batch,
// so their bytes objects are made after the GIL is taken back. No Python object is touched
// while the GIL is released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <malloc.h>

#include <cstring>
#include <memory>
#include <vector>

#include "bindings/directory_columns.h"
#include "bindings/errors.h"
#include "bindings/ids.h"
#include "common/crc32c.h"
#include "common/error.h"
#include "io/device_probe.h"
#include "io/folder_reader.h"
#include "io/pack_writer.h"
#include "io/packed_reader.h"

namespace py = pybind11;
using namespace shadecache;

namespace shadecache {
void register_tier_reader(py::module_& m);  // bindings/tier_io.cc
}
void register_read_stream(py::module_& m);  // read_stream_bindings.cc
namespace shadecache {
void register_store_directory(py::module_& m);  // store_directory_bindings.cc
}

namespace {

py::list packed_read_many(PackedReader& r, const py::handle& ids_obj) {
  IdArray ids = integer_ids(ids_obj);
  const int64_t* p = ids.data();
  size_t n = static_cast<size_t>(ids.size());
  std::vector<py::object> out(n);
  std::vector<char*> dests(n);
  for (size_t k = 0; k < n; ++k) {  // range-check everything before any I/O
    const store::Entry& e = r.entry(p[k]);
    PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(e.length));
    if (b == nullptr) throw py::error_already_set();
    out[k] = py::reinterpret_steal<py::object>(b);
    dests[k] = PyBytes_AS_STRING(b);
  }
  {
    py::gil_scoped_release nogil;
    r.read_into(p, n, dests.data());
  }
  py::list list(n);
  for (size_t k = 0; k < n; ++k) PyList_SET_ITEM(list.ptr(), k, out[k].release().ptr());
  return list;
}

py::bytes packed_read(PackedReader& r, py::handle id_obj) {
  int64_t id = as_id(id_obj);
  const store::Entry& e = r.entry(id);
  PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(e.length));
  if (b == nullptr) throw py::error_already_set();
  auto obj = py::reinterpret_steal<py::bytes>(b);
  char* dest = PyBytes_AS_STRING(b);
  {
    py::gil_scoped_release nogil;
    r.read_into(&id, 1, &dest);
  }
  return obj;
}

py::list folder_read_many(FolderReader& r, const py::handle& ids_obj) {
  IdArray ids = integer_ids(ids_obj);
  const int64_t* p = ids.data();
  size_t n = static_cast<size_t>(ids.size());
  for (size_t k = 0; k < n; ++k) r.path(p[k]);
  std::vector<FileRead> files;
  {
    py::gil_scoped_release nogil;
    r.read(p, n, files);
  }
  py::list list(n);
  for (size_t k = 0; k < n; ++k) {
    PyObject* b = PyBytes_FromStringAndSize(files[k].data.get(),
                                            static_cast<Py_ssize_t>(files[k].size));
    if (b == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(list.ptr(), k, b);
  }
  return list;
}

}  // namespace

PYBIND11_MODULE(_io, m) {
  register_error_translator(m);
  register_tier_reader(m);
  m.doc() = "shadecache native I/O: packed store writer/reader, folder reader (io_uring or pread)";

  m.attr("FORMAT_VERSION") = store::kVersion;
  m.attr("ALIGN") = store::kAlign;
  m.def(
      "placement_order",
      [](uint64_t n, uint64_t seed) { return id_order_array(store::placement_order(n, seed)); },
      py::arg("n"), py::arg("seed"),
      "The ids in the order a store packed with shuffle=True, seed=`seed` lays out n samples.");
  m.def("built_with_uring", &built_with_uring, "True when this build links liburing.");
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t seed) {
        py::buffer_info info = data.request();
        return crc32c(info.ptr, static_cast<size_t>(info.size * info.itemsize), seed);
      },
      py::arg("data"), py::arg("seed") = 0);
  m.def(
      "crc32c_serial",
      [](py::buffer data) {
        py::buffer_info info = data.request();
        return crc32c_serial(info.ptr, static_cast<size_t>(info.size * info.itemsize));
      },
      py::arg("data"), "crc32c from a single chain: the reference for the interleaved crc32c.");
  m.def(
      "tune_malloc",
      [](size_t mmap_threshold, size_t trim_threshold) {
#ifdef __GLIBC__
        return mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1 &&
               mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) == 1;
#else
        return false;
#endif
      },
      py::arg("mmap_threshold"), py::arg("trim_threshold"),
      "glibc mallopt(M_MMAP_THRESHOLD, M_TRIM_THRESHOLD); False where unsupported.");
  m.def(
      "probe_backend",
      [](const std::string& kind, unsigned queue_depth) {
        BackendSlot slot(parse_backend_kind(kind), queue_depth);
        return py::make_tuple(slot.name(), slot.fallback_reason());
      },
      py::arg("backend") = "auto", py::arg("queue_depth") = 64,
      "(name, fallback_reason) of the backend this process would use.");

  py::class_<PackWriter>(m, "PackWriter")
      .def(py::init<const std::string&, bool, uint64_t>(), py::arg("path"),
           py::arg("shuffle") = false, py::arg("seed") = 0)
      .def(
          "add",
          [](PackWriter& w, py::buffer data, int64_t label) {
            py::buffer_info info = data.request();
            if (!PyBuffer_IsContiguous(info.view(), 'C'))
              throw Error(ErrorKind::kInvalidArgument, "sample data must be C-contiguous");
            size_t n = static_cast<size_t>(info.size * info.itemsize);
            py::gil_scoped_release nogil;  // crc + copy + write; the buffer stays alive in `info`
            return w.add(info.ptr, n, label);
          },
          py::arg("data"), py::arg("label"))
      .def(
          "close",
          [](PackWriter& w, const std::string& meta) {
            py::gil_scoped_release nogil;
            w.close(meta);
          },
          py::arg("meta") = "")
      .def("abort", &PackWriter::abort)
      .def_property_readonly("num_samples", &PackWriter::num_samples)
      .def_property_readonly("is_open", &PackWriter::is_open)
      .def_property_readonly("shuffle", &PackWriter::shuffle)
      .def_property_readonly("seed", &PackWriter::seed)
      // bytes: a Linux path need not be UTF-8 (store.py fsdecodes them)
      .def_property_readonly("path", [](const PackWriter& w) { return py::bytes(w.path()); })
      .def_property_readonly("temp_path", [](const PackWriter& w) { return py::bytes(w.temp_path()); });

  py::class_<PackedReader>(m, "PackedReader")
      .def(py::init([](const std::string& path, const std::string& backend, bool direct,
                       unsigned queue_depth, bool verify) {
             auto r = std::make_unique<PackedReader>(path, parse_backend_kind(backend), direct,
                                                     queue_depth, verify);
             r->backend().name();  // create the ring (or pool) now, so fallback shows at open
             return r;
           }),
           py::arg("path"), py::arg("backend") = "auto", py::arg("direct") = false,
           py::arg("queue_depth") = 64, py::arg("verify") = true)
      .def("__len__", &PackedReader::size)
      .def("read", &packed_read, py::arg("id"))
      .def("read_many", &packed_read_many, py::arg("ids"))
      .def(
          "label", [](const PackedReader& r, py::handle id) { return r.entry(as_id(id)).label; },
          py::arg("id"))
      .def(
          "length", [](const PackedReader& r, py::handle id) { return r.entry(as_id(id)).length; },
          py::arg("id"))
      .def(
          "offset", [](const PackedReader& r, py::handle id) { return r.entry(as_id(id)).offset; },
          py::arg("id"))
      .def("labels", [](const PackedReader& r) { return directory_column(r.directory(), &store::Entry::label); })
      .def("lengths", [](const PackedReader& r) { return directory_column(r.directory(), &store::Entry::length); })
      .def("offsets", [](const PackedReader& r) { return directory_column(r.directory(), &store::Entry::offset); })
      .def(
          "find_corrupt",
          [](PackedReader& r, int64_t first, int64_t count) {
            py::gil_scoped_release nogil;
            return r.find_corrupt(first, count);
          },
          py::arg("first"), py::arg("count"))
      .def_property_readonly("meta",
                             [](const PackedReader& r) { return py::bytes(r.meta()); })
      .def("disk_order",
           [](const PackedReader& r) { return id_order_array(r.disk_order()); },
           "The ids in the order their bytes lie in the file.")
      .def(
          "set_shape",
          [](PackedReader& r, uint64_t gap_bytes, uint64_t max_extent_bytes) {
            if (max_extent_bytes < 4096 || max_extent_bytes > (uint64_t{1} << 31))
              throw Error(ErrorKind::kInvalidArgument,
                          "max_extent_bytes must be in [4096, 2 GiB], not " +
                              std::to_string(max_extent_bytes));
            r.set_shape(ReadShape{gap_bytes, max_extent_bytes});
          },
          py::arg("gap_bytes"), py::arg("max_extent_bytes"),
          "Coalesce reads into extents: neighbours at most gap_bytes apart are read together.")
      .def_property_readonly("shape",
                             [](const PackedReader& r) {
                               return py::make_tuple(r.shape().gap_bytes, r.shape().max_extent_bytes);
                             })
      .def(
          "counters",
          [](PackedReader& r) {
            py::dict d;
            d["samples"] = r.counters().samples.load();
            d["requests"] = r.counters().requests.load();
            d["bytes"] = r.counters().bytes.load();
            return d;
          },
          "Samples read, read requests issued (extents) and bytes asked of the device.")
      .def(
          "probe_device",
          [](PackedReader& r, unsigned small, unsigned large, uint64_t seed) {
            DeviceProbe p;
            {
              py::gil_scoped_release nogil;
              if (r.closed()) throw Error(ErrorKind::kClosed, "PackedStore " + r.path() + " is closed");
              const store::Header& h = r.header();
              r.backend().with([&](IoBackend& b) {
                p = probe_device(r.path(), r.buffered_fd(), h.data_offset,
                                 h.data_offset + h.data_bytes, b, small, large, seed);
              });
            }
            return py::make_tuple(p.iops, p.bandwidth, p.direct);
          },
          py::arg("small") = 128, py::arg("large") = 8, py::arg("seed") = 1,
          "(4 KiB reads/s, bytes/s of 1 MiB reads, measured with O_DIRECT) over the data region.")
      .def_property_readonly("version", [](const PackedReader& r) { return r.header().version; })
      .def_property_readonly("placement",
                             [](const PackedReader& r) {
                               return r.header().placement == store::kShuffled ? "shuffled" : "as written";
                             })
      .def_property_readonly("placement_seed",
                             [](const PackedReader& r) { return r.header().placement_seed; })
      .def_property_readonly("data_bytes", [](const PackedReader& r) { return r.header().data_bytes; })
      .def_property_readonly("dir_crc", [](const PackedReader& r) { return r.header().dir_crc; })
      .def_property_readonly("file_bytes",
                             [](const PackedReader& r) { return r.header().file_bytes; })
      .def_property_readonly("path", [](const PackedReader& r) { return py::bytes(r.path()); })
      .def_property_readonly("direct", &PackedReader::direct)
      .def_property_readonly("verify", &PackedReader::verify)
      .def_property_readonly("queue_depth",
                             [](PackedReader& r) { return r.backend().queue_depth(); })
      .def_property_readonly("backend", [](PackedReader& r) { return r.backend().name(); })
      .def_property_readonly("fallback_reason",
                             [](PackedReader& r) { return r.backend().fallback_reason(); })
      .def_property_readonly("backend_pid", [](PackedReader& r) { return r.backend().owner_pid(); })
      .def_property_readonly("closed", &PackedReader::closed)
      .def("close", &PackedReader::close, py::call_guard<py::gil_scoped_release>());

  register_read_stream(m);
  register_store_directory(m);

  py::class_<FolderReader>(m, "FolderReader")
      .def(py::init([](std::vector<std::string> paths, const std::string& backend,
                       unsigned queue_depth) {
             auto r = std::make_unique<FolderReader>(std::move(paths), parse_backend_kind(backend),
                                                     queue_depth);
             r->backend().name();
             return r;
           }),
           py::arg("paths"), py::arg("backend") = "auto", py::arg("queue_depth") = 64)
      .def("__len__", &FolderReader::size)
      .def("read_many", &folder_read_many, py::arg("ids"))
      .def(
          "read",
          [](FolderReader& r, py::handle id) {
            py::list l = folder_read_many(r, py::cast(std::vector<int64_t>{as_id(id)}));
            return py::reinterpret_borrow<py::bytes>(l[0]);
          },
          py::arg("id"))
      .def(
          "path", [](const FolderReader& r, py::handle id) { return py::bytes(r.path(as_id(id))); },
          py::arg("id"))
      .def_property_readonly("queue_depth",
                             [](FolderReader& r) { return r.backend().queue_depth(); })
      .def_property_readonly("backend", [](FolderReader& r) { return r.backend().name(); })
      .def_property_readonly("fallback_reason",
                             [](FolderReader& r) { return r.backend().fallback_reason(); })
      .def_property_readonly("backend_pid",
                             [](FolderReader& r) { return r.backend().owner_pid(); })
      .def("close", &FolderReader::close);
}
