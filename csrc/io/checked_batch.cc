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
    : dir_(dir), ids_(ids), n_(n), dests_(dests), verify_(verify) {}

void CheckedBatch::check(size_t k) {
  if (!verify_) return;
  const store::Entry& e = dir_[static_cast<size_t>(ids_[k])];
  uint32_t c = crc32c(dests_[k], e.length);
  if (c != e.crc) {
    std::lock_guard<std::mutex> lk(mu_);
    bad_ids_.push_back(ids_[k]);
    if (k < bad_) {
      bad_ = k;
      bad_crc_ = c;
    }
  }
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
