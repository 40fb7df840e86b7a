// Reads the SSD tier's files (shadecache/ssd_tier.py writes them) in batches through the process's
// backend, checks every file before its value is trusted, and keeps the files it has read open.
//
// Layout (the contract with ssd_tier.py, which writes it): sample `id` of the tier in `dir` is the
// file  dir/<id % 256 as 2 hex digits>/<id>.s  holding a 16-byte header, magic "SHS1", crc32c u32
// (of the value), value length u64 (little endian), then the value. A file never changes once
// renamed into place (the writer skips ids already present); it is only removed, or damaged.
//
// Open files: a file read and checked once stays open (at most max_open, oldest closed first)
// with its value length and crc32c, so that the next read of it is one read of the value at
// offset 16 in the same io_uring batch as every other open file (the packed store's cost: no
// path lookup, no open, no close), checked against the crc32c of the first read. A file removed
// meanwhile (eviction by any process) still reads its own, correct bytes through the open
// descriptor; descriptors of removed files (st_nlink == 0) are closed by a sweep at most once a
// second, and forget(id) closes one at the next batch, so a removed file's disk space is held
// for about a second at most. A descriptor is closed only between batches (read_mu_), never while
// a batch may use it.
//
// Contract: read() must be called WITHOUT the GIL and touches no Python object. A missing file is
// a miss, not an error; a file whose header, length or crc32c does not match is reported as
// damaged (the caller removes it and reads the store); other I/O failures carry their errno.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/io_backend.h"

namespace shadecache {

class TierReader {
 public:
  static constexpr uint32_t kHeaderBytes = 16;
  static constexpr int kHighFd = 1024;  // kept descriptors go at or above this (FD_SETSIZE)
  enum Status : int32_t { kOk = 0, kMissing = 1, kDamaged = 2, kFailed = 3 };
  struct Result {
    int32_t status;
    int32_t err;         // errno when kFailed
    const char* value;   // kOk: dests[k] when the caller's buffer was used, else into files[k].data
    uint64_t len;
  };

  TierReader(BackendKind kind, unsigned queue_depth, size_t max_open)
      : slot_(kind, queue_depth), max_open_(max_open) {}
  ~TierReader();
  TierReader(const TierReader&) = delete;
  TierReader& operator=(const TierReader&) = delete;
  BackendSlot& backend() { return slot_; }

  static std::string path_of(const std::string& dir, int64_t id);
  // len_out[k]: the value length of ids[k] when its file is open (the caller allocates dests[k]
  // of that size for read()), else -1.
  void lengths_of(const int64_t* ids, size_t n, int64_t* len_out);
  // Reads and checks the files of ids (all >= 0). dests[k] (or nullptr) receives the value of an
  // open file whose length lengths_of reported; files[k] owns the bytes of the others.
  void read(const std::string& dir, const int64_t* ids, size_t n, char* const* dests,
            std::vector<FileRead>& files, std::vector<Result>& results);
  // The file of `id` was removed: its descriptor is closed before the next batch.
  void forget(int64_t id);
  size_t open_files();

 private:
  struct Open {
    int fd;
    uint32_t len;
    uint32_t crc;
  };
  void do_drop(int64_t id);   // mu_ held
  void do_sweep();            // mu_ and read_mu_ held
  void do_remember(int64_t id, const std::string& path, uint32_t len, uint32_t crc);  // mu_ held

  BackendSlot slot_;
  size_t max_open_;
  std::mutex read_mu_;   // one batch at a time; descriptors close only under it
  std::mutex mu_;        // open_, order_, to_close_
  std::unordered_map<int64_t, Open> open_;
  std::deque<int64_t> order_;   // ids in the order opened (entries of dropped ids are skipped)
  std::vector<int> to_close_;
  int64_t last_sweep_ns_ = 0;
};

}  // namespace shadecache
