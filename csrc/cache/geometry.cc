#include "cache/geometry.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "cache/policy.h"
#include "common/error.h"

namespace shadecache {

namespace {

uint64_t pow2_floor(uint64_t v) { return v ? uint64_t{1} << (63 - __builtin_clzll(v)) : 1; }
uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
uint32_t log2_exact(uint64_t v) { return static_cast<uint32_t>(__builtin_ctzll(v)); }

uint64_t page_size_for(uint64_t capacity) {
  uint64_t p = pow2_floor(capacity / 1024);
  if (p < (64 << 10)) p = std::max(kMinPageSize, std::min<uint64_t>(64 << 10, pow2_floor(capacity / 64)));
  return std::min(p, kMaxPageSize);
}

// Bytes of the per-page arrays (PageMeta and the chunk owners) for one page.
constexpr uint64_t kPerPageMeta = sizeof(PageMeta) + kChunksPerPage * sizeof(uint32_t);

// Offsets of everything for `pages` data pages; returns the total size.
uint64_t place(Layout& l, uint64_t n, bool ticked, uint64_t pages) {
  uint64_t off = align_up(sizeof(Header), kAlign);
  auto take = [&](uint64_t bytes) {
    uint64_t at = off;
    off = align_up(off + bytes, kAlign);
    return at;
  };
  l.off_classes = take(kMaxClasses * sizeof(ClassMeta));
  l.off_pins = take(kPinOwners * sizeof(PinOwner));
  off = l.fixed = align_up(off, 4096);
  l.off_index = take(n * sizeof(uint32_t));
  l.off_heap_pos = take(n * sizeof(uint32_t));
  l.off_scores = take(n * sizeof(float));
  l.off_ticks = take(ticked ? n * sizeof(uint64_t) : 0);
  l.off_heap_table = take(l.heap_table_len * sizeof(uint32_t));
  l.off_pages = take(pages * sizeof(PageMeta));
  l.off_chunk_owner = take(pages * kChunksPerPage * sizeof(uint32_t));
  l.off_data = align_up(off, 4096);
  l.num_pages = pages;
  l.total = l.off_data + pages * l.page_size;
  return l.total;
}

// The layout for a capacity, without the fitted classes (sizes are not looked at).
Layout bare_layout(uint64_t capacity, uint64_t n, Policy policy) {
  Layout l{};
  l.page_size = page_size_for(capacity);
  l.chunk_size = l.page_size / kChunksPerPage;
  l.chunk_shift = log2_exact(l.chunk_size);
  // Enough heap pages for every id to be cached, one more for slack: a u32 each.
  l.heap_table_len = ceil_div(n, l.page_size / sizeof(HeapNode)) + 1;
  bool ticked = policy_by_id(static_cast<uint32_t>(policy))->uses_ticks();
  uint64_t base = place(l, n, ticked, 0) - l.fixed;
  uint64_t pages = capacity > base ? (capacity - base) / (l.page_size + kPerPageMeta) : 0;
  // The arrays round up to cache lines and the data area to 4 KiB: step down until it fits.
  while (pages > 0 && place(l, n, ticked, pages) - l.fixed > capacity) --pages;
  place(l, n, ticked, pages);
  uint64_t data = pages * l.page_size;
  l.unit_shift = kMinUnitShift;
  while ((data >> l.unit_shift) >= 0xFFFFFFFFull) ++l.unit_shift;
  // The largest value: the head of every length up to it (16 bytes, 4 per chunk, the tail) fits a
  // page, and its chunks fit the pages left when a page holds heap nodes and one its head. The
  // widest head below c + 1 chunks is a tail of chunk - 1 bytes behind c chunks: c is at most
  // `full`, and a length of full + 1 chunks keeps the tail that still fits beside them.
  const uint64_t full = (l.page_size - sizeof(SlotHeader) - (l.chunk_size - 1)) / 4;
  uint64_t by_head = (full + 1) * l.chunk_size + (l.page_size - sizeof(SlotHeader) - 4 * (full + 1));
  uint64_t by_data = pages > 2 ? (pages - 2) * l.page_size : 0;
  l.max_value = std::min<uint64_t>({by_head, by_data, 0xFFFFFFFFull});
  return l;
}

}  // namespace

uint64_t fixed_bytes() {
  Layout l{};
  l.page_size = kMinPageSize;
  l.heap_table_len = 0;
  place(l, 0, false, 0);
  return l.fixed;
}

std::vector<uint32_t> fit_classes(const std::vector<uint64_t>& sizes, uint64_t page_size, uint32_t chunk_shift,
                                  uint32_t unit_shift, uint32_t max_classes) {
  const uint64_t unit = uint64_t{1} << unit_shift;
  std::vector<uint64_t> needs;
  needs.reserve(sizes.size());
  for (uint64_t s : sizes) {
    uint64_t need = align_up(head_bytes(s, chunk_shift), unit);
    // The widest slot that cuts as many slots from a page: the rest of the page is lost anyway.
    if (need < page_size) needs.push_back(page_size / (page_size / need) / unit * unit);
  }
  std::sort(needs.begin(), needs.end());
  std::vector<uint32_t> out;
  if (needs.empty() || max_classes == 0) return out;
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
  Layout l = bare_layout(o.capacity_bytes, o.num_samples, o.policy);
  if (!o.sizes.empty()) {
    // Each class keeps a page partly cut: no more classes than a quarter of the pages hold.
    uint64_t allowed = std::max<uint64_t>(1, l.num_pages / 4);
    l.classes = fit_classes(o.sizes, l.page_size, l.chunk_shift, l.unit_shift,
                            static_cast<uint32_t>(std::min<uint64_t>(kMaxFittedClasses, allowed)));
  }
  return l;
}

uint64_t min_capacity(uint64_t n, Policy policy) {
  auto enough = [&](uint64_t cap) { return bare_layout(cap, n, policy).num_pages >= kMinPages; };
  uint64_t lo = 0, hi = 4096;
  while (!enough(hi)) hi *= 2;
  while (hi - lo > 4096) {  // the page size grows with the capacity: close in, then step
    uint64_t mid = lo + (hi - lo) / 2;
    (enough(mid) ? hi : lo) = mid;
  }
  uint64_t cap = lo;
  while (!enough(cap)) cap += 256;
  return cap;
}

uint64_t capacity_for(uint64_t items, const std::vector<uint64_t>& sizes, uint64_t n, Policy policy) {
  if (sizes.empty()) throw Error(ErrorKind::kInvalidArgument, "sizes is empty: give the sizes of the samples to hold");
  if (n == 0 || n >= kNoId)
    throw Error(ErrorKind::kInvalidArgument, "num_samples must be in [1, " + std::to_string(kNoId - 1) + "], got " + std::to_string(n));
  if (!policy_by_id(static_cast<uint32_t>(policy)))
    throw Error(ErrorKind::kInvalidArgument, "unknown policy number " + std::to_string(static_cast<uint32_t>(policy)));
  // A strided sample of a long list of sizes: the answer is a mean, and each step fits classes.
  std::vector<uint64_t> mix;
  size_t step = (sizes.size() + 65535) / 65536;
  for (size_t i = 0; i < sizes.size(); i += step) mix.push_back(sizes[i]);
  // Values of the mix a capacity holds: the data pages, less a page partly cut for each head class
  // the mix uses, for the chunks and for the heap, over the memory one value takes on average
  // (its chunks, its head slot's share of a page, its heap node).
  auto holds = [&](uint64_t cap) -> double {
    CacheOptions o;
    o.num_samples = n;
    o.capacity_bytes = cap;
    o.policy = policy;
    o.sizes = mix;
    Layout l = compute_layout(o);
    std::set<uint64_t> used;  // head slot sizes the mix takes
    double bytes = 0;
    for (uint64_t s : mix) {
      if (s > l.max_value) return 0;  // a sample this cache cannot hold
      uint64_t need = align_up(head_bytes(s, l.chunk_shift), uint64_t{1} << l.unit_shift);
      auto it = std::lower_bound(l.classes.begin(), l.classes.end(), need);
      uint64_t slot = it == l.classes.end() ? l.page_size : *it;
      used.insert(slot);
      bytes += static_cast<double>(chunks_of(s, l.chunk_shift) * l.chunk_size) +
               static_cast<double>(l.page_size) / static_cast<double>(l.page_size / slot);
    }
    double per_value = bytes / static_cast<double>(mix.size()) + sizeof(HeapNode);
    uint64_t kept = used.size() + 2;
    if (l.num_pages <= kept) return 0;
    return static_cast<double>((l.num_pages - kept) * l.page_size) / per_value;
  };
  uint64_t lo = min_capacity(n, policy);
  if (holds(lo) >= static_cast<double>(items)) return lo;
  uint64_t hi = lo;
  while (holds(hi) < static_cast<double>(items)) {
    if (hi >= kMaxDataBytes)
      throw Error(ErrorKind::kInvalidArgument, "no capacity up to 256 GiB holds " + std::to_string(items) +
                                                   " samples of these sizes");
    hi = std::min(kMaxDataBytes, hi * 2);
  }
  // The page size changes at powers of two, so `holds` is not quite monotone: search, then step
  // up to the first capacity that holds them.
  while (hi - lo > 4096) {
    uint64_t mid = lo + (hi - lo) / 2;
    (holds(mid) >= static_cast<double>(items) ? hi : lo) = mid;
  }
  uint64_t cap = lo;
  while (holds(cap) < static_cast<double>(items)) cap += 1024;
  return cap;
}

void validate(const CacheOptions& o) {
  if (o.num_samples == 0 || o.num_samples >= kNoId)
    throw Error(ErrorKind::kInvalidArgument,
                "num_samples must be in [1, " + std::to_string(kNoId - 1) + "], got " + std::to_string(o.num_samples));
  if (o.max_item_bytes == 0 || o.max_item_bytes > (uint64_t{1} << 30))
    throw Error(ErrorKind::kInvalidArgument, "max_item_bytes must be in [1, 1 GiB], got " + std::to_string(o.max_item_bytes));
  for (uint64_t s : o.sizes)
    if (o.item_limit && s > o.item_limit)
      throw Error(ErrorKind::kInvalidArgument, "sizes holds a sample of " + std::to_string(s) +
                                                   " bytes, larger than max_item_bytes=" + std::to_string(o.item_limit));
  if (o.fingerprint.size() >= sizeof(Header::fingerprint))
    throw Error(ErrorKind::kInvalidArgument, "fingerprint may be at most " + std::to_string(sizeof(Header::fingerprint) - 1) +
                                                 " characters, got " + std::to_string(o.fingerprint.size()));
  if (!policy_by_id(static_cast<uint32_t>(o.policy)))
    throw Error(ErrorKind::kInvalidArgument, "unknown policy number " + std::to_string(static_cast<uint32_t>(o.policy)));
  if (o.capacity_bytes > kMaxDataBytes)
    throw Error(ErrorKind::kInvalidArgument, "capacity_bytes may be at most 256 GiB, got " + std::to_string(o.capacity_bytes));
  uint64_t least = min_capacity(o.num_samples, o.policy);
  if (o.capacity_bytes < least) {
    bool ticked = policy_by_id(static_cast<uint32_t>(o.policy))->uses_ticks();
    uint64_t per_id = ticked ? 20 : 12;
    throw Error(ErrorKind::kInvalidArgument,
                "capacity_bytes=" + std::to_string(o.capacity_bytes) + " is too small for num_samples=" +
                    std::to_string(o.num_samples) + ": the index and per-sample state take " + std::to_string(per_id) +
                    " bytes per sample (" + std::to_string(per_id * o.num_samples) + " bytes) and the data area at least " +
                    std::to_string(kMinPages) + " pages; the minimum is capacity_bytes=" + std::to_string(least));
  }
}

}  // namespace shadecache
