// A read stream over a packed store: batches of sample ids go in, their bytes come out in the
// order the batches went in, and the device never sees the end of a batch.
//
// Why: a backend call (io_backend.h) drains its queue before it returns, so the last reads of
// every batch run at a falling queue depth (measured: a read_many of a few hundred 4 KB O_DIRECT
// reads falls short of fio's IOPS, one of thousands reaches it; docs/benchmark_history.md,
// "Packed sample store: rerun while the disk was faster"). The stream keeps `lanes` threads, each
// with its own backend (its own io_uring ring, or pread pool where io_uring is refused) made in
// that thread, each taking the next queued batch as soon as its last one has drained: while one
// lane runs the tail of batch k, the others run batches k+1, ... at full depth. Each lane keeps
// at most ceil(queue_depth / lanes) reads in flight, so the stream as a whole never has more than
// queue_depth in flight, as one read_many(queue_depth) would.
//
// Submission modes (io_uring only; the pread pool always spreads):
// - spread: every lane runs batches, ceil(queue_depth / lanes) reads in flight each, the reads
//   that are ready together handed to the kernel in one system call;
// - single: lane 0 alone runs batches, queue_depth reads in flight, each read handed to the kernel
//   alone as soon as it is queued (one io_uring_enter per read, as fio does). Lane 0 feeds every
//   batch queued while its reads run into the same backend call (IoBackend::read_feed), so the
//   ring does not drain at the end of a batch either.
// - auto: measures which of the two is faster and runs it.
// single is the default: on this project's VM disk, whose pace flips between two states, it was
// the fastest of the three modes in every run, at 4 KB and at 128 KB (docs/benchmark_history.md,
// "The single mode feeds queued batches into one call"). Before lane 0 fed batches into one
// call, single drained its ring at each batch's end and lost to spread in the disk's slow state
// (docs/benchmark_history.md, "The stream submits each read alone when that is faster"): that is
// why auto exists. It runs a mode for an epoch (at least kEpochBatches batches and
// kEpochSeconds of time while a batch runs: a stream nobody feeds is not slow), keeps a moving
// average of each mode's samples per second, runs the faster one and tries the other for one
// epoch in every kExploreEvery. Each batch counts for the mode it started in. (Epochs by time
// too: counted in batches alone, an epoch of large samples lasted so long that a short stream
// spent much of its time trying the slower mode.) On a switch to single, lane 0 waits for the
// other lanes' batches to finish, and on a switch to spread the lanes wait for lane 0's single
// batches, so the stream never has more than queue_depth reads in flight.
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

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/io_backend.h"
#include "io/packed_reader.h"

namespace shadecache {

class ReadStream {
 public:
  // `reader` must outlive the stream (the bindings keep it alive). Opens its own descriptors of
  // the store file (O_DIRECT when the reader reads direct).
  enum class Submission { kAuto, kSpread, kSingle };
  static Submission parse_submission(const std::string& s);  // "auto" | "spread" | "single"
  static constexpr unsigned kEpochBatches = 4;
  static constexpr double kEpochSeconds = 0.025;
  static constexpr unsigned kExploreEvery = 16;

  ReadStream(PackedReader& reader, BackendKind kind, unsigned queue_depth, unsigned lanes,
             Submission submission = Submission::kSingle);
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
  // The mode the lanes run now ("spread" or "single"), and how many times auto switched.
  std::string submission_mode() const;
  uint64_t mode_switches() const;
  // auto's moving averages of samples per busy second, {spread, single} (0: not measured yet),
  // and the batches each lane has run.
  std::vector<double> mode_rates() const;
  std::vector<uint64_t> lane_batches() const;
  // Backend calls lane 0 made in the single mode: fewer than the batches it ran when batches were
  // queued behind each other.
  uint64_t single_calls() const;
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
    bool single = false;   // the mode it ran in (guarded by mu_)
    std::exception_ptr error;
  };
  class SingleFeed;
  void lane_main(unsigned index);
  // Takes the queue's front batch for lane `index` in the current mode (mu_ held).
  std::shared_ptr<Batch> start_locked(unsigned index);
  // The next batch for lane 0's single-mode call, or null when it should drain (stopping, the
  // mode switched to spread, nothing queued). Takes mu_.
  std::shared_ptr<Batch> start_next_single();
  // Marks a batch done and counts it (takes mu_); wakes take() and the lanes waiting for it.
  void finish(Batch& b);
  void run(Batch& b, IoBackend& backend);                    // one batch, one backend call
  void run_fed(std::shared_ptr<Batch> first, IoBackend& backend);  // single mode (SingleFeed)
  // With mu_ held, after a batch finished: at the end of the current mode's epoch, chooses the
  // next epoch's mode (auto only).
  void count_batch_locked(std::chrono::steady_clock::time_point now);
  void check_process() const;
  // Batches taken by a lane and not done (mu_ held).
  unsigned running() const { return mode_running_[0] + mode_running_[1]; }

  PackedReader& reader_;
  BackendKind kind_;
  unsigned lane_depth_;
  unsigned queue_depth_;
  Submission submission_;
  int fd_ = -1;
  pid_t pid_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Batch>> queue_;    // submitted, not started
  std::deque<std::shared_ptr<Batch>> results_;  // submitted, not taken (submission order)
  uint64_t next_ticket_ = 0;
  bool stopping_ = false;
  // The submission mode and auto's measurements (guarded by mu_).
  bool single_ = false;                  // the mode now: single (true) or spread
  bool uring_ = false;                   // the lanes' backend is io_uring (modes apply)
  // Per mode ([spread, single], by the mode a batch started in): an epoch's time is the time a
  // batch of that mode was running (a stream nobody feeds is not slow, and the drain before a
  // switch to single is not single's), its samples those of its own batches. A batch that
  // straddles a switch brings its time and samples to its own mode's next epoch.
  unsigned mode_running_[2] = {0, 0};
  std::chrono::steady_clock::time_point mode_since_[2];  // when mode_running_ last rose from 0
  double mode_busy_[2] = {0, 0};         // seconds busy in the epoch before mode_since_
  uint64_t mode_samples_[2] = {0, 0};
  unsigned mode_batches_[2] = {0, 0};
  std::vector<uint64_t> lane_batches_;   // batches run, per lane
  uint64_t epochs_ = 0, switches_ = 0, single_calls_ = 0;
  double rate_[2] = {0, 0};              // moving average of samples/s: [spread, single]
  bool measured_[2] = {false, false};
  std::string backend_name_, fallback_reason_;  // lane 0's backend (set once lane 0 made it)
  std::vector<std::thread> threads_;
};

}  // namespace shadecache
