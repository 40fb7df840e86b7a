// io_uring backend (liburing). One ring per process (BackendSlot sees to that), up to
// `queue_depth` operations in flight, every completion checked, short reads and -EAGAIN requeued.
// For O_DIRECT it reads into an aligned bounce arena registered with the ring (READ_FIXED: the
// kernel does not pin and unpin the pages on every read); for buffered reads it reads straight
// into the caller's buffers.
#pragma once

#include <memory>

#include "io/io_backend.h"

namespace shadecache {

// Creates the backend; throws Error(kOs, ..., errno) when io_uring is missing (ENOSYS), refused
// (EPERM: seccomp, io_uring_disabled sysctl) or not compiled in. SHADECACHE_IOURING_DISABLE=1 in
// the environment makes it fail with EPERM, as a seccomp filter would (for tests of the fallback).
// bind_to_thread: set the ring up with SINGLE_ISSUER | DEFER_TASKRUN (faster, see the .cc) where
// the kernel has them; only the creating thread may then use it (IoBackend::usable_here()).
std::unique_ptr<IoBackend> make_uring_backend(unsigned queue_depth, bool bind_to_thread);

}  // namespace shadecache
