#include "cache/geometry.h"

#include <string>

#include "cache/policy.h"
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

}  // namespace

Layout compute_layout(const CacheOptions& o) {
  Layout l{};
  l.page_size = page_size_for(o.max_item_bytes);
  l.num_pages = o.capacity_bytes / l.page_size;
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
  if (o.capacity_bytes < ps)
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
