#include "io/uring_backend.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "common/error.h"
#include "io/store_format.h"

#ifdef SHADECACHE_HAVE_LIBURING
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace shadecache {

#ifndef SHADECACHE_HAVE_LIBURING

std::unique_ptr<IoBackend> make_uring_backend(unsigned, bool) {
  throw Error(ErrorKind::kOs, "io_uring: this build of shadecache has no liburing support",
              ENOSYS);
}

#else

namespace {

bool disabled_by_env() {
  const char* v = std::getenv("SHADECACHE_IOURING_DISABLE");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// The O_DIRECT bounce arena never grows past this, nor do the buffers of their own that ranges
// larger than a slot get (unless one range alone is larger): with large samples a call then keeps
// fewer of them in flight instead of pinning unbounded memory (read_feed).
constexpr size_t kArenaCapBytes = 64u << 20;

class UringBackend final : public IoBackend {
 public:
  UringBackend(unsigned queue_depth, bool bind_to_thread) : qd_(queue_depth), limit_(queue_depth) {
    // COOP_TASKRUN: no interrupt of this thread to post each completion. SINGLE_ISSUER +
    // DEFER_TASKRUN: completions are posted only when this thread waits for them, which gave
    // large O_DIRECT reads clearly more bandwidth than without (docs/store_format.md, "io_uring").
    // They bind the ring to the creating thread; BackendSlot sends other threads to a ring
    // without them. Older kernels reject the flags with EINVAL: retry without, as fio does.
    const unsigned bound = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER |
                           IORING_SETUP_DEFER_TASKRUN;
    unsigned tries[] = {bind_to_thread ? bound : IORING_SETUP_COOP_TASKRUN,
                        IORING_SETUP_COOP_TASKRUN, 0};
    int r = -EINVAL;
    for (unsigned flags : tries) {
      io_uring_params params;
      std::memset(&params, 0, sizeof(params));
      params.flags = flags;
      r = io_uring_queue_init_params(qd_, &ring_, &params);
      if (r != -EINVAL) {
        single_issuer_ = (flags & IORING_SETUP_SINGLE_ISSUER) != 0;
        break;
      }
    }
    if (r < 0) throw_errno("io_uring_queue_init(" + std::to_string(qd_) + ")", -r);
  }

  ~UringBackend() override {
    if (registered_) io_uring_unregister_buffers(&ring_);
    io_uring_queue_exit(&ring_);
    std::free(arena_);
  }

  const char* name() const override { return "io_uring"; }
  bool bound_to_thread() const override { return single_issuer_; }
  bool usable_here() override {
    if (!single_issuer_) return true;
    // Waiting for zero completions is a no-op for the ring's own thread and -EEXIST for any
    // other (the kernel's SINGLE_ISSUER / DEFER_TASKRUN check); one cheap syscall per batch.
    return io_uring_enter(ring_.ring_fd, 0, 0, IORING_ENTER_GETEVENTS, nullptr) != -EEXIST;
  }

  void read_ranges(int fd, bool direct, RangeRead* ops, size_t n, const RangeDone& done) override;
  void read_feed(int fd, bool direct, RangeFeed& feed) override;
  void read_files(FileRead* ops, size_t n) override;
  void set_submission(unsigned max_inflight, bool submit_each) override {
    limit_ = std::max(1u, std::min(qd_, max_inflight));
    submit_each_ = submit_each;
  }

 private:
  // Submits what is queued and waits for at least one completion; EINTR/EAGAIN/EBUSY just mean
  // "try again" (completions are then reaped by the caller's loop).
  void submit_and_wait() {
    int r = io_uring_submit_and_wait(&ring_, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      // Cannot happen with a valid ring; reads may still be in flight into caller buffers, so the
      // only safe answer is to stop the process rather than return and let them be freed.
      std::fprintf(stderr, "shadecache: io_uring_submit_and_wait failed: %s\n", std::strerror(-r));
      std::abort();
    }
  }
  // Submits, waits for at least one completion, calls on_cqe(user data, result) for every
  // completion there is, then advances the CQ; returns how many were reaped. on_cqe must not
  // throw: completions of the batch are still arriving into its buffers.
  template <class F>
  unsigned wait_and_reap(F&& on_cqe) {
    submit_and_wait();
    unsigned head, seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      on_cqe(io_uring_cqe_get_data64(cqe), cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
    return seen;
  }
  io_uring_sqe* sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring_);
    if (s == nullptr) {  // SQ full: the ring holds >= qd_ entries, so flushing frees room
      io_uring_submit(&ring_);
      s = io_uring_get_sqe(&ring_);
    }
    return s;
  }
  // Makes room for `slots` aligned buffers of `slot_bytes` each, registered with the ring.
  void ensure_arena(size_t slot_bytes, unsigned slots);

  io_uring ring_;
  unsigned qd_;
  unsigned limit_;            // reads in flight at most (set_submission), <= qd_
  bool submit_each_ = false;  // one io_uring_enter per read (set_submission)
  char* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  bool registered_ = false;
  bool single_issuer_ = false;
};

void UringBackend::ensure_arena(size_t slot_bytes, unsigned slots) {
  size_t need = slot_bytes * slots;
  if (need <= arena_bytes_) return;
  if (registered_) {
    io_uring_unregister_buffers(&ring_);
    registered_ = false;
  }
  std::free(arena_);
  arena_ = nullptr;
  arena_bytes_ = 0;
  void* p = nullptr;
  if (posix_memalign(&p, store::kAlign, need) != 0)
    throw Error(ErrorKind::kCapacity, "io_uring: cannot allocate " + std::to_string(need) +
                                          " bytes of O_DIRECT buffers");
  arena_ = static_cast<char*>(p);
  arena_bytes_ = need;
  iovec iov{arena_, need};
  // Registration can fail under a small RLIMIT_MEMLOCK; plain reads into the arena still work.
  registered_ = io_uring_register_buffers(&ring_, &iov, 1) == 0;
}

namespace {

// read_ranges as a feed: range i is tagged i.
class ArrayFeed final : public RangeFeed {
 public:
  ArrayFeed(RangeRead* ops, size_t n, bool direct, const RangeDone& done)
      : ops_(ops), n_(n), done_(done) {
    if (direct)
      for (size_t i = 0; i < n; ++i) span_ = std::max(span_, direct_span(ops[i]));
  }
  bool next(RangeRead& op, uint64_t& tag) override {
    if (next_ == n_) return false;
    op = ops_[next_];
    tag = next_++;
    return true;
  }
  void done(uint64_t tag) override { done_(static_cast<size_t>(tag)); }
  uint64_t span_hint() const override { return span_; }

 private:
  RangeRead* ops_;
  size_t n_;
  const RangeDone& done_;
  size_t next_ = 0;
  uint64_t span_ = 0;
};

}  // namespace

void UringBackend::read_ranges(int fd, bool direct, RangeRead* ops, size_t n,
                               const RangeDone& done) {
  if (n == 0) return;
  ArrayFeed feed(ops, n, direct, done);
  read_feed(fd, direct, feed);
}

void UringBackend::read_feed(int fd, bool direct, RangeFeed& feed) {
  // One entry per range taken from the feed and not yet handed back: in flight, waiting to be
  // resubmitted, or in and waiting to be copied out. A read's user_data is its entry's index. Twice
  // as many entries as reads in flight: finished reads are copied out of their buffers while the
  // replacement reads already run in the other half.
  //
  // O_DIRECT reads land in bounce buffers: entry e's slot of the registered arena, slot_bytes
  // each, sized once per call by the feed's hint but never so large that the arena would hold
  // fewer than 2 x depth slots within kArenaCapBytes; a range larger than its slot gets a buffer of
  // its own (an unregistered read), and those together stay within kArenaCapBytes too (one is
  // always allowed), so a large sample slows only its own read, never the depth of the others.
  struct FreeAligned {
    void operator()(char* p) const { std::free(p); }
  };
  struct Entry {
    RangeRead op;
    uint64_t tag;
    uint64_t got;                             // bytes in so far (for direct: of the aligned read)
    std::unique_ptr<char, FreeAligned> own;   // its own bounce buffer (larger than a slot), or none
  };
  // Bytes that must be in before a range is done: for O_DIRECT, counted from the aligned start.
  auto need = [direct](const RangeRead& op) {
    return direct ? op.offset % store::kAlign + op.len : uint64_t{op.len};
  };
  const unsigned depth = limit_;
  const size_t count = 2 * static_cast<size_t>(depth);
  size_t slot_bytes = 0;
  if (direct) {
    size_t fit = std::max<size_t>(store::kAlign, kArenaCapBytes / count / store::kAlign * store::kAlign);
    slot_bytes = std::min(std::max<size_t>(feed.span_hint(), store::kAlign), fit);
    ensure_arena(slot_bytes, static_cast<unsigned>(count));
  }
  std::vector<Entry> entries(count);
  std::vector<unsigned> free_entries, retry, finished;
  for (size_t e = count; e-- > 0;) free_entries.push_back(static_cast<unsigned>(e));
  finished.reserve(count);
  size_t own_bytes = 0;  // in buffers of their own
  auto release = [&](Entry& x) {
    if (x.own) own_bytes -= direct_span(x.op);
    x.own.reset();
  };
  auto buffer = [&](unsigned e) -> char* {
    return entries[e].own ? entries[e].own.get() : arena_ + static_cast<size_t>(e) * slot_bytes;
  };

  RangeRead held_op{};  // taken from the feed, waiting for an entry (or room for its own buffer)
  uint64_t held_tag = 0;
  bool holding = false;
  unsigned inflight = 0;
  bool stop = false;
  int err = 0;
  ErrorKind err_kind = ErrorKind::kOs;
  std::string err_what;

  auto fail = [&](ErrorKind kind, const std::string& what, int e) {
    if (!stop) {
      err_kind = kind;
      err_what = what;
      err = e;
    }
    stop = true;
  };
  // Queues reads until `depth` are in flight (or the feed has nothing now); returns how many.
  auto fill = [&]() {
    unsigned queued = 0;
    while (!stop && inflight < depth) {
      unsigned e;
      if (!retry.empty()) {
        e = retry.back();
        retry.pop_back();
      } else {
        if (free_entries.empty()) break;
        if (!holding) {
          if (!feed.next(held_op, held_tag)) break;
          holding = true;
        }
        char* own = nullptr;
        if (direct && direct_span(held_op) > slot_bytes) {
          size_t span = direct_span(held_op);
          if (own_bytes > 0 && own_bytes + span > kArenaCapBytes) break;  // after one lands
          void* p = nullptr;
          if (posix_memalign(&p, store::kAlign, span) != 0) {
            fail(ErrorKind::kCapacity,
                 "io_uring: cannot allocate " + std::to_string(span) + " bytes of O_DIRECT buffer", ENOMEM);
            break;
          }
          own = static_cast<char*>(p);
          own_bytes += span;
        }
        e = free_entries.back();
        free_entries.pop_back();
        entries[e].op = held_op;
        entries[e].tag = held_tag;
        entries[e].got = 0;
        entries[e].own.reset(own);
        holding = false;
      }
      Entry& x = entries[e];
      const RangeRead& op = x.op;
      io_uring_sqe* s = sqe();
      if (direct) {  // the aligned blocks that cover the range
        char* buf = buffer(e) + x.got;
        unsigned want = static_cast<unsigned>(direct_span(op) - x.got);
        uint64_t at = store::align_down(op.offset) + x.got;
        if (registered_ && !x.own)
          io_uring_prep_read_fixed(s, fd, buf, want, at, 0);
        else
          io_uring_prep_read(s, fd, buf, want, at);
      } else {
        io_uring_prep_read(s, op.fd >= 0 ? op.fd : fd, op.dest + x.got, op.len - x.got, op.offset + x.got);
      }
      io_uring_sqe_set_data64(s, e);
      ++inflight;
      ++queued;
      if (submit_each_) io_uring_submit(&ring_);  // the device has it now (set_submission)
    }
    return queued;
  };

  fill();
  while (inflight > 0) {
    // 1. Reap: classify every completion, but copy nothing yet.
    inflight -= wait_and_reap([&](uint64_t data, int res) {
      unsigned e = static_cast<unsigned>(data);
      Entry& x = entries[e];
      const RangeRead& op = x.op;
      if (res == -EAGAIN || res == -EINTR) {
        retry.push_back(e);
      } else if (res < 0) {
        fail(ErrorKind::kOs, "io_uring read of " + std::to_string(op.len) + " bytes at offset " +
                                 std::to_string(op.offset + x.got) + ": " + std::strerror(-res),
             -res);
        release(x);
        free_entries.push_back(e);
      } else if (res == 0 && x.got < need(op)) {
        fail(ErrorKind::kFormat, "data file truncated: end of file at offset " +
                                     std::to_string(op.offset + x.got - (direct ? op.offset % store::kAlign : 0)) +
                                     " while reading " +
                                     std::to_string(op.len) + " bytes at offset " +
                                     std::to_string(op.offset),
             0);
        release(x);
        free_entries.push_back(e);
      } else {
        x.got += static_cast<uint64_t>(res);
        // An O_DIRECT read of the last blocks ends early at end of file: enough once the range
        // itself is in.
        if (x.got >= need(op))
          finished.push_back(e);
        else
          retry.push_back(e);  // short read: ask for the rest
      }
    });
    // 2. Refill and submit at once: the device gets its next reads before we spend CPU on the
    //    finished ones (completions arrive in bursts here; copying and checksumming a burst first
    //    would leave the device idle for that long).
    if (fill() > 0) io_uring_submit(&ring_);
    // 3. Hand over the finished reads: copy out of the bounce buffer, then the feed's done (which
    //    checksums).
    for (unsigned e : finished) {
      Entry& x = entries[e];
      if (direct) std::memcpy(x.op.dest, buffer(e) + x.op.offset % store::kAlign, x.op.len);
      release(x);
      feed.done(x.tag);
      free_entries.push_back(e);
    }
    finished.clear();
    fill();  // room freed by the entries just emptied; submitted by the next wait
  }
  if (stop) throw Error(err_kind, err_what, err);
}

void UringBackend::read_files(FileRead* ops, size_t n) {
  // Each file goes OPEN -> (fstat, synchronous: the inode is in memory once open returns) ->
  // READ (repeated on short reads) -> CLOSE. At most qd_ files are between open and close, so
  // at most qd_ descriptors and qd_ ring operations exist at any time.
  enum Step : uint64_t { kOpen = 0, kRead = 1, kClose = 2 };
  std::vector<int> fds(n, -1);
  std::vector<size_t> got(n, 0);
  std::vector<std::pair<size_t, Step>> ready;  // next step of files already open
  size_t next = 0;
  unsigned active = 0, inflight = 0;

  auto fail = [&](size_t i, const char* step, int e) {
    if (ops[i].err == 0) {
      ops[i].err = e;
      ops[i].failed_step = step;
    }
  };
  for (;;) {
    while (!ready.empty()) {
      auto [i, step] = ready.back();
      ready.pop_back();
      io_uring_sqe* s = sqe();
      if (step == kRead)
        io_uring_prep_read(s, fds[i], ops[i].data.get() + got[i],
                           static_cast<unsigned>(std::min<size_t>(ops[i].size - got[i], 1u << 30)),
                           got[i]);
      else if (step == kClose)
        io_uring_prep_close(s, fds[i]);
      else
        io_uring_prep_openat(s, AT_FDCWD, ops[i].path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0);
      io_uring_sqe_set_data64(s, (static_cast<uint64_t>(i) << 2) | step);
      ++inflight;
    }
    while (active < qd_ && next < n) {
      size_t i = next++;
      io_uring_sqe* s = sqe();
      io_uring_prep_openat(s, AT_FDCWD, ops[i].path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0);
      io_uring_sqe_set_data64(s, (static_cast<uint64_t>(i) << 2) | kOpen);
      ++active;
      ++inflight;
    }
    if (inflight == 0) break;
    inflight -= wait_and_reap([&](uint64_t ud, int res) {
      size_t i = static_cast<size_t>(ud >> 2);
      Step step = static_cast<Step>(ud & 3);
      if (res == -EAGAIN || res == -EINTR) {
        ready.emplace_back(i, step);
        return;
      }
      FileRead& op = ops[i];
      if (step == kOpen) {
        if (res < 0) {
          fail(i, "open", -res);
          --active;
          return;
        }
        fds[i] = res;
        struct stat st;
        if (::fstat(res, &st) != 0) {
          fail(i, "fstat", errno);
          ready.emplace_back(i, kClose);
          return;
        }
        // Opened O_NONBLOCK so that a FIFO fails here instead of waiting for a writer (regular
        // files ignore the flag): anything but a regular file is refused.
        if (!S_ISREG(st.st_mode)) {
          fail(i, "fstat", S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
          ready.emplace_back(i, kClose);
          return;
        }
        op.size = static_cast<size_t>(st.st_size);
        if (op.size == 0) {
          ready.emplace_back(i, kClose);
          return;
        }
        // Never throw in here: completions of this batch are still arriving into its buffers
        // and the CQ must be advanced. A file too large to hold fails alone, and is closed.
        op.data.reset(new (std::nothrow) char[op.size]);
        if (!op.data) {
          fail(i, "read", ENOMEM);
          ready.emplace_back(i, kClose);
          return;
        }
        ready.emplace_back(i, kRead);
      } else if (step == kRead) {
        if (res < 0) {
          fail(i, "read", -res);
          ready.emplace_back(i, kClose);
        } else if (res == 0) {  // the file shrank since fstat: keep what it has
          op.size = got[i];
          ready.emplace_back(i, kClose);
        } else {
          got[i] += static_cast<size_t>(res);
          ready.emplace_back(i, got[i] < op.size ? kRead : kClose);
        }
      } else {
        if (res < 0) fail(i, "close", -res);
        --active;
      }
    });
  }
}

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(unsigned queue_depth, bool bind_to_thread) {
  if (disabled_by_env())
    throw Error(ErrorKind::kOs,
                "io_uring_queue_init: Operation not permitted (simulated: "
                "SHADECACHE_IOURING_DISABLE is set)",
                EPERM);
  return std::make_unique<UringBackend>(queue_depth, bind_to_thread);
}

#endif  // SHADECACHE_HAVE_LIBURING

}  // namespace shadecache
