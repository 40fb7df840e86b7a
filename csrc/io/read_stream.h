// A read stream over a packed store: batches of sample ids go in, their bytes come out in the
// order the batches went in, and the device never sees the end of a batch.
//
// Why: a backend call (io_backend.h) drains its queue before it returns, so the last reads of
// every batch run at a falling queue depth (measured: read_many(256) of 4 KB O_DIRECT reads at
// 0.78x of fio's IOPS, read_many(4096) at fio). The stream keeps `lanes` threads, each with its
// own backend (its own io_uring ring, or pread pool where io_uring is refused) made in that thread,
// each taking the next queued batch as soon as its last one has drained: while one lane runs the
// tail of batch k, the others run batches k+1, ... at full depth. Each lane keeps at most
// ceil(queue_depth / lanes) reads in flight, so the stream as a whole never has more than
// queue_depth in flight, as one read_many(queue_depth) would.
//
// Contract:
// - submit() and take() may be called from one thread at a time (the caller serialises them);
//   take() returns batches in submission order. Nothing here touches Python: the bindings release
//   the GIL around take()'s wait, and the lanes never hold it.
// - The destination buffers of a batch must stay valid until take() has returned that batch, or
//   until close() has returned (close waits for the batches in flight; the ones not started are
//   dropped).
// - A failed batch (I/O error, truncated file, checksum mismatch with verify) is thrown by the
//   take() that returns it, with the same error read_many would throw; later batches go on.
// - Not fork-safe: the lanes exist only in the process that made the stream (checked: a forked
//   child's submit/take throw kInvalidArgument).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_backend.h"
#include "io/packed_reader.h"

namespace shadecache {

class ReadStream {
 public:
  // `reader` must outlive the stream (the bindings keep it alive). Opens its own descriptors of
  // the store file (O_DIRECT when the reader reads direct).
  ReadStream(PackedReader& reader, BackendKind kind, unsigned queue_depth, unsigned lanes);
  ~ReadStream();
  ReadStream(const ReadStream&) = delete;
  ReadStream& operator=(const ReadStream&) = delete;

  // Queues a batch: sample ids[k] goes to dests[k] (reader.entry(ids[k]).length bytes; ids
  // already range-checked by the caller). Returns its ticket (0, 1, 2, ... in submission order).
  uint64_t submit(std::vector<int64_t> ids, std::vector<char*> dests);
  // Waits for the oldest batch not yet taken; returns its ticket or throws its error.
  // kInvalidArgument when nothing is pending.
  uint64_t take();
  size_t pending() const;  // batches submitted and not yet taken
  unsigned lanes() const { return static_cast<unsigned>(threads_.size()); }
  unsigned lane_depth() const { return lane_depth_; }
  std::string backend_name() const;  // of the lanes' backends ("io_uring" or "pread")
  std::string fallback_reason() const;
  // Stops the lanes: batches in flight finish, queued ones are dropped. Idempotent.
  void close();
  // False in a forked child: there the stream must be leaked, not destroyed (its condition
  // variables still count the parent's lanes as waiters, and destroying them waits forever).
  bool in_owner_process() const { return ::getpid() == pid_; }

 private:
  struct Batch {
    uint64_t ticket;
    std::vector<int64_t> ids;
    std::vector<char*> dests;
    bool done = false;
    bool started = false;  // taken by a lane (guarded by mu_)
    std::exception_ptr error;
  };
  void lane_main();
  void run(Batch& b, IoBackend& backend);
  void check_process() const;

  PackedReader& reader_;
  BackendKind kind_;
  unsigned lane_depth_;
  int fd_ = -1;
  pid_t pid_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Batch>> queue_;    // submitted, not started
  std::deque<std::shared_ptr<Batch>> results_;  // submitted, not taken (submission order)
  uint64_t next_ticket_ = 0;
  bool stopping_ = false;
  std::string backend_name_, fallback_reason_;  // set by the first lane that made a backend
  std::vector<std::thread> threads_;
};

}  // namespace shadecache
