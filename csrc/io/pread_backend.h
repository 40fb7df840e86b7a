// The fallback backend: a pool of threads doing blocking pread()s, used where io_uring is missing
// or refused. Concurrency comes from threads instead of a ring; the contract is io_backend.h's.
// Threads are started on first use (in the process that uses them) and joined by the destructor.
#pragma once

#include <memory>

#include "io/io_backend.h"

namespace shadecache {

std::unique_ptr<IoBackend> make_pread_backend(unsigned threads);

}  // namespace shadecache
