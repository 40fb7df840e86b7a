#include "io/read_stream.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <system_error>

#include "common/error.h"
#include "io/checked_batch.h"
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
  // Make the first lane's backend here-and-now semantics visible: a refused io_uring with
  // kind == kUring must throw from the constructor, not from a lane. So the lanes are started
  // and the first one reports whether it could make its backend.
  std::exception_ptr first_error;
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
    if (backend_name_.empty()) {
      backend_name_ = backend->name();
      fallback_reason_ = reason;
      // The modes are io_uring's; the pread pool (each lane its own threads) always spreads.
      uring_ = backend_name_ == std::string("io_uring");
      if (!uring_) single_ = false;
      done_cv_.notify_all();
    }
  }
  for (;;) {
    std::shared_ptr<Batch> b;
    bool single;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // In the single mode only lane 0 takes batches, and only once no other lane runs one
      // (after a switch from spread): never more than queue_depth reads in flight.
      work_cv_.wait(lk, [&] {
        return stopping_ || (!queue_.empty() && (!single_ || (index == 0 && running() == 0)));
      });
      if (stopping_) return;
      b = std::move(queue_.front());
      queue_.pop_front();
      b->started = true;
      b->single = single = single_;
      if (mode_running_[single]++ == 0) mode_since_[single] = std::chrono::steady_clock::now();
      ++lane_batches_[index];
    }
    backend->set_submission(single ? queue_depth_ : lane_depth_, single);
    try {
      run(*b, *backend);
    } catch (...) {
      b->error = std::current_exception();
    }
    bool wake_lane0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      b->done = true;
      auto now = std::chrono::steady_clock::now();
      int m = b->single ? 1 : 0;
      if (--mode_running_[m] == 0)
        mode_busy_[m] += std::chrono::duration<double>(now - mode_since_[m]).count();
      mode_samples_[m] += b->ids.size();
      ++mode_batches_[m];
      count_batch_locked(now);
      wake_lane0 = single_ && running() == 0 && !queue_.empty();
    }
    done_cv_.notify_all();
    if (wake_lane0) work_cv_.notify_all();  // lane 0 waits for the others to finish (above)
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
    // A switch from single to spread happens with nothing running (only single batches end a
    // single epoch, and lane 0 runs one at a time), so spread never starts above queue_depth;
    // the other way, lane 0 waits until nothing runs (lane_main).
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
