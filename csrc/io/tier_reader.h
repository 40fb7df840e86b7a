// Reads values of the SSD tier (shadecache/ssd/tier.py keeps its index and writes its files) in
// one batch through the process's backend, and checks every value before it is trusted.
//
// The layout is the packed one (docs/ssd_tier.md): values sit at known offsets of a few large
// slot files that the caller keeps open; the caller looks each id up in its index and passes
// (descriptor, offset, length, crc32c) per value. The cost per value is then the packed store's:
// one read by offset in a batch of many, no path lookup, open or close.
//
// Contract: read() must be called WITHOUT the GIL and touches no Python object. A value whose
// bytes are short (file truncated behind our back) or whose crc32c does not match (flipped bytes,
// a slot reused meanwhile by another process, a torn write) is reported as damaged, never as
// data; a read that fails carries its errno. Descriptors stay owned (and open) by the caller for
// the whole call.
#pragma once

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

  TierReader(BackendKind kind, unsigned queue_depth) : slot_(kind, queue_depth) {}
  TierReader(const TierReader&) = delete;
  TierReader& operator=(const TierReader&) = delete;
  BackendSlot& backend() { return slot_; }

  // status[k] / err[k] for ops[k] (status kFailed: err is the errno).
  void read(const Op* ops, size_t n, int32_t* status, int32_t* err);

 private:
  BackendSlot slot_;
};

}  // namespace shadecache
