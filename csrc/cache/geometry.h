// Geometry: where everything lies in a segment of a given capacity (page and chunk size, the
// offsets of the arrays, page count, total size), which options are valid, and the inverse
// question: the capacity that holds k samples of a size mix. Pure arithmetic over layout.h.
//
// capacity_bytes is the memory of the cache: the segment is capacity_bytes plus its fixed part
// (Header, class table and pin table: kFixedBytes, the same for every cache). The per-sample
// arrays, the page table, the chunk owners and the data pages all fit inside capacity_bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/layout.h"

namespace shadecache {

// Pages: a power of two near capacity / 1024 (so that a page partly used by each size class is
// a small share of the memory), between 64 KiB and 4 MiB; smaller caches get at least 64 pages,
// down to 4 KiB pages.
constexpr uint64_t kMinPageSize = 4 << 10;
constexpr uint64_t kMaxPageSize = 4 << 20;
// A data area smaller than this many pages is refused (the heap, a head class and chunks need
// one page each before any value is held).
constexpr uint64_t kMinPages = 8;

struct CacheOptions {
  uint64_t num_samples = 0;
  uint64_t capacity_bytes = 0;   // the memory of the cache (its fixed part comes on top)
  uint64_t max_item_bytes = 1 << 20;  // kept for the API; pages no longer depend on it
  uint64_t item_limit = 0;       // largest value accepted; 0 = any the cache can hold
  Policy policy = Policy::kImportance;
  std::vector<uint64_t> sizes;   // sample sizes (e.g. every length of the store); may be empty
  bool persist = false;          // the segment outlives every process (Cache::create)
  std::string fingerprint;       // the data set the values belong to; checked by attach
};

// The shape of a value of `len` bytes in a cache of chunk size 2^chunk_shift: whole chunks and
// the head slot that holds its header, chunk numbers and tail.
inline uint64_t chunks_of(uint64_t len, uint32_t chunk_shift) { return len >> chunk_shift; }
inline uint64_t head_bytes(uint64_t len, uint32_t chunk_shift) {
  return sizeof(SlotHeader) + 4 * chunks_of(len, chunk_shift) + (len & ((uint64_t{1} << chunk_shift) - 1));
}

// Head-slot classes fitted to `sizes`: one per distinct slot need when there are few, else one
// per equal share of the samples (the widest slot of that share). Ascending slot sizes, each
// below page_size, at most max_classes (the other entries are left for classes learned later).
constexpr uint32_t kMaxFittedClasses = 48;
std::vector<uint32_t> fit_classes(const std::vector<uint64_t>& sizes, uint64_t page_size, uint32_t chunk_shift,
                                  uint32_t unit_shift, uint32_t max_classes = kMaxFittedClasses);

struct Layout {
  std::vector<uint32_t> classes;  // fitted head-slot sizes (empty without sizes)
  uint64_t page_size, chunk_size, num_pages, heap_table_len, fixed, off_classes, off_pins, off_index,
      off_heap_pos, off_scores, off_ticks, off_heap_table, off_pages, off_chunk_owner, off_data, total;
  uint32_t unit_shift, chunk_shift;
  uint64_t max_value;             // the largest value whose head fits a page and whose chunks fit the data
};

// The fixed part of every segment: Header, class table and pin table, page-aligned.
uint64_t fixed_bytes();
// Throws kInvalidArgument naming the first option out of range (a capacity too small for the
// per-sample arrays included, with the smallest capacity that is not).
void validate(const CacheOptions& o);
// The layout of a segment for valid options `o`.
Layout compute_layout(const CacheOptions& o);
// The smallest capacity_bytes a cache of num_samples ids under `policy` accepts.
uint64_t min_capacity(uint64_t num_samples, Policy policy);
// The capacity_bytes (memory) that holds `items` values whose sizes are distributed as `sizes`,
// in a cache of num_samples ids under `policy`, created with the same sizes.
uint64_t capacity_for(uint64_t items, const std::vector<uint64_t>& sizes, uint64_t num_samples, Policy policy);

}  // namespace shadecache
