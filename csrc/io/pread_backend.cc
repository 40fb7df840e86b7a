#include "io/pread_backend.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "common/error.h"
#include "io/store_format.h"

namespace shadecache {

namespace {

// Reads up to `want` bytes at off, retrying EINTR/EAGAIN and short reads until `need` bytes are
// in or end of file. For O_DIRECT need < want: the read of the last aligned blocks ends early at
// end of file (and a retry at the unaligned end would be EINVAL).
ssize_t pread_direct(int fd, char* buf, size_t want, uint64_t off, size_t need) {
  size_t got = 0;
  while (got < need) {
    ssize_t r = ::pread(fd, buf + got, want - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

}  // namespace

ssize_t pread_full(int fd, char* buf, size_t n, uint64_t off) { return pread_direct(fd, buf, n, off, n); }

namespace {

// An aligned buffer per thread for O_DIRECT reads, grown on demand.
struct Bounce {
  char* p = nullptr;
  size_t n = 0;
  ~Bounce() { std::free(p); }
  char* get(size_t want) {
    if (want > n) {
      std::free(p);
      p = nullptr;
      n = 0;
      void* q = nullptr;
      if (posix_memalign(&q, store::kAlign, want) != 0) return nullptr;
      p = static_cast<char*>(q);
      n = want;
    }
    return p;
  }
};

// The process's thread pool. One per process, shared by every pread-backend store of that process
// (reference-counted: the last store to close joins its threads, so no thread outlives the stores
// that use it). Jobs from different stores are serialised by job_mu_.
class ThreadPool {
 public:
  explicit ThreadPool(unsigned threads) : nthreads_(std::max(1u, threads)) {}

  ~ThreadPool() { stop(); }

  unsigned size() const { return nthreads_; }

  // Runs fn(i) for every i in [0, n) on at most `parallel` threads (the caller's included); returns
  // when all are done; rethrows the first exception fn threw (later indices are skipped once one
  // has failed). Throws kOs when a thread of the pool cannot be started (nothing has run then).
  // Several callers (stores, threads, stream lanes) run at once: idle pool threads join whichever
  // job still wants helpers, so one store's batch never waits for another's to finish.
  void run(size_t n, unsigned parallel, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    start_threads();
    Job job;
    job.fn = &fn;
    job.n = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job.want = static_cast<unsigned>(
          std::min<size_t>({threads_.size(), n - 1, std::max(1u, parallel) - 1}));
      if (job.want > 0) jobs_.push_back(&job);
    }
    if (job.want > 0) cv_work_.notify_all();
    job.body();
    {
      std::unique_lock<std::mutex> lk(mu_);
      job.want = 0;  // no helper joins from now on
      jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), &job), jobs_.end());
      cv_done_.wait(lk, [&] { return job.busy == 0; });
    }
    if (job.first) std::rethrow_exception(job.first);
  }

 private:
  struct Job {
    const std::function<void(size_t)>* fn = nullptr;
    size_t n = 0;
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::exception_ptr first;
    unsigned want = 0;  // helpers still wanted; guarded by the pool's mu_
    unsigned busy = 0;  // helpers inside body(); guarded by the pool's mu_
    void body() {
      for (;;) {
        size_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= n || failed.load(std::memory_order_relaxed)) return;
        try {
          (*fn)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(err_mu);
          if (!first) first = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
    }
  };

  // A thread that cannot start (EAGAIN: RLIMIT_NPROC, or no address space for its stack) stops
  // the ones already started and is an OSError naming the cause.
  void start_threads() {
    std::lock_guard<std::mutex> start_lk(start_mu_);
    if (started_ || nthreads_ <= 1) return;
    std::vector<std::thread> made;
    for (unsigned t = 0; t + 1 < nthreads_; ++t) {
      try {
        made.emplace_back([this] { worker(); });
      } catch (const std::system_error& e) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          quit_ = true;
        }
        cv_work_.notify_all();
        for (auto& th : made) th.join();
        std::lock_guard<std::mutex> lk(mu_);
        quit_ = false;
        throw Error(ErrorKind::kOs,
                    "pread pool: cannot start thread " + std::to_string(t + 1) + " of " +
                        std::to_string(nthreads_ - 1) + ": " + e.code().message() +
                        " (process limits on threads or address space)",
                    e.code().value());
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    threads_ = std::move(made);
    started_ = true;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  Job* wanted() {  // with mu_ held
    for (Job* j : jobs_)
      if (j->want > 0) return j;
    return nullptr;
  }

  void worker() {
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return quit_ || wanted() != nullptr; });
        if (quit_) return;
        job = wanted();
        --job->want;
        ++job->busy;
      }
      job->body();
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--job->busy == 0) cv_done_.notify_all();
      }
    }
  }

  unsigned nthreads_;
  std::mutex start_mu_;  // taken before mu_
  bool started_ = false;
  std::vector<std::thread> threads_;  // written under start_mu_ and mu_
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::vector<Job*> jobs_;  // jobs that may still want helpers; guarded by mu_
  bool quit_ = false;
};

// Sized to the machine, not to the queue depth: blocking preads want several threads per core to
// keep a device's queue busy (fewer read measurably less), and 64 per store (the old rule) made a
// process with many stores hold thousands of threads (docs/store_format.md, "The fallback: pread
// thread pool").
// SHADECACHE_PREAD_THREADS (1-256) overrides it, for devices that want a deeper queue.
unsigned machine_pool_size() {
  if (const char* env = std::getenv("SHADECACHE_PREAD_THREADS")) {
    long n = std::strtol(env, nullptr, 10);
    if (n >= 1 && n <= 256) return static_cast<unsigned>(n);
  }
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::min(64u, std::max(16u, 8 * cores));
}

// The pool of this process, created on first use. A forked child finds its parent's pool (whose
// threads do not exist in the child) under another pid and makes its own; the parent's is left
// alone (its stores are leaked in the child, see BackendSlot).
std::shared_ptr<ThreadPool> process_pool() {
  static std::mutex mu;
  static std::weak_ptr<ThreadPool> pool;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lk(mu);
  std::shared_ptr<ThreadPool> p;
  if (owner == ::getpid()) p = pool.lock();
  if (!p) {
    p = std::make_shared<ThreadPool>(machine_pool_size());
    pool = p;
    owner = ::getpid();
  }
  return p;
}

class PreadBackend final : public IoBackend {
 public:
  explicit PreadBackend(unsigned parallel) : parallel_(std::max(1u, parallel)), pool_(process_pool()) {}

  const char* name() const override { return "pread"; }

  void read_ranges(int fd, bool direct, RangeRead* ops, size_t n, const RangeDone& done) override {
    pool_->run(n, parallel_, [&](size_t i) {
      const RangeRead& op = ops[i];
      ssize_t r;
      if (direct) {  // the aligned blocks that cover the range; the last may end at end of file
        static thread_local Bounce bounce;
        size_t want = direct_span(op);
        size_t skip = op.offset % store::kAlign;
        char* buf = bounce.get(want);
        if (buf == nullptr)
          throw Error(ErrorKind::kCapacity, "pread: cannot allocate an O_DIRECT buffer");
        r = pread_direct(fd, buf, want, store::align_down(op.offset), skip + op.len);
        if (r >= static_cast<ssize_t>(skip + op.len)) std::memcpy(op.dest, buf + skip, op.len);
        r = r < 0 ? r : std::max<ssize_t>(0, r - static_cast<ssize_t>(skip));
      } else {
        r = pread_full(op.fd >= 0 ? op.fd : fd, op.dest, op.len, op.offset);
      }
      if (r < 0)
        throw Error(ErrorKind::kOs,
                    "pread of " + std::to_string(op.len) + " bytes at offset " +
                        std::to_string(op.offset) + ": " + std::strerror(static_cast<int>(-r)),
                    static_cast<int>(-r));
      if (r < static_cast<ssize_t>(op.len))
        throw Error(ErrorKind::kFormat, "data file truncated: end of file at offset " +
                                            std::to_string(op.offset + r) + " while reading " +
                                            std::to_string(op.len) + " bytes at offset " +
                                            std::to_string(op.offset));
      done(i);
    });
  }

  void read_files(FileRead* ops, size_t n) override {
    pool_->run(n, parallel_, [&](size_t i) {
      FileRead& op = ops[i];
      // Non-blocking, so that a FIFO among the files fails at fstat instead of waiting for a
      // writer; regular files ignore the flag.
      int fd = ::open(op.path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0) {
        op.err = errno;
        op.failed_step = "open";
        return;
      }
      struct stat st;
      if (::fstat(fd, &st) != 0) {
        op.err = errno;
        op.failed_step = "fstat";
      } else if (!S_ISREG(st.st_mode)) {
        op.err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;  // not a regular file
        op.failed_step = "fstat";
      } else if (st.st_size > 0 && !(op.data.reset(new (std::nothrow) char[st.st_size]), op.data)) {
        op.err = ENOMEM;  // a huge file: this one fails, the fd is still closed below
        op.failed_step = "read";
      } else if (st.st_size > 0) {
        ssize_t r = pread_full(fd, op.data.get(), static_cast<size_t>(st.st_size), 0);
        if (r < 0) {
          op.err = static_cast<int>(-r);
          op.failed_step = "read";
        } else {
          op.size = static_cast<size_t>(r);  // fewer if the file shrank since fstat
        }
      }
      if (::close(fd) != 0 && op.err == 0) {
        op.err = errno;
        op.failed_step = "close";
      }
    });
  }

 private:
  unsigned parallel_;  // the store's queue depth: reads in flight at once
  std::shared_ptr<ThreadPool> pool_;
};

}  // namespace

std::unique_ptr<IoBackend> make_pread_backend(unsigned parallel) {
  return std::make_unique<PreadBackend>(parallel);
}

}  // namespace shadecache
