// shadecache._io.TierReader: the SSD tier's batched, checked reads (csrc/io/tier_reader.h).
//
// GIL: the ids are looked up in the index columns (numpy arrays owned by shadecache/ssd/layout.py)
// and the result bytes objects allocated with it (private to this call until it returns); the
// reads and crc32c checks run without it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <vector>

#include "bindings/ids.h"
#include "common/error.h"
#include "io/tier_reader.h"

namespace py = pybind11;

namespace shadecache {

namespace {
template <typename T>
py::array_t<T, py::array::c_style | py::array::forcecast> column(const py::handle& h, const char* what,
                                                                 size_t n) {
  auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(h);
  if (!a || a.ndim() != 1 || static_cast<size_t>(a.shape(0)) != n)
    throw py::value_error(std::string("TierReader.read_many: ") + what +
                          " must be a 1-d array as long as fds");
  return a;
}
}  // namespace

void register_tier_reader(py::module_& m) {
  py::class_<TierReader>(m, "TierReader")
      .def(py::init([](const std::string& backend, unsigned queue_depth, int64_t gap_bytes) {
             if (gap_bytes < 0) throw py::value_error("TierReader: gap_bytes must be >= 0");
             auto r = std::make_unique<TierReader>(parse_backend_kind(backend), queue_depth,
                                                   static_cast<uint64_t>(gap_bytes));
             r->backend().name();
             return r;
           }),
           py::arg("backend") = "auto", py::arg("queue_depth") = 64,
           py::arg("gap_bytes") = static_cast<int64_t>(TierReader::kDefaultGapBytes),
           "A reader of the SSD tier's slot files: values of one file at most gap_bytes apart are "
           "read as one extent")
      .def(
          "read_many",
          [](TierReader& r, const py::handle& ids_obj, const py::handle& fd_obj, const py::handle& off_obj,
             const py::handle& len_obj, const py::handle& crc_obj) {
            IdArray ids = integer_ids(ids_obj);
            auto fds = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(fd_obj);
            if (!fds || fds.ndim() != 1) throw py::value_error("TierReader.read_many: fds must be a 1-d array");
            size_t rows = static_cast<size_t>(fds.shape(0));
            auto offs = column<int64_t>(off_obj, "offsets", rows);
            auto lens = column<int64_t>(len_obj, "lengths", rows);
            auto crcs = column<uint32_t>(crc_obj, "crcs", rows);
            const int64_t* id = ids.data();
            size_t n = static_cast<size_t>(ids.size());
            const int32_t* fd = fds.data();
            const int64_t* off = offs.data();
            const int64_t* len = lens.data();
            const uint32_t* crc = crcs.data();
            std::vector<TierReader::Op> ops(n);
            std::vector<py::object> vals(n);
            for (size_t k = 0; k < n; ++k) {
              if (id[k] < 0)
                throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id[k]) + " is negative");
              ops[k] = TierReader::Op{-1, 0, 0, 0, nullptr};
              size_t row = static_cast<size_t>(id[k]);
              if (row >= rows || fd[row] < 0) continue;   // not in the tier
              if (off[row] < 0 || len[row] < 0 || len[row] > static_cast<int64_t>(UINT32_MAX))
                throw py::value_error("TierReader.read_many: offset or length out of range for id " +
                                      std::to_string(id[k]));
              PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(len[row]));
              if (b == nullptr) throw py::error_already_set();
              vals[k] = py::reinterpret_steal<py::object>(b);
              ops[k] = TierReader::Op{fd[row], static_cast<uint64_t>(off[row]), static_cast<uint32_t>(len[row]),
                                      crc[row], PyBytes_AS_STRING(b)};
            }
            std::vector<int32_t> stv(n), erv(n);
            int32_t* st = stv.data();
            int32_t* er = erv.data();
            {
              py::gil_scoped_release nogil;
              r.read(ops.data(), n, st, er);
            }
            py::list values(n);
            size_t hits = 0, bad = 0;
            uint64_t nbytes = 0;
            for (size_t k = 0; k < n; ++k) {
              PyObject* v;
              if (st[k] == TierReader::kOk) {
                ++hits;
                nbytes += ops[k].len;
                v = vals[k].release().ptr();
              } else {
                bad += st[k] != TierReader::kMissing;
                v = Py_NewRef(Py_None);
              }
              PyList_SET_ITEM(values.ptr(), k, v);
            }
            if (bad == 0) return py::tuple(py::make_tuple(values, py::none(), py::none(), hits, nbytes, bad));
            py::array_t<int32_t> status(static_cast<py::ssize_t>(n), st);
            py::array_t<int32_t> err(static_cast<py::ssize_t>(n), er);
            return py::tuple(py::make_tuple(values, status, err, hits, nbytes, bad));
          },
          py::arg("ids"), py::arg("fds"), py::arg("offsets"), py::arg("lengths"), py::arg("crcs"),
          "(values, status, errno, hits, bytes of the hits, damaged + failed; status and errno are None "
          "when that count is 0) for ids, looked up in the "
          "index columns (one row per id): reads lengths[id] bytes at offsets[id] of descriptor fds[id] "
          "(< 0, or an id past the columns: a miss) and checks them against crcs[id] (crc32c); "
          "status 0 ok, 1 missing, 2 damaged (short or crc32c), 3 failed (errno). A negative id "
          "raises IndexError. The columns are read without the GIL: a row changed meanwhile can only "
          "fail its crc32c, never pass with wrong bytes")
      .def_property_readonly("backend", [](TierReader& r) { return r.backend().name(); })
      .def_property_readonly("requests", &TierReader::requests,
                             "reads issued so far (an extent of neighbouring values is one)")
      .def_property_readonly("gap_bytes", &TierReader::gap_bytes)
      .def_property_readonly("fallback_reason",
                             [](TierReader& r) { return r.backend().fallback_reason(); });
}

}  // namespace shadecache
