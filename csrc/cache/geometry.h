// Geometry: where everything lies in a segment for given options (offsets of the arrays, page size,
// page count, total size), and which options are valid. Pure arithmetic over layout.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/layout.h"

namespace shadecache {

constexpr uint64_t kMinPageSize = 64 * 1024;

struct CacheOptions {
  uint64_t num_samples = 0;
  // Without `sizes`: bytes of slab memory (rounded down to whole pages), slot headers included.
  // With `sizes`: a budget of value bytes; the data area is sized so that values of these sizes
  // fill the budget, slot headers and page ends on top (segment_bytes says the whole).
  uint64_t capacity_bytes = 0;
  // The largest value a slab page holds: sets the page size. Larger values take runs of whole
  // pages (slab.h), up to item_limit.
  uint64_t max_item_bytes = 1 << 20;
  uint64_t item_limit = 0;  // largest value accepted; 0 = any the cache can hold
  Policy policy = Policy::kImportance;
  std::vector<uint64_t> sizes;   // sample sizes (e.g. every length of the store); may be empty
  bool persist = false;          // the segment outlives every process (Cache::create)
  std::string fingerprint;       // the data set the values belong to; checked by attach
};

// Size classes fitted to `sizes`: one per distinct slot need when there are few, else one per
// equal share of the samples (the widest slot of that share). Ascending slot sizes, each below
// page_size, at most max_classes (the other entries are left for classes learned later).
constexpr uint32_t kMaxFittedClasses = 48;
std::vector<uint32_t> fit_classes(const std::vector<uint64_t>& sizes, uint64_t page_size,
                                  uint32_t max_classes = kMaxFittedClasses);

struct Layout {
  std::vector<uint32_t> classes;  // fitted slot sizes (empty without sizes)
  uint64_t value_budget;          // the header's capacity_bytes
  uint64_t page_size, num_pages, off_index, off_heap_pos, off_scores, off_ticks, off_heap, off_pages,
      off_classes, off_pins, off_data, total;
};

// Throws kInvalidArgument naming the first option out of range.
void validate(const CacheOptions& o);
// The layout of a segment for valid options `o`.
Layout compute_layout(const CacheOptions& o);

}  // namespace shadecache
