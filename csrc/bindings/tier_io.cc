// shadecache._io.TierReader: the SSD tier's batched, checked reads (csrc/io/tier_reader.h).
//
// GIL: the whole batch (path building, io_uring open/read/close, header and crc32c checks) runs
// without it; the bytes objects of the hits are made after it is taken back.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <vector>

#include "bindings/ids.h"
#include "common/error.h"
#include "io/tier_reader.h"

namespace py = pybind11;

namespace shadecache {

void register_tier_reader(py::module_& m) {
  py::class_<TierReader>(m, "TierReader")
      .def(py::init([](const std::string& backend, unsigned queue_depth, size_t max_open) {
             auto r = std::make_unique<TierReader>(parse_backend_kind(backend), queue_depth, max_open);
             r->backend().name();
             return r;
           }),
           py::arg("backend") = "auto", py::arg("queue_depth") = 64, py::arg("max_open") = 1024)
      .def(
          "read_many",
          [](TierReader& r, const std::string& dir, const py::handle& ids_obj) {
            IdArray ids = integer_ids(ids_obj);
            const int64_t* p = ids.data();
            size_t n = static_cast<size_t>(ids.size());
            for (size_t k = 0; k < n; ++k)
              if (p[k] < 0)
                throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(p[k]) + " is negative");
            // The values of open files are read straight into their result bytes objects,
            // allocated here with the GIL (private to this call until it returns).
            std::vector<int64_t> lens(n);
            r.lengths_of(p, n, lens.data());
            std::vector<py::object> pre(n);
            std::vector<char*> dests(n, nullptr);
            for (size_t k = 0; k < n; ++k) {
              if (lens[k] < 0) continue;
              PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(lens[k]));
              if (b == nullptr) throw py::error_already_set();
              pre[k] = py::reinterpret_steal<py::object>(b);
              dests[k] = PyBytes_AS_STRING(b);
            }
            std::vector<FileRead> files;
            std::vector<TierReader::Result> res;
            {
              py::gil_scoped_release nogil;
              r.read(dir, p, n, dests.data(), files, res);
            }
            py::list values(n);
            py::array_t<int32_t> status(static_cast<py::ssize_t>(n));
            py::array_t<int32_t> err(static_cast<py::ssize_t>(n));
            int32_t* st = status.mutable_data();
            int32_t* er = err.mutable_data();
            size_t hits = 0, bad = 0;
            uint64_t nbytes = 0;
            for (size_t k = 0; k < n; ++k) {
              st[k] = res[k].status;
              er[k] = res[k].err;
              if (res[k].status == TierReader::kOk) {
                ++hits;
                nbytes += res[k].len;
              } else if (res[k].status != TierReader::kMissing) {
                ++bad;
              }
              PyObject* v;
              if (res[k].status != TierReader::kOk) {
                v = Py_NewRef(Py_None);
              } else if (dests[k] && res[k].value == dests[k]) {
                v = pre[k].release().ptr();
              } else {
                v = PyBytes_FromStringAndSize(res[k].value, static_cast<Py_ssize_t>(res[k].len));
                if (v == nullptr) throw py::error_already_set();
              }
              PyList_SET_ITEM(values.ptr(), k, v);
            }
            return py::make_tuple(values, status, err, hits, nbytes, bad);
          },
          py::arg("dir"), py::arg("ids"),
          "(values, status, errno, hits, bytes of the hits, damaged + failed) for the tier files of "
          "ids: bytes or None; status 0 ok, 1 missing, 2 damaged (header, length or crc32c), 3 failed (errno)")
      .def("forget", &TierReader::forget, py::arg("id"), "the file of id was removed")
      .def_property_readonly("open_files", &TierReader::open_files)
      .def_static("path_of", &TierReader::path_of, py::arg("dir"), py::arg("id"))
      .def_property_readonly("backend", [](TierReader& r) { return r.backend().name(); })
      .def_property_readonly("fallback_reason",
                             [](TierReader& r) { return r.backend().fallback_reason(); });
}

}  // namespace shadecache
