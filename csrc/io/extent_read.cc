#include "io/extent_read.h"

#include <algorithm>
#include <cstring>
#include <memory>

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

void read_samples(IoBackend& backend, int fd, bool direct, CheckedBatch& batch, const ReadShape& shape,
                  ReadCounters* counters) {
  const store::Entry* dir = batch.dir();
  const int64_t* ids = batch.ids();
  const size_t n = batch.size();
  char* const* dests = batch.dests();
  ExtentPlan plan = plan_extents(dir, ids, n, direct, shape);
  const size_t m = plan.extents.size();
  // An extent of one sample goes straight to its destination (the backend widens O_DIRECT reads
  // in its own bounce buffers); the others into this thread's scratch, one after the other.
  std::vector<RangeRead> ops(m);
  std::vector<size_t> scratch_at(m, SIZE_MAX);
  size_t scratch_bytes = 0;
  uint64_t asked = 0;
  for (size_t x = 0; x < m; ++x) {
    const Extent& e = plan.extents[x];
    ops[x] = RangeRead{e.offset, static_cast<uint32_t>(e.len), nullptr};
    if (e.last - e.first == 1) {
      ops[x].dest = dests[plan.order[e.first]];
    } else {
      scratch_at[x] = scratch_bytes;
      scratch_bytes += e.len;
    }
    asked += direct ? direct_span(ops[x]) : e.len;
  }
  static thread_local ScratchBuffer scratch;
  char* base = scratch_bytes ? scratch.get(scratch_bytes) : nullptr;
  for (size_t x = 0; x < m; ++x)
    if (scratch_at[x] != SIZE_MAX) ops[x].dest = base + scratch_at[x];

  RangeDone done = [&](size_t x) {
    const Extent& e = plan.extents[x];
    for (size_t j = e.first; j < e.last; ++j) {
      size_t k = plan.order[j];
      const store::Entry& s = dir[ids[k]];
      const char* src = ops[x].dest + (s.offset - e.offset);
      if (scratch_at[x] != SIZE_MAX) std::memcpy(dests[k], src, s.length);
      batch.check(k);
    }
  };
  backend.read_ranges(fd, direct, ops.data(), m, done);
  // Duplicate ids share one extent entry in `order` each, so every position was handled above.
  if (counters) {
    counters->samples.fetch_add(n, std::memory_order_relaxed);
    counters->requests.fetch_add(m, std::memory_order_relaxed);
    counters->bytes.fetch_add(asked, std::memory_order_relaxed);
  }
  scratch.trim();
}

}  // namespace shadecache
