#include "io/checked_batch.h"

#include <algorithm>
#include <cstdio>

#include "common/crc32c.h"
#include "common/error.h"

namespace shadecache {

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof(b), "0x%08x", v);
  return b;
}

CheckedBatch::CheckedBatch(const std::vector<store::Entry>& dir, const int64_t* ids, size_t n,
                           char* const* dests, bool verify)
    : dir_(dir), ids_(ids), verify_(verify) {
  ops_.reserve(n);
  pos_.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const store::Entry& e = dir[static_cast<size_t>(ids[k])];
    if (e.length == 0) continue;
    ops_.push_back(RangeRead{e.offset, e.length, dests[k]});
    pos_.push_back(k);
  }
}

RangeDone CheckedBatch::done() {
  return [this](size_t j) {
    if (!verify_) return;
    const RangeRead& op = ops_[j];
    uint32_t c = crc32c(op.dest, op.len);
    if (c != dir_[static_cast<size_t>(ids_[pos_[j]])].crc) {
      std::lock_guard<std::mutex> lk(mu_);
      bad_ids_.push_back(ids_[pos_[j]]);
      if (pos_[j] < bad_) {
        bad_ = pos_[j];
        bad_crc_ = c;
      }
    }
  };
}

void CheckedBatch::throw_if_corrupt(const std::string& path) const {
  if (bad_ == SIZE_MAX) return;
  int64_t id = ids_[bad_];
  const store::Entry& e = dir_[static_cast<size_t>(id)];
  throw CorruptSample(path + ": sample " + std::to_string(id) + " at file offset " + std::to_string(e.offset) +
                          " (" + std::to_string(e.length) + " bytes) is corrupt: checksum " + hex32(bad_crc_) +
                          " != stored " + hex32(e.crc),
                      static_cast<unsigned long long>(id), e.offset);
}

std::vector<int64_t> CheckedBatch::corrupt_ids() const {
  std::vector<int64_t> out = bad_ids_;
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace shadecache
