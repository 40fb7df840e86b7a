// shadecache._io.StoreDirectory and FetchedBatch: a packed store's directory built from bytes the
// caller fetched (an object's header block and its tail [dir_offset, file_bytes)), and batches of
// samples whose ranges the caller fetches (csrc/io/fetched_batch.h; shadecache/store/s3.py).
//
// GIL contract: building a directory (validation, placement) and landing a range (copy + crc32c)
// run without the GIL. A batch's bytes objects are made with the GIL held when the batch is made
// (their sizes are in the directory) and written without it, through view(x) by the caller's
// fetch and by land(x); they stay private to the batch until finish() hands them out, as the
// bytes of a file read (io_module.cc) stay private to read_many.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/directory_columns.h"
#include "bindings/ids.h"
#include "common/error.h"
#include "io/fetched_batch.h"
#include "io/store_directory.h"

namespace py = pybind11;

namespace shadecache {
namespace {

struct PyFetchedBatch {
  py::object dir_ref;        // the StoreDirectory the batch's entries live in
  std::vector<py::object> out;
  std::unique_ptr<FetchedBatch> batch;
  bool finished = false;

  FetchedBatch& b() {
    if (finished) throw Error(ErrorKind::kClosed, "this batch was finished; make another");
    return *batch;
  }
};

py::bytes as_bytes(const std::string& s) { return py::bytes(s); }

std::unique_ptr<StoreDirectory> directory_from_image(const std::string& name, uint64_t size,
                                                     py::buffer head, py::buffer tail,
                                                     uint64_t tail_offset) {
  py::buffer_info h = head.request(), t = tail.request();
  const char* hp = static_cast<const char*>(h.ptr);
  const char* tp = static_cast<const char*>(t.ptr);
  uint64_t hn = static_cast<uint64_t>(h.size * h.itemsize), tn = static_cast<uint64_t>(t.size * t.itemsize);
  // The image holds [0, hn) and [tail_offset, tail_offset + tn): a read anywhere else finds no
  // bytes, which the directory reports as truncation.
  RegionRead read = [=](void* buf, size_t n, uint64_t off) {
    if (off + n <= hn) {
      std::memcpy(buf, hp + off, n);
      return true;
    }
    if (off >= tail_offset && off - tail_offset + n <= tn) {
      std::memcpy(buf, tp + (off - tail_offset), n);
      return true;
    }
    return false;
  };
  py::gil_scoped_release nogil;  // the buffers stay alive in h and t
  return std::make_unique<StoreDirectory>(name, size, read);
}

}  // namespace

void register_store_directory(py::module_& m) {
  py::class_<StoreDirectory>(m, "StoreDirectory")
      .def(py::init(&directory_from_image), py::arg("name"), py::arg("size"), py::arg("head"),
           py::arg("tail"), py::arg("tail_offset"),
           "The directory of the store `name` of `size` bytes, from its first bytes (`head`, at "
           "least the 128-byte header) and `tail`, its bytes from `tail_offset` (the directory's "
           "offset) to the end; validated as a store file is at open.")
      .def_static(
          "check_header",
          [](const std::string& name, py::buffer head, uint64_t size) {
            py::buffer_info h = head.request();
            store::Header hd = StoreDirectory::check_header(name, h.ptr,
                                                            static_cast<size_t>(h.size * h.itemsize), size);
            return py::make_tuple(hd.dir_offset, hd.file_bytes, hd.num_samples);
          },
          py::arg("name"), py::arg("head"), py::arg("size"),
          "(dir_offset, file_bytes, num_samples) of a valid header for a store of `size` bytes; "
          "StoreFormatError naming `name` otherwise.")
      .def("__len__", &StoreDirectory::size)
      .def("label", [](const StoreDirectory& d, py::handle id) { return d.entry(as_id(id)).label; })
      .def("length", [](const StoreDirectory& d, py::handle id) { return d.entry(as_id(id)).length; })
      .def("offset", [](const StoreDirectory& d, py::handle id) { return d.entry(as_id(id)).offset; })
      .def("labels", [](const StoreDirectory& d) { return directory_column(d.entries(), &store::Entry::label); })
      .def("lengths", [](const StoreDirectory& d) { return directory_column(d.entries(), &store::Entry::length); })
      .def("disk_order", [](const StoreDirectory& d) { return id_order_array(d.disk_order()); })
      .def_property_readonly("meta", [](const StoreDirectory& d) { return as_bytes(d.meta()); })
      .def_property_readonly("name", &StoreDirectory::name)
      .def_property_readonly("version", [](const StoreDirectory& d) { return d.header().version; })
      .def_property_readonly("placement",
                             [](const StoreDirectory& d) {
                               return d.header().placement == store::kShuffled ? "shuffled" : "as written";
                             })
      .def_property_readonly("placement_seed", [](const StoreDirectory& d) { return d.header().placement_seed; })
      .def_property_readonly("data_bytes", [](const StoreDirectory& d) { return d.header().data_bytes; })
      .def_property_readonly("dir_offset", [](const StoreDirectory& d) { return d.header().dir_offset; })
      .def_property_readonly("dir_crc", [](const StoreDirectory& d) { return d.header().dir_crc; })
      .def_property_readonly("file_bytes", [](const StoreDirectory& d) { return d.header().file_bytes; })
      .def(
          "batch",
          [](py::object self, const py::handle& ids_obj, uint64_t gap_bytes, uint64_t max_extent_bytes,
             bool verify) {
            const StoreDirectory& d = self.cast<const StoreDirectory&>();
            IdArray ids = integer_ids(ids_obj);
            size_t n = static_cast<size_t>(ids.size());
            auto pb = std::make_unique<PyFetchedBatch>();
            pb->dir_ref = self;
            pb->out.resize(n);
            std::vector<int64_t> idv(ids.data(), ids.data() + n);
            std::vector<char*> dests(n);
            for (size_t k = 0; k < n; ++k) {  // range-check everything before any fetch
              const store::Entry& e = d.entry(idv[k]);
              PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(e.length));
              if (b == nullptr) throw py::error_already_set();
              pb->out[k] = py::reinterpret_steal<py::object>(b);
              dests[k] = PyBytes_AS_STRING(b);
            }
            pb->batch = std::make_unique<FetchedBatch>(d, std::move(idv), std::move(dests), verify,
                                                       ReadShape{gap_bytes, max_extent_bytes});
            return pb;
          },
          py::arg("ids"), py::arg("gap_bytes"), py::arg("max_extent_bytes"), py::arg("verify") = true,
          "A FetchedBatch of `ids`: the ranges to fetch (neighbours at most gap_bytes apart in one "
          "range of at most max_extent_bytes) and where their bytes go.");

  py::class_<PyFetchedBatch>(m, "FetchedBatch")
      .def("__len__", [](PyFetchedBatch& pb) { return pb.b().ranges(); })
      .def(
          "ranges",
          [](PyFetchedBatch& pb) {
            FetchedBatch& b = pb.b();
            py::array_t<uint64_t> a({static_cast<py::ssize_t>(b.ranges()), py::ssize_t{2}});
            auto w = a.mutable_unchecked<2>();
            for (size_t x = 0; x < b.ranges(); ++x) {
              w(x, 0) = b.range(x).offset;
              w(x, 1) = b.range(x).len;
            }
            return a;
          },
          "(offset, length) of each range to fetch, by offset: an array of shape (ranges, 2).")
      .def(
          "view",
          [](PyFetchedBatch& pb, size_t x) {
            FetchedBatch& b = pb.b();
            if (x >= b.ranges()) throw Error(ErrorKind::kOutOfRange, "range " + std::to_string(x) + " of " + std::to_string(b.ranges()));
            const RangeRead& r = b.range(x);
            return py::memoryview::from_memory(r.dest, static_cast<py::ssize_t>(r.len), /*readonly=*/false);
          },
          py::arg("x"), "Where range x's bytes go (writable; valid until finish()).")
      .def(
          "intact",
          [](PyFetchedBatch& pb, size_t x) {
            FetchedBatch& b = pb.b();
            if (x >= b.ranges()) throw Error(ErrorKind::kOutOfRange, "range " + std::to_string(x));
            py::gil_scoped_release nogil;
            return b.intact(x);
          },
          py::arg("x"), "Whether every sample of range x, as fetched, matches its checksum.")
      .def(
          "land",
          [](PyFetchedBatch& pb, size_t x) {
            FetchedBatch& b = pb.b();
            if (x >= b.ranges()) throw Error(ErrorKind::kOutOfRange, "range " + std::to_string(x));
            py::gil_scoped_release nogil;
            b.land(x);
          },
          py::arg("x"), "Range x is in: its samples are copied out and checked (once per range).")
      .def_property_readonly("range_bytes", [](PyFetchedBatch& pb) { return pb.b().range_bytes(); })
      .def(
          "finish",
          [](PyFetchedBatch& pb, const std::string& name) {
            FetchedBatch& b = pb.b();
            b.finish(name);  // CorruptSampleError naming the object, the id and its offset
            pb.finished = true;
            py::list list(pb.out.size());
            for (size_t k = 0; k < pb.out.size(); ++k) PyList_SET_ITEM(list.ptr(), k, pb.out[k].release().ptr());
            pb.out.clear();
            return list;
          },
          py::arg("name"),
          "The bytes of every id, in order, once every range has landed; CorruptSampleError naming "
          "`name` when a sample did not match its checksum.");
}

}  // namespace shadecache
