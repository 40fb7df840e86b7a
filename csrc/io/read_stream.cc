#include "io/read_stream.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <system_error>

#include "common/error.h"
#include "io/checked_batch.h"
#include "io/extent_read.h"
#include "io/pread_backend.h"
#include "io/uring_backend.h"

namespace shadecache {

ReadStream::Submission ReadStream::parse_submission(const std::string& s) {
  if (s == "auto") return Submission::kAuto;
  if (s == "spread") return Submission::kSpread;
  if (s == "single") return Submission::kSingle;
  throw Error(ErrorKind::kInvalidArgument,
              "submission must be 'auto', 'spread' or 'single', not '" + s + "'");
}

ReadStream::ReadStream(PackedReader& reader, BackendKind kind, unsigned queue_depth,
                       unsigned lanes, Submission submission)
    : reader_(reader), kind_(kind), pid_(::getpid()) {
  if (queue_depth < 1 || queue_depth > 4096)
    throw Error(ErrorKind::kInvalidArgument,
                "queue_depth must be in [1, 4096], not " + std::to_string(queue_depth));
  if (lanes < 1 || lanes > 16)
    throw Error(ErrorKind::kInvalidArgument, "lanes must be in [1, 16], not " + std::to_string(lanes));
  if (reader.closed()) throw Error(ErrorKind::kClosed, reader.path() + ": store is closed");
  lanes = std::min(lanes, queue_depth);
  lane_depth_ = (queue_depth + lanes - 1) / lanes;
  queue_depth_ = queue_depth;
  submission_ = submission;
  single_ = submission == Submission::kSingle;
  lane_batches_.assign(lanes, 0);
  // The file the store opened and validated (a dup shares its O_DIRECT flag), never whatever
  // the path names now (a re-pack renamed over it, a FIFO).
  fd_ = ::fcntl(reader.read_fd(), F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) throw_errno("dup " + reader.path(), errno);
  // Make lane 0's backend here-and-now semantics visible: a refused io_uring with kind == kUring
  // must throw from the constructor, not from a lane. So the lanes are started and lane 0
  // reports whether it could make its backend (any lane that could not stops the stream).
  bool first_ready = false;
  for (unsigned i = 0; i < lanes; ++i) {
    try {
      threads_.emplace_back([this, i] { lane_main(i); });
    } catch (const std::system_error& e) {
      close();
      throw Error(ErrorKind::kOs, "read stream: cannot start lane " + std::to_string(i + 1) +
                                      " of " + std::to_string(lanes) + ": " + e.code().message(),
                  e.code().value());
    }
  }
  {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return !backend_name_.empty() || stopping_; });
    first_ready = !backend_name_.empty();
  }
  if (!first_ready) {
    close();
    throw Error(ErrorKind::kOs, "io_uring: " + fallback_reason_);
  }
}

ReadStream::~ReadStream() { close(); }

void ReadStream::check_process() const {
  if (::getpid() != pid_)
    throw Error(ErrorKind::kInvalidArgument,
                "a ReadStream is used only in the process that made it (its threads do not "
                "survive fork); make a new one in this process");
}

void ReadStream::lane_main(unsigned index) {
  // The backend is made in the thread that uses it (an io_uring ring bound to it reads faster).
  // Lane 0's ring is as deep as the whole stream: it runs alone in the single mode.
  std::unique_ptr<IoBackend> backend;
  std::string reason;
  if (kind_ != BackendKind::kPread) {
    try {
      backend = make_uring_backend(index == 0 ? queue_depth_ : lane_depth_, /*bind_to_thread=*/true);
    } catch (const Error& e) {
      reason = e.what();
    }
  }
  if (!backend && kind_ != BackendKind::kUring) backend = make_pread_backend(std::min(lane_depth_, 64u));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!backend) {  // io_uring was demanded and refused: the constructor reports it
      fallback_reason_ = reason;
      stopping_ = true;
      done_cv_.notify_all();
      work_cv_.notify_all();
      return;
    }
    if (index == 0) {
      // Lane 0's backend is the stream's: the constructor reports it, and the single mode runs on
      // it. The modes are io_uring's; on the pread pool (whose threads land reads concurrently)
      // the stream always spreads, even where another lane's io_uring ring was made.
      backend_name_ = backend->name();
      fallback_reason_ = reason;
      uring_ = backend_name_ == std::string("io_uring");
      if (!uring_ && single_) {
        single_ = false;
        work_cv_.notify_all();  // the other lanes wait while the mode is single
      }
      done_cv_.notify_all();
    }
  }
  for (;;) {
    std::shared_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // In the single mode only lane 0 takes batches, and only once no other lane runs one
      // (after a switch from spread); in spread, no lane takes one while lane 0 still runs single
      // batches (after a switch from single): never more than queue_depth reads in flight.
      work_cv_.wait(lk, [&] {
        return stopping_ || (!queue_.empty() && (single_ ? index == 0 && running() == 0
                                                         : mode_running_[1] == 0));
      });
      if (stopping_) return;
      b = start_locked(index);
    }
    if (b->single) {
      backend->set_submission(queue_depth_, true);
      run_fed(std::move(b), *backend);
      continue;
    }
    backend->set_submission(lane_depth_, false);
    try {
      run(*b, *backend);
    } catch (...) {
      b->error = std::current_exception();
    }
    finish(*b);
  }
}

std::shared_ptr<ReadStream::Batch> ReadStream::start_locked(unsigned index) {
  std::shared_ptr<Batch> b = std::move(queue_.front());
  queue_.pop_front();
  b->started = true;
  b->single = single_;
  if (mode_running_[b->single]++ == 0) mode_since_[b->single] = std::chrono::steady_clock::now();
  ++lane_batches_[index];
  return b;
}

std::shared_ptr<ReadStream::Batch> ReadStream::start_next_single() {
  std::lock_guard<std::mutex> lk(mu_);
  // mode_running_[0]: a spread batch of a switch back and forth since lane 0 last looked.
  if (stopping_ || !single_ || queue_.empty() || mode_running_[0] > 0) return nullptr;
  return start_locked(0);
}

void ReadStream::finish(Batch& b) {
  bool wake;
  {
    std::lock_guard<std::mutex> lk(mu_);
    b.done = true;
    auto now = std::chrono::steady_clock::now();
    int m = b.single ? 1 : 0;
    if (--mode_running_[m] == 0)
      mode_busy_[m] += std::chrono::duration<double>(now - mode_since_[m]).count();
    mode_samples_[m] += b.ids.size();
    ++mode_batches_[m];
    count_batch_locked(now);
    // The lanes that wait for the others to finish (lane_main's wait) may go on now.
    wake = !queue_.empty() && (single_ ? running() == 0 : mode_running_[1] == 0);
  }
  done_cv_.notify_all();
  if (wake) work_cv_.notify_all();
}

// Lane 0's reads in the single mode: the batch it took and each batch queued while its reads run,
// all in one backend call (read_feed), so the ring never drains between batches; each batch is
// done as soon as its last extent has landed. Batches are opened as their first range is asked for
// and closed from the front as they finish (they finish about in order: ranges go out in order).
class ReadStream::SingleFeed final : public RangeFeed {
 public:
  SingleFeed(ReadStream& stream, std::shared_ptr<Batch> first) : s_(stream) { open(std::move(first)); }

  bool next(RangeRead& op, uint64_t& tag) override {
    for (;;) {
      if (!open_.empty()) {
        Open& o = open_.back();
        if (o.reads && o.next < o.reads->ops().size()) {
          uint32_t seq = base_ + static_cast<uint32_t>(open_.size() - 1);
          op = o.reads->ops()[o.next];
          tag = (uint64_t{seq} << 32) | o.next++;
          return true;
        }
      }
      std::shared_ptr<Batch> b = s_.start_next_single();
      if (!b) return false;
      open(std::move(b));
    }
  }

  void done(uint64_t tag) override {
    Open& o = open_[static_cast<uint32_t>(tag >> 32) - base_];
    o.reads->land(static_cast<size_t>(tag & 0xffffffffu));
    if (--o.left == 0) close(o);
    while (!open_.empty() && open_.front().closed) {
      open_.pop_front();
      ++base_;
    }
  }

  uint64_t span_hint() const override { return span_; }

  // After read_feed threw: each batch not finished is read again alone, so that the failure goes
  // to the batch it belongs to and the others are read whole.
  void rerun_unfinished(IoBackend& backend) {
    for (Open& o : open_) {
      if (o.closed) continue;
      try {
        s_.run(*o.b, backend);
      } catch (...) {
        o.b->error = std::current_exception();
      }
      o.closed = true;
      s_.finish(*o.b);
    }
    open_.clear();
  }

 private:
  struct Open {
    std::shared_ptr<Batch> b;
    std::unique_ptr<CheckedBatch> check;
    std::unique_ptr<ExtentBatch> reads;
    std::unique_ptr<char[]> scratch;
    size_t next = 0;  // ranges handed to the backend
    size_t left = 0;  // ranges not landed
    bool closed = false;
  };

  // Never throws (next() must not): a batch that cannot be planned fails alone.
  void open(std::shared_ptr<Batch> b) {
    try {
      open_.emplace_back();
    } catch (...) {
      b->error = std::current_exception();
      s_.finish(*b);
      return;
    }
    Open& o = open_.back();
    o.b = std::move(b);
    try {
      PackedReader& r = s_.reader_;
      o.check = std::make_unique<CheckedBatch>(r.directory(), o.b->ids.data(), o.b->ids.size(),
                                               o.b->dests.data(), r.verify());
      o.reads = std::make_unique<ExtentBatch>(*o.check, r.direct(), r.shape());
      if (o.reads->scratch_bytes()) {
        o.scratch.reset(new char[o.reads->scratch_bytes()]);
        o.reads->place(o.scratch.get());
      }
      o.left = o.reads->ops().size();
      span_ = std::max(span_, o.reads->max_span());
    } catch (...) {
      o.b->error = std::current_exception();
      o.reads.reset();
      o.left = 0;
    }
    if (o.left == 0) close(o);
  }

  // Every extent of the batch has landed (or it failed to open): checks it, counts it, frees its
  // buffers (the batch may wait at the front of open_ for the ones before it) and finishes it.
  void close(Open& o) {
    if (!o.b->error) {
      o.reads->count(&s_.reader_.counters());
      try {
        o.check->throw_if_corrupt(s_.reader_.path());
      } catch (...) {
        o.b->error = std::current_exception();
      }
    }
    o.reads.reset();
    o.check.reset();
    o.scratch.reset();
    o.closed = true;
    s_.finish(*o.b);
  }

  ReadStream& s_;
  std::deque<Open> open_;
  uint32_t base_ = 0;  // the sequence number of open_.front() (tags carry it, modulo 2^32)
  uint64_t span_ = 0;
};

void ReadStream::run_fed(std::shared_ptr<Batch> first, IoBackend& backend) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++single_calls_;
  }
  SingleFeed feed(*this, std::move(first));
  try {
    backend.read_feed(fd_, reader_.direct(), feed);
  } catch (...) {
    feed.rerun_unfinished(backend);
  }
}

void ReadStream::count_batch_locked(std::chrono::steady_clock::time_point now) {
  if (submission_ != Submission::kAuto || !uring_) return;
  int m = single_ ? 1 : 0;
  if (mode_batches_[m] < kEpochBatches) return;
  double secs = mode_busy_[m] + (mode_running_[m] > 0
                                     ? std::chrono::duration<double>(now - mode_since_[m]).count()
                                     : 0.0);
  if (secs < kEpochSeconds) return;
  double rate = static_cast<double>(mode_samples_[m]) / secs;
  // A moving average over about four epochs: the device's pace wanders from second to second.
  rate_[m] = measured_[m] ? 0.75 * rate_[m] + 0.25 * rate : rate;
  measured_[m] = true;
  ++epochs_;
  mode_busy_[m] = 0;
  if (mode_running_[m] > 0) mode_since_[m] = now;
  mode_samples_[m] = 0;
  mode_batches_[m] = 0;
  // The other mode when it has not been measured yet or its turn to be tried again has come;
  // else the faster one.
  int other = 1 - m;
  int next = !measured_[other] || epochs_ % kExploreEvery == 0 ? other
             : rate_[other] > rate_[m]                         ? other
                                                               : m;
  if (next != m) {
    // Either way the lanes of the new mode wait until no batch of the old one runs (lane_main),
    // so the stream never has more than queue_depth reads in flight.
    single_ = next == 1;
    ++switches_;
    work_cv_.notify_all();  // spread: the other lanes take batches again
  }
}

void ReadStream::run(Batch& b, IoBackend& backend) {
  CheckedBatch batch(reader_.directory(), b.ids.data(), b.ids.size(), b.dests.data(), reader_.verify());
  read_samples(backend, fd_, reader_.direct(), batch, reader_.shape(), &reader_.counters());
  batch.throw_if_corrupt(reader_.path());
}

uint64_t ReadStream::submit(std::vector<int64_t> ids, std::vector<char*> dests) {
  check_process();
  if (ids.size() != dests.size())
    throw Error(ErrorKind::kInvalidArgument, "submit: ids and destinations differ in length");
  auto b = std::make_shared<Batch>();
  b->ids = std::move(ids);
  b->dests = std::move(dests);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw Error(ErrorKind::kClosed, "the read stream is closed");
    b->ticket = next_ticket_++;
    queue_.push_back(b);
    results_.push_back(b);
  }
  // All: in the single mode only lane 0 may take it, and one wake-up could go to another lane,
  // which would go back to sleep and leave the batch waiting for the next submit.
  work_cv_.notify_all();
  return b->ticket;
}

uint64_t ReadStream::take() {
  check_process();
  std::shared_ptr<Batch> b;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (results_.empty())
      throw Error(ErrorKind::kInvalidArgument, "take: no batch is pending");
    b = results_.front();
    // After close(), a batch a lane has started is still being written: wait for it.
    done_cv_.wait(lk, [&] { return b->done || (stopping_ && !b->started); });
    if (!b->done) throw Error(ErrorKind::kClosed, "the read stream is closed");
    results_.pop_front();
  }
  if (b->error) std::rethrow_exception(b->error);
  return b->ticket;
}

size_t ReadStream::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return results_.size();
}

std::string ReadStream::backend_name() const {
  std::lock_guard<std::mutex> lk(mu_);
  return backend_name_;
}

std::string ReadStream::submission_mode() const {
  std::lock_guard<std::mutex> lk(mu_);
  return single_ ? "single" : "spread";
}

uint64_t ReadStream::mode_switches() const {
  std::lock_guard<std::mutex> lk(mu_);
  return switches_;
}

std::vector<double> ReadStream::mode_rates() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {measured_[0] ? rate_[0] : 0.0, measured_[1] ? rate_[1] : 0.0};
}

std::vector<uint64_t> ReadStream::lane_batches() const {
  std::lock_guard<std::mutex> lk(mu_);
  return lane_batches_;
}

uint64_t ReadStream::single_calls() const {
  std::lock_guard<std::mutex> lk(mu_);
  return single_calls_;
}

std::string ReadStream::fallback_reason() const {
  std::lock_guard<std::mutex> lk(mu_);
  return fallback_reason_;
}

void ReadStream::close() {
  if (::getpid() != pid_) {  // a forked child: the threads are not here (see the header)
    if (!threads_.empty()) new std::vector<std::thread>(std::move(threads_));  // leaked on purpose
    threads_.clear();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    queue_.clear();
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace shadecache
