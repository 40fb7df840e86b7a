#include "io/extent_read.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "common/crc32c.h"
#include "common/error.h"
#include "io/scratch.h"

namespace shadecache {

ExtentPlan plan_extents(const store::Entry* dir, const int64_t* ids, size_t n, bool direct,
                        const ReadShape& shape) {
  ExtentPlan plan;
  plan.order.reserve(n);
  for (size_t k = 0; k < n; ++k)
    if (dir[ids[k]].length > 0) plan.order.push_back(k);
  std::sort(plan.order.begin(), plan.order.end(), [&](size_t a, size_t b) {
    return dir[ids[a]].offset < dir[ids[b]].offset;
  });
  // What a read of [lo, hi) costs in bytes: O_DIRECT reads whole blocks.
  auto lo_of = [direct](uint64_t off) { return direct ? store::align_down(off) : off; };
  auto hi_of = [direct](uint64_t end) { return direct ? store::align_up(end) : end; };
  for (size_t j = 0; j < plan.order.size(); ++j) {
    const store::Entry& e = dir[ids[plan.order[j]]];
    uint64_t end = e.offset + e.length;
    if (!plan.extents.empty()) {
      Extent& x = plan.extents.back();
      uint64_t x_end = x.offset + x.len;
      uint64_t gap_lo = hi_of(x_end), gap_hi = lo_of(e.offset);
      uint64_t gap = gap_hi > gap_lo ? gap_hi - gap_lo : 0;
      uint64_t merged = std::max(x_end, end) - x.offset;
      if (gap <= shape.gap_bytes && merged <= std::max<uint64_t>(shape.max_extent_bytes, x.len) &&
          merged <= store::kMaxSampleBytes) {
        x.len = merged;
        x.last = j + 1;
        continue;
      }
    }
    plan.extents.push_back(Extent{e.offset, e.length, j, j + 1});
  }
  return plan;
}

ExtentBatch::ExtentBatch(CheckedBatch& batch, bool direct, const ReadShape& shape)
    : batch_(batch), plan_(plan_extents(batch.dir(), batch.ids(), batch.size(), direct, shape)) {
  const size_t m = plan_.extents.size();
  char* const* dests = batch.dests();
  // An extent of one sample goes straight to its destination (the backend widens O_DIRECT reads
  // in its own bounce buffers); the others into scratch, one after the other.
  ops_.resize(m);
  scratch_at_.assign(m, SIZE_MAX);
  for (size_t x = 0; x < m; ++x) {
    const Extent& e = plan_.extents[x];
    ops_[x] = RangeRead{e.offset, static_cast<uint32_t>(e.len), nullptr};
    if (e.last - e.first == 1) {
      ops_[x].dest = dests[plan_.order[e.first]];
    } else {
      scratch_at_[x] = scratch_bytes_;
      scratch_bytes_ += e.len;
    }
    uint64_t span = direct ? direct_span(ops_[x]) : e.len;
    if (direct) max_span_ = std::max(max_span_, span);
    asked_ += span;
  }
}

void ExtentBatch::count(ReadCounters* counters) const {
  if (!counters) return;
  counters->samples.fetch_add(batch_.size(), std::memory_order_relaxed);
  counters->requests.fetch_add(ops_.size(), std::memory_order_relaxed);
  counters->bytes.fetch_add(asked_, std::memory_order_relaxed);
}

void ExtentBatch::place(char* scratch) {
  for (size_t x = 0; x < ops_.size(); ++x)
    if (scratch_at_[x] != SIZE_MAX) ops_[x].dest = scratch + scratch_at_[x];
}

// Duplicate ids share one extent entry in `order` each, so every position is landed once.
void ExtentBatch::land(size_t x) {
  const Extent& e = plan_.extents[x];
  const store::Entry* dir = batch_.dir();
  const int64_t* ids = batch_.ids();
  char* const* dests = batch_.dests();
  for (size_t j = e.first; j < e.last; ++j) {
    size_t k = plan_.order[j];
    const store::Entry& s = dir[ids[k]];
    if (scratch_at_[x] != SIZE_MAX) std::memcpy(dests[k], ops_[x].dest + (s.offset - e.offset), s.length);
    batch_.check(k);
  }
}

bool ExtentBatch::intact(size_t x) const {
  if (!batch_.verify()) return true;
  const Extent& e = plan_.extents[x];
  const store::Entry* dir = batch_.dir();
  const int64_t* ids = batch_.ids();
  for (size_t j = e.first; j < e.last; ++j) {
    const store::Entry& s = dir[ids[plan_.order[j]]];
    const char* at = scratch_at_[x] != SIZE_MAX ? ops_[x].dest + (s.offset - e.offset)
                                                 : batch_.dests()[plan_.order[j]];
    if (crc32c(at, s.length) != s.crc) return false;
  }
  return true;
}

void read_samples(IoBackend& backend, int fd, bool direct, CheckedBatch& batch, const ReadShape& shape,
                  ReadCounters* counters) {
  ExtentBatch reads(batch, direct, shape);
  static thread_local ScratchBuffer scratch;
  if (reads.scratch_bytes()) reads.place(scratch.get(reads.scratch_bytes()));
  backend.read_ranges(fd, direct, reads.ops().data(), reads.ops().size(),
                      [&](size_t x) { reads.land(x); });
  reads.count(counters);  // not when the reads threw: only what was handed out counts
  scratch.trim();
}

}  // namespace shadecache
