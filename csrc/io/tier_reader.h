// Reads the SSD tier's files (shadecache/ssd_tier.py writes them) in batches through the process's
// backend (io_uring: open, read, close of up to queue_depth files in flight; pread pool otherwise),
// and checks every file before its value is trusted.
//
// Layout (the contract with ssd_tier.py, which writes it): sample `id` of the tier in `dir` is the
// file  dir/<id % 256 as 2 hex digits>/<id>.s  holding a 16-byte header, magic "SHS1", crc32c u32
// (of the value), value length u64 (little endian), then the value.
//
// Contract: read() must be called WITHOUT the GIL and touches no Python object. A missing file is
// a miss, not an error; a file whose header, length or crc32c does not match is reported as
// damaged (the caller removes it and reads the store); other I/O failures carry their errno.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/io_backend.h"

namespace shadecache {

class TierReader {
 public:
  static constexpr uint32_t kHeaderBytes = 16;
  enum Status : int32_t { kOk = 0, kMissing = 1, kDamaged = 2, kFailed = 3 };
  struct Result {
    int32_t status;
    int32_t err;  // errno when kFailed
    const char* value;  // into files[k].data when kOk
    uint64_t len;
  };

  TierReader(BackendKind kind, unsigned queue_depth) : slot_(kind, queue_depth) {}
  BackendSlot& backend() { return slot_; }

  static std::string path_of(const std::string& dir, int64_t id);
  // Reads and checks the files of ids (all >= 0); files[k] owns the bytes results[k] points into.
  void read(const std::string& dir, const int64_t* ids, size_t n, std::vector<std::string>& paths,
            std::vector<FileRead>& files, std::vector<Result>& results);

 private:
  BackendSlot slot_;
};

}  // namespace shadecache
