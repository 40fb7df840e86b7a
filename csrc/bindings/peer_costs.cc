// What a sealed GET costs at the least on this machine, for bench/cluster.py, which sets these
// beside the peer GET and a clear-text stream of the same bytes in the same run:
//   peer_frame_costs:   the per-byte parts a sealed reply adds (seal, open, crc32c), each alone;
//   peer_frame_stream:  the frames alone over a real loopback TCP connection, with nothing else.
// Neither touches a cache or the peer protocol's state; both release the GIL.
#include "bindings/peer_costs.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pybind11/stl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bindings/peer_io.h"
#include "common/crc32c.h"
#include "common/error.h"
#include "net/aead.h"
#include "net/socket_io.h"

namespace py = pybind11;

namespace shadecache {
namespace {

using net::Aead;
constexpr size_t kTag = Aead::kTagBytes;

double thread_cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

void fill_key(uint8_t* key) {
  for (size_t k = 0; k < Aead::kKeyBytes; ++k) key[k] = static_cast<uint8_t>(k + 1);
}

// The bytes both helpers seal: (k * 131 + k / 512) mod 256 at offset k (not all alike, so that a
// shifted or unopened byte shows; tests compute the same pattern).
template <class T>
void fill_source(std::vector<T>* src) {
  for (size_t k = 0; k < src->size(); ++k) (*src)[k] = static_cast<T>(k * 131 + (k >> 9));
}

// Seconds for one pass over `total` bytes in values of `value` bytes of sealing (as the server
// seals a message, value by value into one record), opening in place (as the client opens it),
// crc32c per value (as the client checks them) and memcpy; each the best of `repeats`.
py::dict frame_costs(size_t total, size_t value, int repeats) {
  if (total == 0 || value == 0 || repeats < 1) throw Error(ErrorKind::kInvalidArgument, "frame_costs wants sizes > 0");
  std::vector<uint8_t> src(total), dst(total), tag(kTag);
  fill_source(&src);
  uint8_t key[Aead::kKeyBytes];
  fill_key(key);
  Aead tx(key, true), rx(key, false);
  double seal = 1e9, open = 1e9, crc = 1e9, copy = 1e9;
  volatile uint32_t sink = 0;
  bool ok = true;
  {
    py::gil_scoped_release nogil;
    auto timed = [](double* best, auto&& fn) {
      int64_t t0 = net::now_ns();
      fn();
      *best = std::min(*best, (net::now_ns() - t0) * 1e-9);
    };
    for (int r = 0; r < repeats; ++r) {
      timed(&seal, [&] {
        ok &= tx.begin(nullptr, 0);
        for (size_t off = 0; off < total; off += value) ok &= tx.update(&src[off], &dst[off], std::min(value, total - off));
        ok &= tx.seal_end(tag.data());
      });
      timed(&open, [&] {
        ok &= rx.begin(nullptr, 0);
        for (size_t off = 0; off < total; off += value) ok &= rx.update(&dst[off], &dst[off], std::min(value, total - off));
        ok &= rx.open_end(tag.data());
      });
      timed(&crc, [&] {
        for (size_t off = 0; off < total; off += value) sink = sink + crc32c(&dst[off], std::min(value, total - off), 0);
      });
      timed(&copy, [&] { std::memcpy(dst.data(), src.data(), total); });
    }
  }
  if (!ok) throw Error(ErrorKind::kInvalidArgument, "a record failed to seal or open");
  py::dict d;
  d["seal"] = seal;
  d["open"] = open;
  d["crc32c"] = crc;
  d["memcpy"] = copy;
  return d;
}

// A connected loopback TCP pair (TCP_NODELAY both ends), closed on destruction.
struct LoopbackPair {
  int client = -1, server = -1;
  LoopbackPair() {
    int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    bool ok = lfd >= 0 && ::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(lfd, 1) == 0 &&
              ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    if (ok) client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ok = ok && client >= 0 && ::connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (ok) server = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    int saved = errno;
    if (lfd >= 0) ::close(lfd);
    if (!ok || server < 0) {
      if (client >= 0) ::close(client);
      throw Error(ErrorKind::kOs, std::string("loopback pair: ") + std::strerror(saved), saved);
    }
    int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~LoopbackPair() {
    if (client >= 0) ::close(client);
    if (server >= 0) ::close(server);
    client = server = -1;
  }
};

// The sealed frames of a GET reply with nothing else, over a real loopback TCP connection: a
// thread here plays the server (per request it seals `total` bytes of values of `value` bytes,
// from one buffer, as records cut as the peer server cuts its messages, each sealed whole and
// then sent) and the calling thread the client (sends an 8-byte request, receives each record
// whole into one buffer, opens it in place and crc32c's every value). No Python, no cache or
// pins, no entry table, no allocation per value: what a sealed GET's frames cost when nothing
// else does. sealed=false: the same bytes in clear and nothing else (a native stream). Runs for
// `seconds`: {"seconds": per transfer, "cpu": both threads' CPU seconds per transfer,
// "transfers": how many, "crc32c": the XOR of every value's crc32c in the last transfer (the
// source's byte at offset k is (k * 131 + k / 512) mod 256), so that a caller can check what
// arrived}.
py::dict frame_stream(size_t total, size_t value, double seconds, bool sealed) {
  if (total == 0 || value == 0 || total > (1u << 30))
    throw Error(ErrorKind::kInvalidArgument, "frame_stream wants 0 < value, 0 < total <= 1 GiB");
  if (!(seconds >= 0 && seconds <= 3600))
    throw Error(ErrorKind::kInvalidArgument, "frame_stream wants 0 <= seconds <= 3600");
  // Records of whole values, as the server cuts its messages (one larger value goes alone).
  std::vector<size_t> records;
  for (size_t off = 0, in = 0, items = 0; off < total; off += std::min(value, total - off)) {
    size_t len = std::min(value, total - off);
    if (items && (in + len > kReplyMessageBytes || items == kReplyMessageItems)) {
      records.push_back(in);
      in = items = 0;
    }
    in += len;
    ++items;
    if (off + len == total) records.push_back(in);
  }
  // Everything is allocated before the server thread starts: nothing below throws while it runs.
  uint8_t key[Aead::kKeyBytes];
  fill_key(key);
  Aead tx(key, true), rx(key, false);
  std::vector<char> src(total), out(std::min(total, kReplyMessageBytes + value) + kTag), in(total + kTag);
  fill_source(&src);
  LoopbackPair pair;
  // Every wait ends: a peer out of step fails the call instead of hanging it.
  const int64_t deadline = net::now_ns() + static_cast<int64_t>((seconds + 30) * 1e9);
  double server_cpu = 0, wall = 0, client_cpu = 0;
  int server_failed = 0, failed = 0;  // 1: a record failed to seal or open; 2: the socket failed
  long transfers = 0;
  uint32_t crc = 0;
  auto checksum = [value](const char* p, size_t n, uint32_t* acc) {  // XOR of the values' crc32c
    for (size_t k = 0; k < n; k += value) *acc ^= crc32c(p + k, std::min(value, n - k), 0);
  };
  {
    py::gil_scoped_release nogil;
    std::thread server([&]() noexcept {
      double c0 = thread_cpu_s();
      for (;;) {
        uint64_t ask = 0;
        if (net::recv_exact(pair.server, &ask, sizeof ask, deadline) != net::kOk || ask == 0) break;
        size_t off = 0;
        for (size_t rec : records) {
          iovec v{src.data() + off, rec};
          if (sealed) {
            bool ok = tx.begin(nullptr, 0);
            for (size_t k = 0; ok && k < rec; k += value)
              ok = tx.update(src.data() + off + k, out.data() + k, std::min(value, rec - k));
            ok = ok && tx.seal_end(reinterpret_cast<uint8_t*>(out.data() + rec));
            v = iovec{out.data(), rec + kTag};
            if (!ok) server_failed = 1;
          }
          if (!server_failed && net::send_all(pair.server, &v, 1, deadline) != net::kOk) server_failed = 2;
          if (server_failed) break;
          off += rec;
        }
        if (server_failed) break;
      }
      server_cpu = thread_cpu_s() - c0;
      ::shutdown(pair.server, SHUT_WR);
    });
    int64_t t0 = net::now_ns(), until = t0 + static_cast<int64_t>(seconds * 1e9);
    double c0 = thread_cpu_s();
    do {
      uint64_t ask = total;
      iovec q{&ask, sizeof ask};
      if (net::send_all(pair.client, &q, 1, deadline) != net::kOk) failed = 2;
      crc = 0;
      for (size_t r = 0, off = 0; !failed && r < records.size(); off += records[r++]) {
        char* p = in.data() + off;  // the record's tag lands where the next record's bytes go
        iovec v{p, records[r] + (sealed ? kTag : 0)};
        if (net::recv_all_whole(pair.client, &v, 1, deadline) != net::kOk) {
          failed = 2;
          break;
        }
        if (!sealed) continue;
        bool ok = rx.begin(nullptr, 0);
        for (size_t k = 0; ok && k < records[r]; k += value) ok = rx.update(p + k, p + k, std::min(value, records[r] - k));
        checksum(p, records[r], &crc);  // as the GET's client does, before the tag is checked
        if (!(ok && rx.open_end(reinterpret_cast<const uint8_t*>(p + records[r])))) failed = 1;
      }
      ++transfers;
    } while (!failed && net::now_ns() < until);
    wall = (net::now_ns() - t0) * 1e-9;
    client_cpu = thread_cpu_s() - c0;
    if (failed) {
      // Closed with bytes unread, the socket resets the connection: a server blocked sending fails.
      ::close(pair.client);
      pair.client = -1;
    } else {
      uint64_t stop = 0;
      iovec q{&stop, sizeof stop};
      net::send_all(pair.client, &q, 1, deadline);
    }
    server.join();
    if (!failed && !sealed) checksum(in.data(), total, &crc);  // not timed: the stream checks nothing
  }
  if (failed == 1 || server_failed == 1) throw Error(ErrorKind::kInvalidArgument, "a record failed to seal or open");
  if (failed || server_failed)
    throw Error(ErrorKind::kOs, "the loopback frame stream failed (a socket error, or an end out of step)");
  py::dict d;
  d["seconds"] = wall / transfers;
  d["cpu"] = (client_cpu + server_cpu) / transfers;
  d["transfers"] = transfers;
  d["crc32c"] = crc;
  return d;
}

}  // namespace

void register_peer_costs(py::module_& m) {
  m.def("peer_frame_costs", &frame_costs, py::arg("total"), py::arg("value"), py::arg("repeats") = 20,
        "seconds of one pass of sealing, opening, crc32c and memcpy over `total` bytes in values of `value`");
  m.def("peer_frame_stream", &frame_stream, py::arg("total"), py::arg("value"), py::arg("seconds"),
        py::arg("sealed") = true,
        "a GET reply's sealed frames alone over loopback TCP, for `seconds`: {seconds, cpu, transfers, crc32c}");
}

}  // namespace shadecache
