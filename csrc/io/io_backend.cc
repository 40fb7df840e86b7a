#include "io/io_backend.h"

#include <unistd.h>

#include <string>

#include "common/error.h"
#include "io/pread_backend.h"
#include "io/uring_backend.h"

namespace shadecache {

BackendKind parse_backend_kind(const std::string& s) {
  if (s == "auto") return BackendKind::kAuto;
  if (s == "io_uring") return BackendKind::kUring;
  if (s == "pread") return BackendKind::kPread;
  throw Error(ErrorKind::kInvalidArgument,
              "backend must be 'auto', 'io_uring' or 'pread', not '" + s + "'");
}

bool built_with_uring() {
#ifdef SHADECACHE_HAVE_LIBURING
  return true;
#else
  return false;
#endif
}

void IoBackend::read_feed(int, bool, RangeFeed&) {
  throw Error(ErrorKind::kInvalidArgument,
              std::string(name()) + ": reads ranges only in whole batches (read_ranges), not from a feed");
}

BackendSlot::BackendSlot(BackendKind kind, unsigned queue_depth)
    : kind_(kind), queue_depth_(queue_depth) {
  if (queue_depth < 1 || queue_depth > 4096)
    throw Error(ErrorKind::kInvalidArgument,
                "queue_depth must be in [1, 4096], not " + std::to_string(queue_depth));
}

BackendSlot::~BackendSlot() {
  PerProcess* p = slot_.load(std::memory_order_acquire);
  // Another process's backend (we are a forked child) is leaked on purpose: see the class comment.
  if (p != nullptr && p->pid == ::getpid()) delete p;
}

void BackendSlot::close() {
  if (closed_) return;
  PerProcess* p = slot_.load(std::memory_order_acquire);
  if (p != nullptr) {
    closed_name_ = p->backend->name();
    closed_reason_ = p->fallback_reason;
    if (p->pid == ::getpid()) delete p;  // else our parent's (a forked child): leaked, see above
  }
  slot_.store(nullptr, std::memory_order_release);
  closed_ = true;
}

BackendSlot::PerProcess* BackendSlot::current() {
  if (closed_) throw Error(ErrorKind::kClosed, "the store is closed");
  pid_t me = ::getpid();
  PerProcess* p = slot_.load(std::memory_order_acquire);
  if (p != nullptr && p->pid == me) return p;
  auto fresh = std::make_unique<PerProcess>();
  fresh->pid = me;
  if (kind_ != BackendKind::kPread) {
    try {
      fresh->backend = make_uring_backend(queue_depth_, /*bind_to_thread=*/true);
    } catch (const Error& e) {
      if (kind_ == BackendKind::kUring) throw;
      fresh->fallback_reason = e.what();
    }
  }
  if (!fresh->backend) fresh->backend = make_pread_backend(queue_depth_);
  // Release: a thread that loads the pointer sees a fully built PerProcess.
  if (slot_.compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel)) {
    return fresh.release();  // the old one, if any, belonged to the parent: leaked
  }
  return p;  // another thread of this process installed one first; `fresh` is discarded
}

void BackendSlot::with(const std::function<void(IoBackend&)>& fn) {
  PerProcess* p = current();
  std::lock_guard<std::mutex> lk(p->mu);
  IoBackend* b = p->backend.get();
  if (b->bound_to_thread() && !b->usable_here()) {
    if (!p->shared) p->shared = make_uring_backend(queue_depth_, /*bind_to_thread=*/false);
    b = p->shared.get();
  }
  fn(*b);
}

std::string BackendSlot::name() { return closed_ ? closed_name_ : current()->backend->name(); }
std::string BackendSlot::fallback_reason() {
  return closed_ ? closed_reason_ : current()->fallback_reason;
}
pid_t BackendSlot::owner_pid() { return current()->pid; }

}  // namespace shadecache
