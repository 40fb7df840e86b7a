// The fallback backend: a pool of threads doing blocking pread()s, used where io_uring is missing
// or refused. Concurrency comes from threads instead of a ring; the contract is io_backend.h's.
// The threads belong to one pool per process, sized to the machine (min(64, max(16, 8 x cores));
// SHADECACHE_PREAD_THREADS overrides it), shared by every pread-backend store of the process and
// started on its first read; the last backend destroyed (the last store closed) joins them.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>

#include "io/io_backend.h"

namespace shadecache {

// `parallel`: how many reads of one batch may be in flight at once (the store's queue depth; the
// pool's size caps it).
std::unique_ptr<IoBackend> make_pread_backend(unsigned parallel);

// Reads exactly n bytes at off with blocking pread(), retrying EINTR/EAGAIN and short reads.
// Returns the bytes read (< n only at end of file) or -errno. The one such loop of the project
// (the pool's reads, the store's open, the SSD tier's re-read of a failed value).
ssize_t pread_full(int fd, char* buf, size_t n, uint64_t off);

}  // namespace shadecache
