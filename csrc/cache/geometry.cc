#include "cache/geometry.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cache/policy.h"
#include "cache/slab.h"
#include "common/error.h"

namespace shadecache {

namespace {

uint64_t next_pow2(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

uint64_t page_size_for(uint64_t max_item_bytes) {
  uint64_t ps = next_pow2(max_item_bytes + sizeof(SlotHeader));
  return ps < kMinPageSize ? kMinPageSize : ps;
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace

std::vector<uint32_t> fit_classes(const std::vector<uint64_t>& sizes, uint64_t page_size, uint32_t max_classes) {
  std::vector<uint64_t> needs;
  needs.reserve(sizes.size());
  for (uint64_t s : sizes) {
    uint64_t need = Slab::need_for(s);
    if (need < page_size) needs.push_back(Slab::widest_slot(need, page_size));
  }
  std::sort(needs.begin(), needs.end());
  std::vector<uint32_t> out;
  if (needs.empty()) return out;
  std::vector<uint64_t> distinct(needs);
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (distinct.size() <= max_classes) {
    for (uint64_t d : distinct) out.push_back(static_cast<uint32_t>(d));
    return out;
  }
  // Many sizes: class k ends at the (k+1)/K quantile of the samples, so each class serves an equal
  // share of them and the slack of a value is at most the spread of its share.
  for (uint32_t k = 0; k < max_classes; ++k) {
    uint64_t at = std::min<uint64_t>(needs.size() - 1, ceil_div((k + 1) * needs.size(), max_classes) - 1);
    uint32_t slot = static_cast<uint32_t>(needs[at]);
    if (out.empty() || out.back() != slot) out.push_back(slot);
  }
  return out;
}

Layout compute_layout(const CacheOptions& o) {
  Layout l{};
  l.page_size = page_size_for(o.max_item_bytes);
  l.num_pages = o.capacity_bytes / l.page_size;
  l.value_budget = l.num_pages * l.page_size;
  if (!o.sizes.empty()) {
    // Memory each value takes, page ends included: its class's share of a page. The data area
    // holds capacity_bytes of values of this mix, plus room for the classes' partly cut pages.
    // A cache of few pages gets few classes (Slab::max_classes_in_use): fit, size, fit again.
    uint64_t pages = 0;
    uint32_t max_classes = kMaxFittedClasses;
    for (int round = 0; round < 2; ++round) {
      l.classes = fit_classes(o.sizes, l.page_size, max_classes);
      double mem = 0, val = 0;
      for (uint64_t s : o.sizes) {
        uint64_t need = Slab::need_for(s);
        auto it = std::lower_bound(l.classes.begin(), l.classes.end(), need);
        uint64_t slot = it == l.classes.end() ? l.page_size : *it;
        if (need > l.page_size)  // a run of whole pages
          mem += static_cast<double>(ceil_div(need, l.page_size) * l.page_size);
        else
          mem += static_cast<double>(l.page_size / (l.page_size / slot));
        val += static_cast<double>(std::max<uint64_t>(s, 1));
      }
      pages = ceil_div(static_cast<uint64_t>(std::ceil(o.capacity_bytes * (mem / val))), l.page_size);
      pages += std::min<uint64_t>(l.classes.size() + 1, std::max<uint64_t>(1, pages / 16));
      uint64_t allowed = Slab::max_classes_in_use(pages) - 1;  // the whole-page class is one
      if (allowed >= max_classes) break;
      max_classes = static_cast<uint32_t>(std::max<uint64_t>(1, allowed));
    }
    l.num_pages = pages;
    l.value_budget = o.capacity_bytes;
  }
  uint64_t n = o.num_samples;
  uint64_t off = align_up(sizeof(Header), kAlign);
  auto take = [&](uint64_t bytes) {
    uint64_t at = off;
    off = align_up(off + bytes, kAlign);
    return at;
  };
  l.off_index = take(n * sizeof(std::atomic<uint32_t>));
  l.off_heap_pos = take(n * sizeof(uint32_t));
  l.off_scores = take(n * sizeof(std::atomic<float>));
  bool ticked = policy_by_id(static_cast<uint32_t>(o.policy))->uses_ticks();
  l.off_ticks = take(ticked ? n * sizeof(std::atomic<uint64_t>) : 0);
  l.off_heap = take(n * sizeof(HeapNode));
  l.off_pages = take(l.num_pages * sizeof(PageMeta));
  l.off_classes = take(kMaxClasses * sizeof(ClassMeta));
  l.off_pins = take(kPinOwners * sizeof(PinOwner));
  l.off_data = align_up(off, 4096);
  l.total = l.off_data + l.num_pages * l.page_size;
  return l;
}

void validate(const CacheOptions& o) {
  if (o.num_samples == 0 || o.num_samples >= kNoId)
    throw Error(ErrorKind::kInvalidArgument,
                "num_samples must be in [1, " + std::to_string(kNoId - 1) + "], got " + std::to_string(o.num_samples));
  if (o.max_item_bytes == 0 || o.max_item_bytes > (uint64_t{1} << 30))
    throw Error(ErrorKind::kInvalidArgument, "max_item_bytes must be in [1, 1 GiB], got " + std::to_string(o.max_item_bytes));
  uint64_t ps = page_size_for(o.max_item_bytes);
  for (uint64_t s : o.sizes)
    if (o.item_limit && s > o.item_limit)
      throw Error(ErrorKind::kInvalidArgument, "sizes holds a sample of " + std::to_string(s) +
                                                   " bytes, larger than max_item_bytes=" + std::to_string(o.item_limit));
  if (o.fingerprint.size() >= sizeof(Header::fingerprint))
    throw Error(ErrorKind::kInvalidArgument, "fingerprint may be at most " + std::to_string(sizeof(Header::fingerprint) - 1) +
                                                 " characters, got " + std::to_string(o.fingerprint.size()));
  if (o.sizes.empty() && o.capacity_bytes < ps)
    throw Error(ErrorKind::kInvalidArgument,
                "capacity_bytes=" + std::to_string(o.capacity_bytes) + " is smaller than one slab page (" +
                    std::to_string(ps) + " bytes for max_item_bytes=" + std::to_string(o.max_item_bytes) +
                    "); raise capacity_bytes or lower max_item_bytes");
  if (o.capacity_bytes > kMaxDataBytes)
    throw Error(ErrorKind::kInvalidArgument, "capacity_bytes may be at most 256 GiB");
  if (!policy_by_id(static_cast<uint32_t>(o.policy)))
    throw Error(ErrorKind::kInvalidArgument, "unknown policy number " + std::to_string(static_cast<uint32_t>(o.policy)));
}

}  // namespace shadecache
