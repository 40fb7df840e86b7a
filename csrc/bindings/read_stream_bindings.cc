// shadecache._io.ReadStream: the bindings of csrc/io/read_stream.h, and memory_fence().
//
// GIL contract: as packed_read_many (io_module.cc), the bytes objects of a batch are made with the
// GIL held at submit() (their sizes are in the directory) and filled by the stream's lanes without
// it; they stay private to the stream (held in `pending`, never handed out) until take() returns
// them. take() waits with the GIL released. Dropping the stream joins its lanes before the bytes
// objects of batches still in flight are freed (close() runs first in the destructor).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <deque>
#include <memory>
#include <vector>

#include "bindings/convert.h"
#include "bindings/ids.h"
#include "common/error.h"
#include "io/packed_reader.h"
#include "io/read_stream.h"

namespace py = pybind11;
using namespace shadecache;

namespace {

struct PyReadStream {
  std::shared_ptr<ReadStream> stream;  // shared: take() keeps it alive while close() runs
  std::deque<py::list> pending;  // the bytes of each batch not yet taken, in submission order

  // In a forked child the stream is leaked (see ReadStream::in_owner_process).
  bool leak_if_forked() {
    if (!stream || stream->in_owner_process()) return false;
    new std::shared_ptr<ReadStream>(std::move(stream));
    return true;
  }

  ~PyReadStream() {
    if (leak_if_forked()) return;
    if (stream) stream->close();  // lanes joined: nothing writes into `pending` any more
  }

  ReadStream& s() {
    if (!stream) throw Error(ErrorKind::kClosed, "the read stream is closed");
    return *stream;
  }

  uint64_t submit(PackedReader& reader, const py::handle& ids_obj) {
    ReadStream& st = s();
    IdArray ids = integer_ids(ids_obj);
    const int64_t* p = ids.data();
    size_t n = static_cast<size_t>(ids.size());
    py::list out(n);
    std::vector<char*> dests(n);
    for (size_t k = 0; k < n; ++k) {  // range-check everything before any I/O
      const store::Entry& e = reader.entry(p[k]);
      PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(e.length));
      if (b == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), k, b);
      dests[k] = PyBytes_AS_STRING(b);
    }
    uint64_t t = st.submit(std::vector<int64_t>(p, p + n), std::move(dests));
    pending.push_back(std::move(out));
    return t;
  }

  py::list take() {
    std::shared_ptr<ReadStream> keep = stream;
    ReadStream& st = s();
    if (pending.empty()) throw Error(ErrorKind::kInvalidArgument, "take: no batch is pending");
    std::exception_ptr err;
    {
      py::gil_scoped_release nogil;
      try {
        st.take();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (pending.empty()) throw Error(ErrorKind::kClosed, "the read stream is closed");
    py::list out = std::move(pending.front());
    pending.pop_front();
    if (err) std::rethrow_exception(err);
    return out;
  }

  void close() {
    if (leak_if_forked()) {
      pending.clear();
      return;
    }
    if (!stream) return;
    {
      py::gil_scoped_release nogil;
      stream->close();
    }
    stream.reset();
    pending.clear();
  }
};

}  // namespace

void register_read_stream(py::module_& m) {
  m.def(
      "memory_fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); },
      "A full hardware memory fence (the order board's seqlock, shadecache/lookahead/board.py).");
  m.def(
      "atomic_add",
      [](py::handle buf, int64_t index, int64_t value) {
        // Counters that several processes add to in shared memory (the order board's per-epoch
        // reader rows): one locked read-modify-write, so no add is lost between processes.
        WritableBuffer view(buf, 0, "atomic_add needs a writable buffer");
        if (index < 0 || static_cast<uint64_t>(index + 1) * 8 > view.size())
          throw py::index_error("atomic_add: int64 index " + std::to_string(index) + " outside a buffer of " +
                                std::to_string(view.size()) + " bytes");
        auto* p = reinterpret_cast<int64_t*>(view.data()) + index;
        if (reinterpret_cast<uintptr_t>(p) % 8) throw py::value_error("atomic_add: the int64 is not 8-byte aligned");
        return __atomic_add_fetch(p, value, __ATOMIC_RELAXED);
      },
      py::arg("buffer"), py::arg("index"), py::arg("value"),
      "Adds `value` to int64 number `index` of a writable buffer atomically; returns the sum.");

  py::class_<PyReadStream>(m, "ReadStream")
      .def(py::init([](PackedReader& reader, const std::string& backend, unsigned queue_depth,
                       unsigned lanes, const std::string& submission) {
             auto w = std::make_unique<PyReadStream>();
             BackendKind kind = parse_backend_kind(backend);
             ReadStream::Submission mode = ReadStream::parse_submission(submission);
             {
               py::gil_scoped_release nogil;
               w->stream = std::make_unique<ReadStream>(reader, kind, queue_depth, lanes, mode);
             }
             return w;
           }),
           py::arg("reader"), py::arg("backend") = "auto", py::arg("queue_depth") = 32,
           py::arg("lanes") = 2, py::arg("submission") = "single", py::keep_alive<1, 2>())
      .def(
          "submit",
          [](PyReadStream& w, PackedReader& reader, const py::handle& ids) {
            return w.submit(reader, ids);
          },
          py::arg("reader"), py::arg("ids"),
          "Queues a batch of ids of `reader` (the stream's own store); returns its ticket.")
      .def("take", &PyReadStream::take,
           "The bytes of the oldest pending batch, in its id order (waits without the GIL).")
      .def_property_readonly("pending", [](PyReadStream& w) { return w.pending.size(); })
      .def_property_readonly("lanes", [](PyReadStream& w) { return w.s().lanes(); })
      .def_property_readonly("lane_depth", [](PyReadStream& w) { return w.s().lane_depth(); })
      .def_property_readonly("submission", [](PyReadStream& w) { return w.s().submission_mode(); },
                             "The submission mode the lanes run now: 'spread' or 'single'.")
      .def_property_readonly("mode_switches", [](PyReadStream& w) { return w.s().mode_switches(); })
      .def_property_readonly("mode_rates", [](PyReadStream& w) { return w.s().mode_rates(); },
                             "auto's moving averages of samples per busy second, [spread, single]"
                             " (0: not measured yet).")
      .def_property_readonly("lane_batches", [](PyReadStream& w) { return w.s().lane_batches(); },
                             "The batches each lane has run.")
      .def_property_readonly("single_calls", [](PyReadStream& w) { return w.s().single_calls(); },
                             "Backend calls lane 0 made in the single mode (each one runs every "
                             "batch queued while its reads ran).")
      .def_property_readonly("backend", [](PyReadStream& w) { return w.s().backend_name(); })
      .def_property_readonly("fallback_reason",
                             [](PyReadStream& w) { return w.s().fallback_reason(); })
      .def_property_readonly("closed", [](PyReadStream& w) { return !w.stream; })
      .def("close", &PyReadStream::close);
}
