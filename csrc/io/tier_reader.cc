#include "io/tier_reader.h"

#include "common/crc32c.h"
#include "common/error.h"
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
}  // namespace

void TierReader::read(const Op* ops, size_t n, int32_t* status, int32_t* err) {
  std::vector<RangeRead> ranges;
  std::vector<size_t> of;  // ops index of each range
  ranges.reserve(n);
  of.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    err[k] = 0;
    status[k] = kMissing;
    if (ops[k].fd < 0) continue;
    if (ops[k].len == 0) {  // nothing to read; the crc of no bytes is 0
      status[k] = ops[k].crc == 0 ? kOk : kDamaged;
      continue;
    }
    RangeRead r{ops[k].offset, ops[k].len, ops[k].dest};
    r.fd = ops[k].fd;
    ranges.push_back(r);
    of.push_back(k);
  }
  if (ranges.empty()) return;
  // Checked as each read finishes (overlapping the reads still in flight); called from the
  // thread that reaped it, each index once, so the writes to status[] do not race.
  auto done = [&](size_t j) {
    const Op& op = ops[of[j]];
    status[of[j]] = crc32c(op.dest, op.len, 0) == op.crc ? kOk : kDamaged;
  };
  try {
    slot_.with([&](IoBackend& b) { b.read_ranges(-1, false, ranges.data(), ranges.size(), done); });
  } catch (const Error&) {
    // The batch drained (the backend's contract); find out value by value which failed and how.
    for (size_t j = 0; j < of.size(); ++j) classify(ops[of[j]], &status[of[j]], &err[of[j]]);
  }
}

}  // namespace shadecache
