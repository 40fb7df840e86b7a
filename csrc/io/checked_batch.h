// One batch of sample reads of a packed store and its checks against the directory's crc32c: the
// one home of the per-sample verify and of the CorruptSample message, for every reader of the
// store (PackedReader::read_into, find_corrupt and ReadStream::run, all through read_samples of
// io/extent_read.h, which reads the batch as extents and checks each sample as its extent lands).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "io/store_format.h"

namespace shadecache {

// "0x%08x" of a checksum, as every checksum message of the store prints it.
std::string hex32(uint32_t v);

class CheckedBatch {
 public:
  // A batch that reads each id's bytes into dests[k]. `dir`, `ids` and `dests` must outlive the
  // batch; ids must be in range.
  CheckedBatch(const std::vector<store::Entry>& dir, const int64_t* ids, size_t n, char* const* dests,
               bool verify);
  CheckedBatch(const CheckedBatch&) = delete;
  CheckedBatch& operator=(const CheckedBatch&) = delete;

  const store::Entry* dir() const { return dir_.data(); }
  const int64_t* ids() const { return ids_; }
  size_t size() const { return n_; }
  char* const* dests() const { return dests_; }
  bool verify() const { return verify_; }

  // Checks position k once its bytes are in dests[k] (nothing without verify): its crc32c against
  // the directory's; the lowest failing position is kept. Called from the backend's threads, so
  // the record is under a mutex (taken only on a mismatch).
  void check(size_t k);

  // CorruptSample naming the lowest failing id, its file offset, its length and both checksums,
  // when a read failed its check; nothing otherwise.
  void throw_if_corrupt(const std::string& path) const;

  // Every id whose read failed its check, sorted (the store's verify()).
  std::vector<int64_t> corrupt_ids() const;

 private:
  const std::vector<store::Entry>& dir_;
  const int64_t* ids_;
  size_t n_;
  char* const* dests_;
  bool verify_;
  std::mutex mu_;
  size_t bad_ = SIZE_MAX;    // lowest failing batch position
  uint32_t bad_crc_ = 0;
  std::vector<int64_t> bad_ids_;
};

}  // namespace shadecache
