// Geometry: where everything lies in a segment for given options (offsets of the arrays, page size,
// page count, total size), and which options are valid. Pure arithmetic over layout.h.
#pragma once

#include <cstdint>

#include "cache/layout.h"

namespace shadecache {

constexpr uint64_t kMinPageSize = 64 * 1024;

struct CacheOptions {
  uint64_t num_samples = 0;
  uint64_t capacity_bytes = 0;   // bytes of slab memory for values (rounded down to whole pages)
  uint64_t max_item_bytes = 1 << 20;  // largest value accepted; sets the slab page size
  Policy policy = Policy::kImportance;
};

struct Layout {
  uint64_t page_size, num_pages, off_index, off_heap_pos, off_scores, off_ticks, off_heap, off_pages,
      off_classes, off_pins, off_data, total;
};

// Throws kInvalidArgument naming the first option out of range.
void validate(const CacheOptions& o);
// The layout of a segment for valid options `o`.
Layout compute_layout(const CacheOptions& o);

}  // namespace shadecache
