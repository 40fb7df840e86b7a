// shadecache._core.PinnedReply and recv_get_reply: the peer protocol's GET reply, built and read
// a batch at a time in C++, so that neither end does per-sample work in Python.
//
// Server (PinnedReply): pins the values of a chunk of ids in the cache (Cache::pin: no writer
// frees, rewrites or moves them until release), takes the bytes of the misses the Python side
// filled from the SSD tier or the store, then without the GIL sends header + entry table + values
// with sendmsg straight from shared memory (no copy). A cached value travels with the crc32c the
// cache recorded when it was put (CachedDataset puts bytes it has just checked against the store's
// directory, so this is the store's checksum of the sample), not one computed from the bytes
// now: a value damaged in shared memory since is caught by the client. Values filled from the SSD
// tier or the store (each checked against its own crc32c when read) get theirs computed here.
// Client (recv_get_reply): without the GIL reads the header and entry table, checks them against
// the request, then (GIL taken once to allocate the result bytes objects) reads the values
// straight into those objects and verifies every crc32c, without the GIL again. A value that
// fails its crc32c is refused (None: the caller reads it from the next tier) and counted; the
// stream stays in step (the lengths framed it). The objects are private to this call until it
// returns, as in os.read().
//
// Errors are returned as (code, detail) rather than raised, so that shadecache/peer/client.py
// keeps the one mapping to its exceptions: 0 ok, 1 timeout, 2 peer closed, 3 OS error (errno),
// 4 protocol error (message), 5 the peer's ERROR reply ((status, message)).
#include "bindings/peer_io.h"

#include <pybind11/numpy.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "common/crc32c.h"
#include "common/error.h"
#include "net/peer_wire.h"
#include "net/socket_io.h"

namespace py = pybind11;

namespace shadecache {
namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

int64_t deadline_after(double seconds) {
  if (!(seconds > 0)) seconds = 0;
  return net::now_ns() + static_cast<int64_t>(std::min(seconds, 1e6) * 1e9);
}

py::tuple io_failure(int r) {
  if (r == net::kTimeout) return py::make_tuple(1, py::none());
  if (r == net::kEof) return py::make_tuple(2, py::none());
  return py::make_tuple(3, errno);
}

class PinnedReply {
 public:
  PinnedReply(py::object core, const U64Array& ids, uint64_t max_bytes)
      : owner_(core), cache_(&core.cast<Cache&>()), pid_(getpid()) {
    cache_->check_open();
    size_t n = static_cast<size_t>(ids.size());
    const uint64_t* p = ids.data();
    slots_.reserve(n);
    uint64_t bytes = 0;
    try {
      for (size_t k = 0; k < n && bytes < max_bytes; ++k) {
        cache_->check_id(p[k]);
        Slot s{p[k], nullptr, net::kMiss, 0, 0, false, py::object()};
        Cache::Pinned pin;
        if (cache_->pin(p[k], &pin)) {
          s = Slot{p[k], pin.data, pin.len, pin.crc, pin.token, true, py::object()};
          bytes += pin.len;
        }
        slots_.push_back(std::move(s));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~PinnedReply() { release(); }

  size_t count() const { return slots_.size(); }
  py::list missed() const {
    py::list out;
    for (size_t k = 0; k < slots_.size(); ++k)
      if (!slots_[k].pinned && !slots_[k].held) out.append(k);
    return out;
  }
  void fill(size_t k, py::bytes value) {
    if (k >= slots_.size() || slots_[k].pinned) throw py::index_error("fill: no missed entry " + std::to_string(k));
    Py_ssize_t len = PyBytes_GET_SIZE(value.ptr());
    if (static_cast<uint64_t>(len) > net::kMaxValue) throw Error(ErrorKind::kTooLarge, "value larger than the wire's bound");
    slots_[k].data = PyBytes_AS_STRING(value.ptr());
    slots_[k].len = static_cast<uint32_t>(len);
    slots_[k].held = value;
  }

  // (code, detail); detail = bytes of values sent when code is 0.
  py::tuple send(int fd, uint64_t opaque, bool more, double timeout) {
    if (released_) throw Error(ErrorKind::kInvalidArgument, "send after release");
    size_t n = slots_.size();
    std::vector<net::Entry> table(n);
    std::vector<iovec> iov;
    iov.reserve(n + 2);
    net::Header head;
    uint64_t total = 0;
    int r;
    {
      py::gil_scoped_release nogil;
      for (size_t k = 0; k < n; ++k) {
        const Slot& s = slots_[k];
        bool hit = s.pinned || s.held;
        uint32_t crc = s.pinned ? s.crc : s.held ? crc32c(s.data, s.len, 0) : 0;
        table[k] = net::Entry{s.id, hit ? s.len : net::kMiss, crc};
        if (hit && s.len) iov.push_back(iovec{const_cast<char*>(s.data), s.len});
        if (hit) total += s.len;
      }
      head = net::make_header(net::kGetReply, static_cast<uint32_t>(n),
                              static_cast<uint32_t>(n * sizeof(net::Entry) + total), opaque, more ? net::kMore : 0);
      iov.insert(iov.begin(), {iovec{&head, sizeof head}, iovec{table.data(), n * sizeof(net::Entry)}});
      r = net::send_all(fd, iov.data(), iov.size(), deadline_after(timeout));
    }
    if (r != net::kOk) return io_failure(r);
    return py::make_tuple(0, total);
  }

  void release() {
    if (released_) return;
    released_ = true;
    for (Slot& s : slots_)
      if (s.pinned) cache_->unpin(s.token, pid_);
  }

 private:
  struct Slot {
    uint64_t id;
    const char* data;
    uint32_t len;
    uint32_t crc;     // pinned: the crc32c the cache recorded at put
    uint32_t token;
    bool pinned;
    py::object held;  // the bytes a miss was filled with (kept alive while we send from it)
  };
  py::object owner_;  // the CacheCore: keeps the mapping alive while pins exist
  Cache* cache_;
  int64_t pid_;
  std::vector<Slot> slots_;
  bool released_ = false;
};

py::tuple protocol(const std::string& why) { return py::make_tuple(4, why); }

py::tuple recv_get_reply(int fd, const U64Array& ids_arr, uint64_t opaque, double timeout) {
  const uint64_t* ids = ids_arr.data();
  size_t n = static_cast<size_t>(ids_arr.size());
  int64_t deadline = deadline_after(timeout);
  py::list out(n);
  for (size_t k = 0; k < n; ++k) PyList_SET_ITEM(out.ptr(), k, Py_NewRef(Py_None));
  size_t got = 0, refused = 0;
  for (;;) {
    net::Header h;
    std::vector<net::Entry> table;
    int r;
    {
      py::gil_scoped_release nogil;
      r = net::recv_exact(fd, &h, sizeof h, deadline);
    }
    if (r != net::kOk) return io_failure(r);
    if (std::memcmp(h.magic, "SHCP", 4) != 0) return protocol("bad magic in reply");
    if (h.version != net::kVersion) return protocol("reply of protocol version " + std::to_string(h.version));
    if (h.opcode == net::kError) {
      if (h.body_len > net::kMaxError) return protocol("ERROR reply body too large");
      std::string msg(h.body_len, '\0');
      {
        py::gil_scoped_release nogil;
        r = net::recv_exact(fd, msg.data(), msg.size(), deadline);
      }
      if (r != net::kOk) return io_failure(r);
      return py::make_tuple(5, py::make_tuple(h.status, py::bytes(msg)));
    }
    if (h.opcode != net::kGetReply || h.opaque != opaque)
      return protocol("reply opcode " + std::to_string(h.opcode) + " opaque " + std::to_string(h.opaque) +
                      " does not answer GET " + std::to_string(opaque));
    uint64_t table_len = uint64_t{h.count} * sizeof(net::Entry);
    if (h.count > net::kMaxBatch || got + h.count > n || h.body_len > net::kMaxReply || h.body_len < table_len)
      return protocol("malformed GET reply");
    table.resize(h.count);
    {
      py::gil_scoped_release nogil;
      r = net::recv_exact(fd, table.data(), table_len, deadline);
    }
    if (r != net::kOk) return io_failure(r);
    uint64_t sum = 0;
    for (uint32_t k = 0; k < h.count; ++k) {
      if (table[k].id != ids[got + k]) return protocol("reply ids do not match the request");
      if (table[k].length == net::kMiss) continue;
      if (table[k].length > net::kMaxValue) return protocol("reply value exceeds the bound");
      sum += table[k].length;
    }
    if (sum + table_len != h.body_len) return protocol("reply lengths do not add up");
    std::vector<iovec> iov;
    std::vector<char*> dest(h.count, nullptr);
    for (uint32_t k = 0; k < h.count; ++k) {
      if (table[k].length == net::kMiss) continue;
      PyObject* b = PyBytes_FromStringAndSize(nullptr, table[k].length);
      if (!b) throw py::error_already_set();
      PyList_SetItem(out.ptr(), got + k, b);  // steals b; drops the None
      dest[k] = PyBytes_AS_STRING(b);
      if (table[k].length) iov.push_back(iovec{dest[k], table[k].length});
    }
    std::vector<uint32_t> bad;
    {
      py::gil_scoped_release nogil;
      r = net::recv_all(fd, iov.data(), iov.size(), deadline);
      for (uint32_t k = 0; r == net::kOk && k < h.count; ++k)
        if (dest[k] && crc32c(dest[k], table[k].length, 0) != table[k].crc) bad.push_back(k);
    }
    if (r != net::kOk) return io_failure(r);
    for (uint32_t k : bad) PyList_SetItem(out.ptr(), got + k, Py_NewRef(Py_None));  // refused
    refused += bad.size();
    got += h.count;
    if (!(h.status & net::kMore)) break;
  }
  if (got != n) return protocol("reply has " + std::to_string(got) + " of " + std::to_string(n) + " entries");
  return py::make_tuple(0, py::make_tuple(out, refused));
}

}  // namespace

void register_peer_io(py::module_& m) {
  py::class_<PinnedReply>(m, "PinnedReply")
      .def(py::init<py::object, const U64Array&, uint64_t>(), py::arg("core"), py::arg("ids"),
           py::arg("max_bytes"),
           "Pins the values of ids (in order, stopping once max_bytes are pinned): .count ids covered")
      .def_property_readonly("count", &PinnedReply::count)
      .def("missed", &PinnedReply::missed, "positions (of the ids covered) the cache did not hold")
      .def("fill", &PinnedReply::fill, py::arg("position"), py::arg("value"))
      .def("send", &PinnedReply::send, py::arg("fd"), py::arg("opaque"), py::arg("more"), py::arg("timeout"))
      .def("release", &PinnedReply::release);
  m.def("recv_get_reply", &recv_get_reply, py::arg("fd"), py::arg("ids"), py::arg("opaque"), py::arg("timeout"),
        "(code, detail) of the reply to a GET of ids; see bindings/peer_io.cc");
}

}  // namespace shadecache
