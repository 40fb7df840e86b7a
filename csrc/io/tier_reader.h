// Reads values of the SSD tier (shadecache/ssd/tier.py keeps its index and writes its files) in
// one batch through the process's backend, and checks every value before it is trusted.
//
// The layout is the packed one (docs/ssd_tier.md): values sit at known offsets of a few large
// slot files that the caller keeps open; the caller looks each id up in its index and passes
// (descriptor, offset, length, crc32c) per value. The cost per value is then the packed store's:
// one read by offset in a batch of many, no path lookup, open or close. Values of one file that
// lie at most `gap_bytes` apart are read as one extent (sorted by offset, like the store's reads:
// io/extent_read.h): the tier writes the samples of one store extent into neighbouring slots, so
// an extent the tier holds whole comes back in one read instead of one per sample.
//
// Contract: read() must be called WITHOUT the GIL and touches no Python object. A value whose
// bytes are short (file truncated behind our back) or whose crc32c does not match (flipped bytes,
// a slot reused meanwhile by another process, a torn write) is reported as damaged, never as
// data; a read that fails carries its errno. Descriptors stay owned (and open) by the caller for
// the whole call.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "io/io_backend.h"

namespace shadecache {

class TierReader {
 public:
  enum Status : int32_t { kOk = 0, kMissing = 1, kDamaged = 2, kFailed = 3 };
  struct Op {
    int fd;           // < 0: not in the tier (a miss, nothing read)
    uint64_t offset;
    uint32_t len;
    uint32_t crc;     // crc32c of the value's len bytes
    char* dest;       // len bytes
  };

  // Neighbours at most this far apart are read together; no extent longer than max_extent_bytes
  // (unless one value is).
  static constexpr uint64_t kDefaultGapBytes = 32u << 10;
  static constexpr uint64_t kMaxExtentBytes = 8u << 20;

  TierReader(BackendKind kind, unsigned queue_depth, uint64_t gap_bytes = kDefaultGapBytes)
      : slot_(kind, queue_depth), gap_bytes_(gap_bytes) {}
  TierReader(const TierReader&) = delete;
  TierReader& operator=(const TierReader&) = delete;
  BackendSlot& backend() { return slot_; }

  // status[k] / err[k] for ops[k] (status kFailed: err is the errno).
  void read(const Op* ops, size_t n, int32_t* status, int32_t* err);

  // Reads issued by this reader (extents) and values handed out, for tests and benchmarks.
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }
  uint64_t gap_bytes() const { return gap_bytes_; }

 private:
  BackendSlot slot_;
  uint64_t gap_bytes_;
  std::atomic<uint64_t> requests_{0};
};

}  // namespace shadecache
