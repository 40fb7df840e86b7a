// One batch of sample reads of a packed store, planned from its directory and checked against the
// directory's crc32c as each read completes: the one home of the checksum-verify callback that
// PackedReader::read_into and ReadStream::run hand their I/O backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "io/io_backend.h"
#include "io/store_format.h"

namespace shadecache {

// "0x%08x" of a checksum, as every checksum message of the store prints it.
std::string hex32(uint32_t v);

class CheckedBatch {
 public:
  // Plans a read of each id's bytes into dests[k]. A sample of no bytes needs no read (the crc32c
  // of no bytes is 0, and the reader refuses a directory that says otherwise). `dir`, `ids` and
  // `dests` must outlive the batch; ids must be in range.
  CheckedBatch(const std::vector<store::Entry>& dir, const int64_t* ids, size_t n, char* const* dests,
               bool verify);
  CheckedBatch(const CheckedBatch&) = delete;
  CheckedBatch& operator=(const CheckedBatch&) = delete;

  RangeRead* ops() { return ops_.data(); }
  size_t size() const { return ops_.size(); }

  // The backend's completion callback for read j: with verify, its crc32c against the
  // directory's; the lowest failing batch position is kept. Backends call it from their own
  // threads, so the record is under a mutex (taken only on a mismatch).
  RangeDone done();

  // CorruptSample naming the lowest failing id, its file offset, its length and both checksums,
  // when a read failed its check; nothing otherwise.
  void throw_if_corrupt(const std::string& path) const;

  // Every id whose read failed its check, sorted (the store's verify()).
  std::vector<int64_t> corrupt_ids() const;

 private:
  const std::vector<store::Entry>& dir_;
  const int64_t* ids_;
  bool verify_;
  std::vector<RangeRead> ops_;
  std::vector<size_t> pos_;  // ops_[j] reads batch position pos_[j]
  std::mutex mu_;
  size_t bad_ = SIZE_MAX;    // lowest failing batch position
  uint32_t bad_crc_ = 0;
  std::vector<int64_t> bad_ids_;
};

}  // namespace shadecache
