// crc32c of a whole sample, computed over three interleaved streams.
//
// Same result as shadecache::crc32c() (common/crc32c.h), about 2-3x faster on large inputs: the
// SSE4.2 crc32 instruction has a 3-cycle latency and 1-cycle throughput, so one dependency chain
// leaves two thirds of it idle. Reading a store verifies every sample, and on a 1-core machine
// that checksum is the largest CPU cost of a 128 KB read after the copy (docs/store_format.md).
// Belongs in common/crc32c.cc (where the cache's checksums would gain too); it lives here until
// that file's owner takes it over. Tested for equality with crc32c() in tests/test_store.py.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shadecache {
uint32_t sample_crc32c(const void* data, size_t n);
}  // namespace shadecache
