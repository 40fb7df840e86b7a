// A batch of samples of a packed store whose extents the caller fetches (an object store's ranged
// GETs, shadecache/store/s3.py): the same plan as a file's reads (extent_read.h: neighbours at
// most gap_bytes apart in one range, at most max_extent_bytes), where each range's bytes must go,
// and the landing of each range: its samples copied out and checked against the directory's
// crc32c (checked_batch.h), so an object's samples pass the same checks as a file's.
//
// Contract: the caller writes range(x).len bytes at range(x).dest, then calls land(x) once for
// each x (from any thread, distinct x at a time; without the GIL), then finish(). intact(x) may be
// asked before land(x) to fetch a range again instead of recording its samples as corrupt. The
// StoreDirectory must outlive the batch. dests[k] receives entry(ids[k]).length bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/checked_batch.h"
#include "io/extent_read.h"
#include "io/store_directory.h"

namespace shadecache {

class FetchedBatch {
 public:
  // ids must be in range (StoreDirectory::entry checks them).
  FetchedBatch(const StoreDirectory& dir, std::vector<int64_t> ids, std::vector<char*> dests,
               bool verify, const ReadShape& shape);
  FetchedBatch(const FetchedBatch&) = delete;
  FetchedBatch& operator=(const FetchedBatch&) = delete;

  size_t ranges() const { return extents_.ops().size(); }
  const RangeRead& range(size_t x) const { return extents_.ops()[x]; }
  bool intact(size_t x) const { return extents_.intact(x); }
  void land(size_t x) { extents_.land(x); }
  // CorruptSample naming `name`, the lowest failing id and its offset, when a landed sample did
  // not match its checksum.
  void finish(const std::string& name) const { batch_.throw_if_corrupt(name); }
  // Bytes the ranges cover (the samples and the gaps between neighbours).
  uint64_t range_bytes() const;

 private:
  std::vector<int64_t> ids_;
  std::vector<char*> dests_;
  CheckedBatch batch_;
  mutable ExtentBatch extents_;
  std::unique_ptr<char[]> scratch_;
};

}  // namespace shadecache
