#include "io/fetched_batch.h"

namespace shadecache {

FetchedBatch::FetchedBatch(const StoreDirectory& dir, std::vector<int64_t> ids,
                           std::vector<char*> dests, bool verify, const ReadShape& shape)
    : ids_(std::move(ids)),
      dests_(std::move(dests)),
      batch_(dir.entries(), ids_.data(), ids_.size(), dests_.data(), verify),
      extents_(batch_, /*direct=*/false, shape) {
  // Each batch has its own scratch (not the thread's, as a file read has): several batches of one
  // store are in flight at once, landed from the fetching threads.
  if (extents_.scratch_bytes()) {
    scratch_.reset(new char[extents_.scratch_bytes()]);
    extents_.place(scratch_.get());
  }
}

uint64_t FetchedBatch::range_bytes() const {
  uint64_t n = 0;
  for (const RangeRead& r : extents_.ops()) n += r.len;
  return n;
}

}  // namespace shadecache
