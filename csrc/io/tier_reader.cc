#include "io/tier_reader.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "common/crc32c.h"
#include "common/error.h"
#include "io/scratch.h"
#include "io/pread_backend.h"

namespace shadecache {

namespace {
// One value again by pread, for a batch the backend could not finish (EIO, or a file truncated
// behind our back): which value failed, and how.
void classify(const TierReader::Op& op, int32_t* status, int32_t* err) {
  ssize_t got = pread_full(op.fd, op.dest, op.len, op.offset);
  if (got < 0) {
    *status = TierReader::kFailed;
    *err = static_cast<int32_t>(-got);
    return;
  }
  *status = static_cast<size_t>(got) == op.len && crc32c(op.dest, op.len, 0) == op.crc
                ? TierReader::kOk
                : TierReader::kDamaged;
}

struct TierExtent {
  int fd;
  uint64_t offset;
  uint64_t len;
  size_t first, last;  // [first, last) into the sorted op indices
};
}  // namespace

void TierReader::read(const Op* ops, size_t n, int32_t* status, int32_t* err) {
  std::vector<size_t> order;  // ops to read, sorted by (fd, offset)
  order.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    err[k] = 0;
    status[k] = kMissing;
    if (ops[k].fd < 0) continue;
    if (ops[k].len == 0) {  // nothing to read; the crc of no bytes is 0
      status[k] = ops[k].crc == 0 ? kOk : kDamaged;
      continue;
    }
    order.push_back(k);
  }
  if (order.empty()) return;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ops[a].fd != ops[b].fd ? ops[a].fd < ops[b].fd : ops[a].offset < ops[b].offset;
  });
  // Extents: neighbours of one file at most gap_bytes_ apart (a value asked twice overlaps itself).
  std::vector<TierExtent> ext;
  for (size_t j = 0; j < order.size(); ++j) {
    const Op& op = ops[order[j]];
    uint64_t end = op.offset + op.len;
    if (!ext.empty()) {
      TierExtent& x = ext.back();
      uint64_t x_end = x.offset + x.len;
      uint64_t merged = std::max(x_end, end) - x.offset;
      if (x.fd == op.fd && op.offset <= x_end + gap_bytes_ &&
          merged <= std::max<uint64_t>(kMaxExtentBytes, x.len) && merged <= UINT32_MAX) {
        x.len = merged;
        x.last = j + 1;
        continue;
      }
    }
    ext.push_back(TierExtent{op.fd, op.offset, op.len, j, j + 1});
  }
  // An extent of one value is read straight into its destination; the others into this
  // thread's scratch, then copied out.
  std::vector<RangeRead> ranges(ext.size());
  std::vector<size_t> scratch_at(ext.size(), SIZE_MAX);
  size_t scratch_bytes = 0;
  for (size_t x = 0; x < ext.size(); ++x) {
    ranges[x] = RangeRead{ext[x].offset, static_cast<uint32_t>(ext[x].len), nullptr};
    ranges[x].fd = ext[x].fd;
    if (ext[x].last - ext[x].first == 1) {
      ranges[x].dest = ops[order[ext[x].first]].dest;
    } else {
      scratch_at[x] = scratch_bytes;
      scratch_bytes += ext[x].len;
    }
  }
  static thread_local ScratchBuffer scratch;
  char* base = scratch_bytes ? scratch.get(scratch_bytes) : nullptr;
  for (size_t x = 0; x < ext.size(); ++x)
    if (scratch_at[x] != SIZE_MAX) ranges[x].dest = base + scratch_at[x];
  requests_.fetch_add(ext.size(), std::memory_order_relaxed);
  // Checked as each extent finishes (overlapping the reads still in flight); called from the
  // thread that reaped it, each extent once, and an op belongs to one extent, so the writes to
  // status[] do not race.
  auto done = [&](size_t x) {
    for (size_t j = ext[x].first; j < ext[x].last; ++j) {
      const Op& op = ops[order[j]];
      if (scratch_at[x] != SIZE_MAX) std::memcpy(op.dest, ranges[x].dest + (op.offset - ext[x].offset), op.len);
      status[order[j]] = crc32c(op.dest, op.len, 0) == op.crc ? kOk : kDamaged;
    }
  };
  try {
    slot_.with([&](IoBackend& b) { b.read_ranges(-1, false, ranges.data(), ranges.size(), done); });
  } catch (const Error&) {
    // The batch drained (the backend's contract); find out value by value which failed and how.
    for (size_t k : order) classify(ops[k], &status[k], &err[k]);
  }
  scratch.trim();
}

}  // namespace shadecache
