// The interface every batch-I/O backend implements (io_uring in uring_backend.h, a pread thread
// pool in pread_backend.h), and the choice between them.
//
// Contract shared by all backends:
// - A call submits a whole batch and returns when every operation has finished; nothing is left
//   in flight when it returns or throws (buffers the caller frees afterwards are never written).
// - Short reads, EINTR and EAGAIN are retried until the bytes asked for are in; every completion
//   is checked. The first hard failure is thrown after the batch has drained.
// - Backends are not thread-safe and not fork-safe: BackendSlot (below) gives each process its own
//   and serialises callers.
// - The GIL is not touched here: callers release it around these calls.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace shadecache {

// A range of a file to read into `dest` (exactly `len` bytes). `fd` names the file when it is
// not the call's (the SSD tier reads many open files in one batch; buffered reads only).
struct RangeRead {
  uint64_t offset;
  uint32_t len;
  char* dest;
  int fd = -1;
};

// A whole file to read: open, size with fstat, read, close. Filled in by the backend.
struct FileRead {
  const char* path = nullptr;
  std::unique_ptr<char[]> data;  // `size` bytes, uninitialised beyond them
  size_t size = 0;
  int err = 0;                   // errno of the failed step, 0 on success
  const char* failed_step = "";  // "open", "fstat", "read", "close"
};

// Called once per finished range, from the thread that saw it finish (a pool thread for the
// pread backend): must be thread-safe and must not throw. The reader verifies checksums here, so
// that checking overlaps with the reads still in flight.
using RangeDone = std::function<void(size_t index)>;

// Ranges handed to a backend one at a time while it reads (IoBackend::read_feed), so that one call
// can keep the device busy across what the caller sees as separate batches: the next batch's reads
// enter the queue while the last batch's tail is still in flight. Called only from the thread in
// read_feed; next() and done() must not throw.
class RangeFeed {
 public:
  virtual ~RangeFeed() = default;
  // The next range to read and the tag done() will get back; false when there is none now (the
  // backend then drains what is in flight and returns; it may ask again before that).
  virtual bool next(RangeRead& op, uint64_t& tag) = 0;
  // The range tagged `tag` is in: all its bytes are at op.dest.
  virtual void done(uint64_t tag) = 0;
  // The largest direct_span the ranges to come are expected to have (0: unknown), read when the
  // call starts. O_DIRECT bounce slots are sized by it (within a cap); a larger range gets a bounce
  // buffer of its own.
  virtual uint64_t span_hint() const { return 0; }
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;
  // True when only the thread that created the backend may use it (an io_uring ring set up with
  // SINGLE_ISSUER); usable_here() then says whether the calling thread is that one.
  virtual bool bound_to_thread() const { return false; }
  virtual bool usable_here() { return true; }

  // Reads every range of `fd`. With `direct` the fd was opened O_DIRECT: the backend reads the
  // aligned blocks that cover each range (direct_span bytes from align_down(offset)) into its own
  // aligned bounce buffers and copies `len` bytes to dest; the last blocks may end at end of file.
  // A read that hits end of file before the range's end throws kFormat (truncated file) naming
  // the offset.
  virtual void read_ranges(int fd, bool direct, RangeRead* ops, size_t n,
                           const RangeDone& done) = 0;

  // Reads the feed's ranges until next() says there are none and every read has finished, with
  // the same checks, retries and O_DIRECT widening as read_ranges; done(tag) is called as each
  // range is in. After the first hard failure no new range is asked for; the failure is thrown
  // once the reads in flight have drained (ranges not done() by then did not complete). io_uring
  // keeps its queue full across the whole call; the pread pool, whose threads land ranges
  // concurrently, has no feed (the read stream spreads there): this default throws kInvalidArgument.
  virtual void read_feed(int fd, bool direct, RangeFeed& feed);

  // Reads every file whole. Failures are recorded per file (err, failed_step), not thrown, so the
  // caller can name the path; only a failure of the backend itself throws.
  virtual void read_files(FileRead* ops, size_t n) = 0;

  // How the next read_ranges calls run: at most `max_inflight` reads in flight (never more than
  // the depth the backend was made with) and, with `submit_each`, every read handed to the kernel
  // alone as soon as it is queued, instead of the reads that are ready together in one system
  // call. The read stream switches these between batches (read_stream.h); a backend that cannot
  // (the pread pool) ignores them.
  virtual void set_submission(unsigned max_inflight, bool submit_each) {}
};

// Bytes an O_DIRECT read of `op` asks for: the aligned blocks that cover it (at least one).
inline uint64_t direct_span(const RangeRead& op) {
  constexpr uint64_t kBlock = 4096;  // store::kAlign
  uint64_t start = op.offset / kBlock * kBlock;
  uint64_t end = (op.offset + op.len + kBlock - 1) / kBlock * kBlock;
  return end > start ? end - start : kBlock;
}

enum class BackendKind { kAuto, kUring, kPread };

BackendKind parse_backend_kind(const std::string& s);  // "auto" | "io_uring" | "pread"

// Whether this build has io_uring support compiled in.
bool built_with_uring();

// One process's backend, created on first use in that process. After fork() the child finds a
// slot owned by its parent's pid and builds its own (the parent's ring and threads are not usable
// in the child, and are deliberately leaked there rather than torn down: their locks may be held).
// The first backend is bound to the thread that created it where the kernel allows (faster); any
// other thread reading through the slot shares a second, unbound ring.
class BackendSlot {
 public:
  BackendSlot(BackendKind kind, unsigned queue_depth);
  ~BackendSlot();

  // Runs fn(backend) with the per-process backend, callers serialised by a mutex. Throws kClosed
  // after close().
  void with(const std::function<void(IoBackend&)>& fn);
  // Destroys this process's backend now (its ring, or its share of the pread pool: the last store
  // of the process joins the pool's threads). Later calls of with() throw kClosed; name() and
  // fallback_reason() keep answering. Must not race with with() (the store's close contract).
  void close();

  // Name of the backend this process uses ("io_uring" or "pread"), creating it if needed.
  std::string name();
  // Why io_uring is not used ("" when it is, or when pread was asked for).
  std::string fallback_reason();
  pid_t owner_pid();  // pid that created the current backend (for tests of fork safety)
  unsigned queue_depth() const { return queue_depth_; }

 private:
  struct PerProcess {
    pid_t pid;
    std::mutex mu;
    std::unique_ptr<IoBackend> backend;  // may be bound to the thread that made it
    std::unique_ptr<IoBackend> shared;   // unbound ring for the other threads; guarded by mu
    std::string fallback_reason;
  };
  PerProcess* current();

  BackendKind kind_;
  unsigned queue_depth_;
  std::atomic<PerProcess*> slot_{nullptr};
  bool closed_ = false;
  std::string closed_name_, closed_reason_;  // what name()/fallback_reason() said before close()
};

}  // namespace shadecache
