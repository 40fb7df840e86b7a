// shadecache._core.PeerSession: the frames of one authenticated peer connection, sealed and opened
// in C++ with the session's keys (net/aead.h: AES-256-GCM, a sequence number per direction), so
// that neither end does per-byte or per-sample work in Python.
//
// Every message after the handshake is a 24-byte header in clear text, authenticated as the
// additional data of the record that follows it, then the sealed body (ciphertext || 16-byte tag).
// A GET reply chunk has two records: the entry table, then the values. The table is opened (its
// tag checked) before a byte is allocated for the values it announces, and no value is handed out
// before the values' tag AND its own crc32c (the store's checksum, carried end to end) check out.
//
// Server (seal_get_reply, then flush): answers a chunk of a GET as GET_REPLY messages of at most
// kReplyMessageItems ids (peer_io.h). For each message it takes pins from the process's pin pool
// (waiting at most `pin_wait`), pins the message's cached values in one batch (Cache::pin_many: no writer frees,
// rewrites or moves them until unpinned), takes the bytes of the misses the Python side filled
// from the SSD tier or the store, cuts at the byte bounds (filled values included), then, without
// the GIL, seals the table and the values straight from shared memory into the connection's
// buffer, releases the message's pins together once it is sealed, and hands the kernel the whole
// message (never waiting for it). Whole messages, not pieces as they are sealed: on loopback each
// send wakes the client and contends with its receive for the socket: replies handed over in
// 128 KiB pieces took longer, of small and of 100 KB values (docs/benchmark_history.md, "The
// sealed frames alone: the bound of a 3 KB peer GET"). Only a message longer
// than the client's window (a large value) goes a window at a time (kHandOver). Only when every
// pin is released does flush() wait for the client to take the rest, under the send deadline: a
// slow client holds its own buffer, nothing another client needs.
// A cached value travels with the crc32c the cache recorded when it was put (CachedDataset puts
// bytes it has just checked against the store's directory, so this is the store's checksum): a
// value damaged in shared memory since is caught by the client. Filled values (each checked
// against its own crc32c when read) get theirs computed here.
// Client (recv_get_reply): reads and opens each chunk's header and table, checks them against the
// request, allocates the result bytes (the only GIL hold), then receives the values straight into
// them, decrypting in place piece by piece as they arrive, checks the tag, then every crc32c. A
// value that fails its crc32c is refused (None: the caller reads it from the next tier) and
// counted; a tag that fails drops the whole reply and the connection.
//
// Errors are returned as (code, detail) rather than raised, so that shadecache/peer keeps the one
// mapping to its exceptions: 0 ok, 1 timeout, 2 peer closed, 3 OS error (errno), 4 protocol error
// ((ERROR status to send, message)), 5 the peer's ERROR message ((status, message)), 6 a record
// failed its authentication tag (altered, forged, replayed or out of order on the way).
// After any result but 0 that direction of the session is broken: its stream is out of step and
// every later call in that direction returns 4 without touching the socket (the other direction
// still works: a server answers a malformed request with a sealed ERROR); the caller closes the
// connection.
// A session is used only by the process that made it: every call in another process (a forked
// child holding a copy) raises before it touches a key, a sequence number or the socket. Two
// processes sealing under one session would put two records under one key and nonce (the XOR of
// their ciphertexts is the XOR of their plaintexts); the child connects again instead.
#include "bindings/peer_io.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "common/crc32c.h"
#include "common/error.h"
#include "net/aead.h"
#include "net/peer_wire.h"
#include "net/session_keys.h"
#include "net/socket_io.h"

namespace py = pybind11;

namespace shadecache {
namespace {

using net::Aead;
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

constexpr size_t kTag = Aead::kTagBytes;
constexpr size_t kHead = sizeof(net::Header);
// The client decrypts and checksums a large value in pieces of this many bytes, each while it is
// still in cache after its window arrived.
constexpr size_t kPiece = 128 << 10;
// The client receives a reply message's values in windows of this many bytes, each waited for
// whole (net::recv_all_whole: one wake-up, not one per segment), then opened and checksummed.
constexpr size_t kWindow = 1 << 20;
// A message longer than this (a large value) is handed to the kernel in pieces of this size as
// they are sealed, a window at a time, so that the client opens one while the next is sealed
// (16 MiB values took longer when each went only once sealed whole: the two ends did not
// overlap; docs/benchmark_history.md, "The sealed frames alone: the bound of a 3 KB peer GET");
// shorter messages go whole.
constexpr size_t kHandOver = kWindow;
// The largest body send_message seals (GET ids, STATS and ERROR texts): requests are small.
constexpr size_t kMaxMessage = 1 << 20;

int64_t deadline_after(double seconds) {
  if (!(seconds > 0)) seconds = 0;
  return net::now_ns() + static_cast<int64_t>(std::min(seconds, 1e6) * 1e9);
}

py::tuple io_failure(int r) {
  if (r == net::kTimeout) return py::make_tuple(1, py::none());
  if (r == net::kEof) return py::make_tuple(2, py::none());
  return py::make_tuple(3, errno);
}

py::tuple protocol(uint16_t code, const std::string& why) { return py::make_tuple(4, py::make_tuple(code, why)); }
py::tuple forged() { return py::make_tuple(6, py::none()); }

const uint8_t* key_of(const py::bytes& key) {
  if (PyBytes_GET_SIZE(key.ptr()) != static_cast<Py_ssize_t>(Aead::kKeyBytes))
    throw Error(ErrorKind::kInvalidArgument, "a session key is 32 bytes");
  return reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(key.ptr()));
}

// Pins the server's connections hold at once, all together, kept below the engine's per-process
// limit so that Cache::pin never fails for lack of entries. A connection takes what one chunk
// needs, holds it while it encrypts that chunk (CPU work, never a wait on a client) and waits at
// most its pin_wait for it.
class PinPool {
 public:
  bool acquire(uint32_t n, int64_t deadline_ns) {
    std::unique_lock<std::mutex> lock(mu_);
    auto until = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline_ns));
    while (free_ < n) {
      if (cv_.wait_until(lock, until) == std::cv_status::timeout && free_ < n) return false;
    }
    free_ -= n;
    return true;
  }
  void release(uint32_t n) {
    if (!n) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_ += n;
    }
    cv_.notify_all();
  }
  static constexpr uint32_t kCapacity = kPinsPerOwner - 16;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t free_ = kCapacity;
};

// Leaked on purpose: a connection thread may still release into it while the process exits.
PinPool& pin_pool() {
  static PinPool* pool = new PinPool;
  return *pool;
}

// One value of a reply chunk being built.
struct Slot {
  const char* data = nullptr;
  uint32_t len = 0;
  uint32_t crc = 0;
  uint32_t token = 0;
  enum Kind : uint8_t { kMissed, kPinned, kFilled } kind = kMissed;
};

// The pins of a message and its share of the pool, released on every way out.
class ChunkPins {
 public:
  // This process's pid, read once for the message's pins (Cache::pin would read it per pin).
  ChunkPins(Cache* cache, std::vector<Slot>* slots) : cache_(cache), slots_(slots), pid_(getpid()) {}
  ~ChunkPins() { release_all(); }
  bool take_pool(uint32_t n, int64_t deadline_ns) {
    if (!n || !pin_pool().acquire(n, deadline_ns)) return false;
    pooled_ = n;
    return true;
  }
  // Pins the values of ids[k] for the positions k of `at` (slots not filled) in one batch
  // (Cache::pin_many); a value not found stays a miss.
  void pin(const uint64_t* ids, const std::vector<size_t>& at) {
    if (at.empty()) return;
    std::vector<uint64_t> want(at.size());
    for (size_t j = 0; j < at.size(); ++j) want[j] = ids[at[j]];
    std::vector<Cache::Pinned> got(at.size());
    std::unique_ptr<bool[]> found(new bool[at.size()]);
    cache_->pin_many(want.data(), want.size(), got.data(), found.get(), pid_);
    for (size_t j = 0; j < at.size(); ++j) {
      if (!found[j]) continue;
      Slot& s = (*slots_)[at[j]];
      s.data = got[j].data;
      s.len = got[j].len;
      s.crc = got[j].crc;
      s.token = got[j].token;
      s.kind = Slot::kPinned;
      held_.push_back(at[j]);
      if (s.len > net::kMaxValue) unpin(s);  // larger than any peer accepts: a miss
    }
  }
  void unpin(Slot& s) {
    if (s.kind != Slot::kPinned) return;
    cache_->unpin(s.token, pid_, pid_);
    s.kind = Slot::kMissed;
  }
  // Every pin still held, in one batch (Cache::unpin_many), and the pool's share.
  void release_all() {
    std::vector<uint32_t> tokens;
    tokens.reserve(held_.size());
    for (size_t k : held_) {
      Slot& s = (*slots_)[k];
      if (s.kind != Slot::kPinned) continue;
      tokens.push_back(s.token);
      s.kind = Slot::kMissed;
    }
    held_.clear();
    cache_->unpin_many(tokens.data(), tokens.size(), pid_, pid_);
    pin_pool().release(pooled_);
    pooled_ = 0;
  }

 private:
  Cache* cache_;
  std::vector<Slot>* slots_;
  int64_t pid_;
  std::vector<size_t> held_;  // positions pinned by pin()
  uint32_t pooled_ = 0;
};

class PeerSession {
 public:
  PeerSession(const py::bytes& send_key, const py::bytes& recv_key)
      : tx_(key_of(send_key), true), rx_(key_of(recv_key), false), pid_(getpid()) {}

  bool broken() const { return rx_broken_ || tx_broken_; }
  uint64_t send_seq() const { return tx_.seq(); }
  uint64_t recv_seq() const { return rx_.seq(); }

  // Seals and sends one message (not a GET reply). (0, body bytes) or a failure.
  py::tuple send_message(int fd, int opcode, uint32_t count, uint64_t opaque, int status, const py::buffer& body,
                         double timeout) {
    Turn turn(this);
    if (tx_broken_) return unusable();
    py::buffer_info bi = body.request();
    size_t n = static_cast<size_t>(bi.size) * static_cast<size_t>(bi.itemsize);
    if (n > kMaxMessage) throw Error(ErrorKind::kInvalidArgument, "message body larger than 1 MiB");
    net::Header h = net::make_header(static_cast<uint8_t>(opcode), count, static_cast<uint32_t>(n), opaque,
                                     static_cast<uint16_t>(status));
    std::vector<uint8_t> buf(kHead + n + kTag);
    bool sealed;
    int r = net::kOk;
    {
      py::gil_scoped_release nogil;
      std::memcpy(buf.data(), &h, kHead);
      sealed = tx_.begin(&h, kHead) && tx_.update(bi.ptr, buf.data() + kHead, n) && tx_.seal_end(buf.data() + kHead + n);
      if (sealed) {
        iovec v{buf.data(), buf.size()};
        r = net::send_all(fd, &v, 1, deadline_after(timeout));
      }
    }
    if (!sealed) return fail_tx(protocol(net::kEInternal, "libcrypto failed to seal a message"));
    if (r != net::kOk) return fail_tx(io_failure(r));
    return py::make_tuple(0, n);
  }

  // Receives one message whose opcode is one of `allowed` (never a GET reply: recv_get_reply),
  // waiting up to `idle` for its first byte, then up to `timeout` for the rest of it (header and
  // body together), and never past max(idle, timeout) from the call: a caller with one deadline
  // (the client) passes its time left as both. Its body is opened before it is returned:
  // (0, (opcode, status, count, opaque, body)) or a failure.
  py::tuple recv_message(int fd, const std::vector<int>& allowed, double idle, double timeout) {
    Turn turn(this);
    if (rx_broken_) return unusable();
    net::Header h;
    int r;
    int64_t rest;  // the deadline of the whole message once its first byte is here
    {
      py::gil_scoped_release nogil;
      int64_t cap = deadline_after(std::max(idle, timeout));
      r = net::wait_readable(fd, deadline_after(idle));
      rest = std::min(deadline_after(timeout), cap);
      if (r == net::kOk) r = net::recv_exact(fd, &h, kHead, rest);
    }
    if (r != net::kOk) return fail_rx(io_failure(r));
    uint16_t code = 0;
    std::string why = check_header(h, allowed, &code);
    if (!why.empty()) return fail_rx(protocol(code, why));
    size_t n = h.body_len;
    std::vector<uint8_t> buf(n + kTag);  // bounded by check_header: at most 32 KiB + the tag
    bool opened = false;
    {
      py::gil_scoped_release nogil;
      r = net::recv_exact(fd, buf.data(), buf.size(), rest);
      opened = r == net::kOk && rx_.begin(&h, kHead) && rx_.update(buf.data(), buf.data(), n) &&
               rx_.open_end(buf.data() + n);
    }
    if (r != net::kOk) return fail_rx(io_failure(r));
    if (!opened) return fail_rx(forged());
    py::bytes body(reinterpret_cast<const char*>(buf.data()), n);
    if (h.opcode == net::kError) rx_broken_ = true;  // the sender closes after an ERROR
    return py::make_tuple(0, py::make_tuple(h.opcode, h.status, h.count, h.opaque, body));
  }

  // Seals the reply to a GET for the ids of `ids`, from its first on: the values cached here or
  // given in `fills` ({position: bytes}), cut where the values would pass `max_bytes` (one value
  // always goes). They go as GET_REPLY messages of at most kReplyMessageItems ids and
  // kReplyMessageBytes of values each, so that the first leaves early and the client opens one while the next is
  // sealed. `more_after`: ids of the request follow `ids`, so the last message says MORE too.
  // What the kernel takes at once is sent as it is sealed; flush() sends the rest (the caller
  // may do other work, pins released, in between), or, given flush_timeout >= 0 (a caller with
  // nothing to do in between), this call does, by that timeout, once every pin is released.
  // (0, (ids answered, cache hits, value bytes, busy)) where busy means pins could not be had
  // within pin_wait and cached values went as misses.
  py::tuple seal_get_reply(int fd, py::object core, const U64Array& ids, const py::dict& fills, uint64_t opaque,
                           bool more_after, uint64_t max_bytes, double pin_wait, double flush_timeout) {
    Turn turn(this);
    if (tx_broken_) return unusable();
    if (pending_.second > pending_.first) throw Error(ErrorKind::kInvalidArgument, "seal_get_reply before flush");
    Cache* cache = &core.cast<Cache&>();
    cache->check_open();
    size_t n = static_cast<size_t>(ids.size());
    if (n == 0 || n > net::kMaxBatch) throw Error(ErrorKind::kInvalidArgument, "a reply chunk answers 1..4096 ids");
    max_bytes = std::min<uint64_t>(max_bytes, net::kMaxValue);
    const uint64_t* p = ids.data();
    for (size_t k = 0; k < n; ++k) cache->check_id(p[k]);
    std::vector<Slot> slots(n);
    std::vector<py::object> held;  // the filled values, alive while we read them without the GIL
    for (auto item : fills) {
      size_t k = item.first.cast<size_t>();
      if (k >= n) throw py::index_error("fill position " + std::to_string(k) + " outside the chunk");
      PyObject* v = item.second.ptr();
      if (!PyBytes_Check(v)) throw py::type_error("a filled value must be bytes");
      Py_ssize_t len = PyBytes_GET_SIZE(v);
      if (static_cast<uint64_t>(len) > net::kMaxValue)
        throw Error(ErrorKind::kTooLarge, "value larger than the wire's bound (64 MiB)");
      slots[k].data = PyBytes_AS_STRING(v);
      slots[k].len = static_cast<uint32_t>(len);
      slots[k].kind = Slot::kFilled;
      held.push_back(py::reinterpret_borrow<py::object>(item.second));
    }
    size_t pos = 0, hits = 0;
    uint64_t total = 0;
    bool busy = false, sealed = true, cut = false;
    int r = net::kOk;
    {
      py::gil_scoped_release nogil;
      Cache::Use use(*cache);
      size_t made = 0, sent = 0;
      while (sealed && r == net::kOk && pos < n && !cut) {
        // One message: ids [pos, end), pinned only while it is sealed. Where it ends is planned
        // by the lengths the cache shows now (a lock-free look, no pin), so that only the values
        // that go in it are pinned, in one batch; a value that changed before its pin is cut
        // again by the length pinned.
        const size_t lim = std::min(n, pos + kReplyMessageItems);
        auto call_bound = [&](size_t k, uint64_t bytes, uint64_t len) { return k != 0 && total + bytes + len > max_bytes; };
        auto message_bound = [&](size_t k, uint64_t bytes, uint64_t len) { return k > pos && bytes + len > kReplyMessageBytes; };
        std::vector<size_t> to_pin;
        size_t planned = lim;
        bool planned_cut = false;  // the plan ends at the call's bound
        {
          uint64_t bytes = 0;
          for (size_t k = pos; k < lim; ++k) {
            uint32_t len = 0;
            bool cached = slots[k].kind != Slot::kFilled && cache->peek_length(p[k], &len);
            if (slots[k].kind == Slot::kFilled) len = slots[k].len;
            planned_cut = call_bound(k, bytes, len);
            if (planned_cut || message_bound(k, bytes, len)) {
              planned = k;
              break;
            }
            if (cached) to_pin.push_back(k);
            bytes += len;
          }
        }
        if (planned == pos) break;  // the call's bound falls on this message's first id: it waits for the next call
        ChunkPins pins(cache, &slots);
        bool no_pins = !to_pin.empty() && !pins.take_pool(static_cast<uint32_t>(to_pin.size()), deadline_after(pin_wait));
        busy |= no_pins;
        if (!no_pins) pins.pin(p, to_pin);
        size_t end = planned;
        bool at_call_bound = planned_cut;
        uint64_t bytes = 0;
        for (size_t k = pos; k < planned; ++k) {  // the same bounds by the lengths pinned
          uint64_t len = slots[k].kind == Slot::kMissed ? 0 : slots[k].len;
          bool call = call_bound(k, bytes, len);
          if (call || message_bound(k, bytes, len)) {
            end = k;
            at_call_bound = call;
            break;
          }
          bytes += len;
        }
        cut = at_call_bound;
        if (end == pos) break;  // a value grew past the call's bound since the plan: the next call
        for (size_t k = pos; k < end; ++k) {
          if (slots[k].kind == Slot::kFilled) slots[k].crc = crc32c(slots[k].data, slots[k].len, 0);
          hits += slots[k].kind == Slot::kPinned;
        }
        size_t count = end - pos;
        uint64_t table_len = uint64_t{count} * net::kEntryBytes;
        uint64_t body = table_len + bytes;  // <= 64 MiB + 64 KiB: no 32-bit wrap
        if (body > net::kMaxReply) {
          sealed = false;
          break;
        }
        bool last = end == n && !more_after;
        net::Header h = net::make_header(net::kGetReply, static_cast<uint32_t>(count), static_cast<uint32_t>(body),
                                         opaque, last ? 0 : net::kMore);
        out_.keep(made, made + kHead + table_len + kTag + bytes + kTag);  // keeps out_[0, made)
        char* o = out_.data();
        std::memcpy(o + made, &h, kHead);
        char* tbl = o + made + kHead;
        for (size_t k = pos; k < end; ++k) {
          const Slot& s = slots[k];
          net::Entry e{p[k], s.kind == Slot::kMissed ? net::kMiss : s.len, s.kind == Slot::kMissed ? 0 : s.crc};
          std::memcpy(tbl + (k - pos) * net::kEntryBytes, &e, sizeof e);
        }
        sealed = tx_.begin(&h, kHead) && tx_.update(tbl, tbl, table_len) &&
                 tx_.seal_end(reinterpret_cast<uint8_t*>(tbl + table_len)) && tx_.begin(nullptr, 0);
        made += kHead + table_len + kTag;
        for (size_t k = pos; sealed && k < end; ++k) {
          Slot& s = slots[k];
          if (s.kind == Slot::kMissed) continue;
          for (size_t off = 0; sealed && off < s.len; off += kHandOver) {
            size_t step = std::min<size_t>(kHandOver, s.len - off);
            sealed = tx_.update(s.data + off, o + made, step);
            made += step;
            if (r == net::kOk && made - sent >= kHandOver) r = send_ready(fd, o, &sent, &made);
          }
        }
        sealed = sealed && tx_.seal_end(reinterpret_cast<uint8_t*>(o + made));
        made += kTag;
        pins.release_all();
        total += bytes;
        pos = end;
        // This message, if the kernel takes it; the call's last one waits for flush(), so that
        // what the caller does in between (the server offers what it read to its cache) is done
        // before the client can have the whole reply.
        if (sealed && r == net::kOk && pos < n && !cut) r = send_ready(fd, o, &sent, &made);
      }
      // Nothing is pinned now: waiting for the client holds nothing another client needs.
      if (flush_timeout >= 0 && sealed && r == net::kOk && made > sent) {
        iovec v{out_.data() + sent, made - sent};
        r = net::send_all(fd, &v, 1, deadline_after(flush_timeout));
        sent = made = 0;
      }
      pending_ = {sent, made};
    }
    if (!sealed) return fail_tx(protocol(net::kEInternal, "could not seal a reply chunk"));
    if (r != net::kOk) return fail_tx(io_failure(r));
    return py::make_tuple(0, py::make_tuple(pos, hits, total, busy));
  }

  // Sends what seal_get_reply left for the client to take, by the deadline: (0, None) or a failure.
  py::tuple flush(int fd, double timeout) {
    Turn turn(this);
    if (tx_broken_) return unusable();
    int r = net::kOk;
    if (pending_.second > pending_.first) {
      py::gil_scoped_release nogil;
      iovec v{out_.data() + pending_.first, pending_.second - pending_.first};
      r = net::send_all(fd, &v, 1, deadline_after(timeout));
    }
    pending_ = {0, 0};
    if (r != net::kOk) return fail_tx(io_failure(r));
    return py::make_tuple(0, py::none());
  }

  // The reply to the GET sent for `ids` with `opaque`: (0, (values, refused)), values[k] bytes or
  // None, or a failure. See the file comment.
  py::tuple recv_get_reply(int fd, const U64Array& ids_arr, uint64_t opaque, double timeout) {
    Turn turn(this);
    if (rx_broken_) return unusable();
    const uint64_t* ids = ids_arr.data();
    size_t n = static_cast<size_t>(ids_arr.size());
    int64_t deadline = deadline_after(timeout);
    py::list out(n);
    for (size_t k = 0; k < n; ++k) PyList_SET_ITEM(out.ptr(), k, Py_NewRef(Py_None));
    size_t got = 0, refused = 0;
    net::Header h, next;  // next: the header of the message that follows, read with this one's tail
    bool have_next = false;
    for (;;) {
      int r = net::kOk;
      if (have_next) {
        h = next;
        have_next = false;
      } else {
        py::gil_scoped_release nogil;
        r = net::recv_exact(fd, &h, kHead, deadline);
      }
      if (r != net::kOk) return fail_rx(io_failure(r));
      if (std::memcmp(h.magic, "SHCP", 4) != 0) return fail_rx(protocol(net::kEBadMagic, "bad magic in reply"));
      if (h.version != net::kVersion)
        return fail_rx(protocol(net::kEBadVersion, "reply of protocol version " + std::to_string(h.version)));
      if (h.opcode == net::kError) return error_reply(fd, h, deadline);
      if (h.opcode != net::kGetReply || h.opaque != opaque)
        return fail_rx(protocol(net::kEBadOpcode, "reply opcode " + std::to_string(h.opcode) + " opaque " +
                                                   std::to_string(h.opaque) + " does not answer GET " +
                                                   std::to_string(opaque)));
      uint64_t table_len = uint64_t{h.count} * net::kEntryBytes;
      if (h.count == 0 || h.count > net::kMaxBatch || got + h.count > n || h.body_len > net::kMaxReply ||
          h.body_len < table_len)
        return fail_rx(protocol(net::kEBadLength, "malformed GET reply header"));
      // The table, opened before anything it announces is allocated.
      std::vector<net::Entry> table(h.count);
      uint8_t tag[kTag];
      bool opened;
      {
        py::gil_scoped_release nogil;
        iovec v[2] = {{table.data(), table_len}, {tag, kTag}};
        r = net::recv_all(fd, v, 2, deadline);
        opened = r == net::kOk && rx_.begin(&h, kHead) && rx_.update(table.data(), table.data(), table_len) &&
                 rx_.open_end(tag);
      }
      if (r != net::kOk) return fail_rx(io_failure(r));
      if (!opened) return fail_rx(forged());
      uint64_t sum = 0;
      for (uint32_t k = 0; k < h.count; ++k) {
        if (table[k].id != ids[got + k]) return fail_rx(protocol(net::kEBadId, "reply ids do not match the request"));
        if (table[k].length == net::kMiss) continue;
        if (table[k].length > net::kMaxValue) return fail_rx(protocol(net::kETooLarge, "reply value exceeds the bound"));
        sum += table[k].length;
      }
      if (sum + table_len != h.body_len) return fail_rx(protocol(net::kEBadLength, "reply lengths do not add up"));
      // The values: allocated as the authenticated table says, received straight into the result
      // bytes and decrypted in place a piece at a time.
      std::vector<char*> dest(h.count, nullptr);
      std::vector<iovec> pieces;
      std::vector<uint32_t> owner;  // pieces[q] is part of entry owner[q]
      for (uint32_t k = 0; k < h.count; ++k) {
        if (table[k].length == net::kMiss) continue;
        PyObject* b = PyBytes_FromStringAndSize(nullptr, table[k].length);
        if (!b) throw py::error_already_set();
        PyList_SetItem(out.ptr(), got + k, b);  // steals b; drops the None
        dest[k] = PyBytes_AS_STRING(b);
        for (size_t off = 0; off < table[k].length; off += kPiece) {
          pieces.push_back(iovec{dest[k] + off, std::min<size_t>(kPiece, table[k].length - off)});
          owner.push_back(k);
        }
      }
      std::vector<uint32_t> bad;
      std::vector<uint32_t> crc(h.count, 0);
      // The values' tag comes with the last piece, and when the (authenticated) header says MORE,
      // the next message's header too: never a byte past this reply.
      const bool more = h.status & net::kMore;
      const iovec tail[2] = {{tag, kTag}, {&next, kHead}};
      const size_t tails = more ? 2 : 1;
      {
        py::gil_scoped_release nogil;
        opened = rx_.begin(nullptr, 0);
        std::vector<iovec> window;
        if (pieces.empty()) {
          window.assign(tail, tail + tails);
          r = net::recv_all(fd, window.data(), window.size(), deadline);
        }
        for (size_t i = 0; opened && r == net::kOk && i < pieces.size();) {
          size_t j = i, bytes = 0;
          while (j < pieces.size() && (j == i || bytes + pieces[j].iov_len <= kWindow)) bytes += pieces[j++].iov_len;
          window.assign(pieces.begin() + i, pieces.begin() + j);  // recv_all consumes its iovecs
          if (j == pieces.size()) window.insert(window.end(), tail, tail + tails);
          r = net::recv_all_whole(fd, window.data(), window.size(), deadline);
          // Decrypted in place, and checksummed while the bytes are in cache; neither result is
          // used before the tag has been checked below.
          for (size_t q = i; r == net::kOk && opened && q < j; ++q) {
            opened = rx_.update(pieces[q].iov_base, pieces[q].iov_base, pieces[q].iov_len);
            crc[owner[q]] = crc32c(pieces[q].iov_base, pieces[q].iov_len, crc[owner[q]]);
          }
          i = j;
        }
        opened = opened && r == net::kOk && rx_.open_end(tag);
        for (uint32_t k = 0; opened && k < h.count; ++k)  // the tag first, then the store's checksum
          if (dest[k] && crc[k] != table[k].crc) bad.push_back(k);
      }
      if (r != net::kOk) return fail_rx(io_failure(r));
      if (!opened) return fail_rx(forged());
      for (uint32_t k : bad) PyList_SetItem(out.ptr(), got + k, Py_NewRef(Py_None));  // refused
      refused += bad.size();
      got += h.count;
      if (!more) break;
      have_next = true;
    }
    if (got != n)
      return fail_rx(protocol(net::kEBadLength, "reply has " + std::to_string(got) + " of " + std::to_string(n) + " entries"));
    return py::make_tuple(0, py::make_tuple(out, refused));
  }

  // For tests and fuzzers that play a peer by hand: the next sealed record (ciphertext || tag)
  // of `body` with `aad`, and the opening of one (None when its tag fails). Each takes the next
  // sequence number of its direction, as a frame would.
  py::bytes seal(const py::bytes& aad, const py::bytes& body) {
    Turn turn(this);
    std::string a = aad, b = body;
    std::string o(b.size() + kTag, '\0');
    if (!(tx_.begin(a.data(), a.size()) && tx_.update(b.data(), o.data(), b.size()) &&
          tx_.seal_end(reinterpret_cast<uint8_t*>(o.data() + b.size()))))
      throw Error(ErrorKind::kInvalidArgument, "libcrypto failed to seal");
    return py::bytes(o);
  }
  py::object open(const py::bytes& aad, const py::bytes& sealed) {
    Turn turn(this);
    std::string a = aad, s = sealed;
    if (s.size() < kTag) return py::none();
    size_t n = s.size() - kTag;
    if (!(rx_.begin(a.data(), a.size()) && rx_.update(s.data(), s.data(), n) &&
          rx_.open_end(reinterpret_cast<const uint8_t*>(s.data() + n))))
      return py::none();
    return py::bytes(s.data(), n);
  }

 private:
  // One call at a time, in the process that made the session: the sequence numbers and the
  // buffer are the connection's. The pid first: a child forked while a parent's thread held the
  // turn has a copy of the mutex locked for good.
  class Turn {
   public:
    explicit Turn(PeerSession* s) : s_(s) {
      if (getpid() != s_->pid_)
        throw Error(ErrorKind::kInvalidArgument,
                    "a PeerSession is used only by the process that made it (this one is a fork of it): connect again");
      if (!s_->turn_.try_lock()) throw Error(ErrorKind::kInvalidArgument, "a PeerSession used by two threads at once");
    }
    ~Turn() { s_->turn_.unlock(); }

   private:
    PeerSession* s_;
  };

  // A byte buffer that grows without zeroing (what is kept is copied; the rest is written over).
  class Buffer {
   public:
    char* data() { return p_.get(); }
    // Makes room for `need` bytes, keeping the first `keep`.
    void keep(size_t keep, size_t need) {
      if (need <= size_) return;
      size_t grown = std::max(need, size_ + size_ / 2);
      std::unique_ptr<char[]> q(new char[grown]);
      if (keep) std::memcpy(q.get(), p_.get(), keep);
      p_ = std::move(q);
      size_ = grown;
    }

   private:
    std::unique_ptr<char[]> p_;
    size_t size_ = 0;
  };

  // Hands the kernel what it takes now of o[*sent, *made), never waiting. When it took all of it,
  // the next bytes are sealed from the start of the buffer again (sent = made = 0), over what
  // was just handed over: the buffer stays about a message long (a window, for a large value),
  // in cache for the kernel's copy, instead of growing over the whole reply. Every pointer into
  // it is taken from `made` after this call.
  static int send_ready(int fd, const char* o, size_t* sent, size_t* made) {
    int64_t k = net::send_some(fd, o + *sent, *made - *sent);
    if (k < 0) return net::kFailed;
    *sent += static_cast<size_t>(k);
    if (*sent == *made) *sent = *made = 0;
    return net::kOk;
  }

  // A failed receive leaves the incoming stream out of step, a failed send the outgoing one;
  // the other direction still works (a server answers a malformed request with an ERROR).
  py::tuple fail_rx(py::tuple result) {
    rx_broken_ = true;
    return result;
  }
  py::tuple fail_tx(py::tuple result) {
    tx_broken_ = true;
    return result;
  }
  static py::tuple unusable() {
    return protocol(net::kEInternal, "the connection is out of step after an earlier failure");
  }

  // "" when `h` may start a message here: magic, version, an opcode of `allowed`, a body within
  // that opcode's bound. Otherwise why not, with the ERROR status in *code.
  static std::string check_header(const net::Header& h, const std::vector<int>& allowed, uint16_t* code) {
    auto refuse = [code](uint16_t c, const std::string& why) {
      *code = c;
      return why;
    };
    if (std::memcmp(h.magic, "SHCP", 4) != 0) return refuse(net::kEBadMagic, "bad magic");
    if (h.version != net::kVersion)
      return refuse(net::kEBadVersion, "protocol version " + std::to_string(h.version) + " (this side speaks " +
                                           std::to_string(net::kVersion) + ")");
    if (std::find(allowed.begin(), allowed.end(), h.opcode) == allowed.end())
      return refuse(net::kEBadOpcode, "unexpected opcode " + std::to_string(h.opcode));
    switch (h.opcode) {
      case net::kGet:
        if (h.count > net::kMaxBatch)
          return refuse(net::kETooLarge, "GET of " + std::to_string(h.count) + " ids exceeds 4096");
        if (uint64_t{h.body_len} != uint64_t{h.count} * 8)
          return refuse(net::kEBadLength, "GET of " + std::to_string(h.count) + " ids carries " +
                                              std::to_string(h.body_len) + " bytes");
        return "";
      case net::kStatsReply:
        return h.body_len > net::kMaxStats ? refuse(net::kETooLarge, "STATS reply too large") : "";
      case net::kError:
        return h.body_len > net::kMaxError ? refuse(net::kETooLarge, "ERROR message too large") : "";
      case net::kPing:
      case net::kPong:
      case net::kStats:
        return h.body_len ? refuse(net::kEBadLength, "a body on a message that has none") : "";
      default:
        return refuse(net::kEBadOpcode, "opcode " + std::to_string(h.opcode) + " is not a message of this state");
    }
  }

  py::tuple error_reply(int fd, const net::Header& h, int64_t deadline) {
    if (h.body_len > net::kMaxError) return fail_rx(protocol(net::kETooLarge, "ERROR reply body too large"));
    std::string msg(h.body_len + kTag, '\0');
    int r;
    bool opened;
    {
      py::gil_scoped_release nogil;
      r = net::recv_exact(fd, msg.data(), msg.size(), deadline);
      opened = r == net::kOk && rx_.begin(&h, kHead) && rx_.update(msg.data(), msg.data(), h.body_len) &&
               rx_.open_end(reinterpret_cast<const uint8_t*>(msg.data() + h.body_len));
    }
    if (r != net::kOk) return fail_rx(io_failure(r));
    if (!opened) return fail_rx(forged());
    msg.resize(h.body_len);
    return fail_rx(py::make_tuple(5, py::make_tuple(h.status, py::bytes(msg))));
  }

  Aead tx_, rx_;
  Buffer out_;
  std::pair<size_t, size_t> pending_{0, 0};  // out_[first, second): sealed, not yet sent
  bool rx_broken_ = false, tx_broken_ = false;
  const pid_t pid_;  // the process that made the session (Turn)
  std::mutex turn_;
};

// Positions of `ids` the cache does not hold now (lock-free look-ups): what the server fills from
// its SSD tier or store before it builds a reply chunk.
py::list missed_positions(py::object core, const U64Array& ids) {
  Cache& c = core.cast<Cache&>();
  const uint64_t* p = ids.data();
  py::list out;
  for (py::ssize_t k = 0; k < ids.size(); ++k)
    if (!c.contains(p[k])) out.append(k);
  return out;
}

py::bytes session_keys(const py::bytes& secret, const py::bytes& salt, const py::bytes& info) {
  std::string s = secret, a = salt, i = info;
  uint8_t out[net::kSessionKeyBytes];
  if (!net::derive_session_keys(reinterpret_cast<const uint8_t*>(s.data()), s.size(),
                                reinterpret_cast<const uint8_t*>(a.data()), a.size(),
                                reinterpret_cast<const uint8_t*>(i.data()), i.size(), out))
    throw Error(ErrorKind::kInvalidArgument, "libcrypto failed to derive the session keys");
  return py::bytes(reinterpret_cast<const char*>(out), sizeof out);
}

}  // namespace

void register_peer_io(py::module_& m) {
  py::class_<PeerSession>(m, "PeerSession")
      .def(py::init<const py::bytes&, const py::bytes&>(), py::arg("send_key"), py::arg("recv_key"))
      .def_property_readonly("broken", &PeerSession::broken)
      .def_property_readonly("send_seq", &PeerSession::send_seq)
      .def_property_readonly("recv_seq", &PeerSession::recv_seq)
      .def("send_message", &PeerSession::send_message, py::arg("fd"), py::arg("opcode"), py::arg("count"),
           py::arg("opaque"), py::arg("status"), py::arg("body"), py::arg("timeout"))
      .def("recv_message", &PeerSession::recv_message, py::arg("fd"), py::arg("allowed"), py::arg("idle"),
           py::arg("timeout"))
      .def("seal_get_reply", &PeerSession::seal_get_reply, py::arg("fd"), py::arg("core"), py::arg("ids"),
           py::arg("fills"), py::arg("opaque"), py::arg("more_after"), py::arg("max_bytes"), py::arg("pin_wait"),
           py::arg("flush_timeout") = -1.0)
      .def("flush", &PeerSession::flush, py::arg("fd"), py::arg("timeout"))
      .def("recv_get_reply", &PeerSession::recv_get_reply, py::arg("fd"), py::arg("ids"), py::arg("opaque"),
           py::arg("timeout"))
      .def("seal", &PeerSession::seal, py::arg("aad"), py::arg("body"))
      .def("open", &PeerSession::open, py::arg("aad"), py::arg("sealed"));
  m.def("peer_session_keys", &session_keys, py::arg("secret"), py::arg("salt"), py::arg("info"),
        "128 bytes of HKDF-SHA256 (net/session_keys.h): client proof, server proof, the two keys");
  m.def("peer_missed", &missed_positions, py::arg("core"), py::arg("ids"),
        "positions of ids (u64) the cache does not hold now");
  m.attr("PEER_PIN_POOL") = PinPool::kCapacity;
  m.def("peer_aead", &net::Aead::implementation,
        "the AES-256-GCM implementation this process seals and opens frames with (net/aead.h)");
}

}  // namespace shadecache
