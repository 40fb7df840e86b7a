// An indexed binary min-heap over eviction priorities, stored in shared memory.
//
// Nodes {key, id} live in data pages the cache hands it (heap_table[h] names the page holding
// nodes [h * npp, (h + 1) * npp), npp = page_size / 12), so the heap takes memory for the values
// cached, not for every id. pos[id] holds the node position + 1 (0 = absent), so a priority
// change for any id is O(log n) and a zero-filled segment is an empty heap. Not thread-safe:
// every call is made with the cache mutex held (the "do_" contract of cache.cc), and a push only
// after the cache made room (size() < capacity). A crash mid-operation can leave it inconsistent;
// the cache's repair rebuilds it with heapify().
#pragma once

#include <cstdint>
#include <string>

#include "cache/layout.h"

namespace shadecache {

class IndexedHeap {
 public:
  IndexedHeap() = default;
  IndexedHeap(char* data, const uint32_t* table, uint32_t* pos, uint64_t* size, uint64_t page_size)
      : data_(data), table_(table), pos_(pos), size_(size), page_shift_(static_cast<uint32_t>(__builtin_ctzll(page_size))),
        per_page_(page_size / sizeof(HeapNode)), magic_(~uint64_t{0} / per_page_ + 1) {}

  uint64_t size() const { return *size_; }
  bool empty() const { return *size_ == 0; }
  bool contains(uint32_t id) const { return pos_[id] != 0; }
  const HeapNode& top() const { return at(0); }
  double key_of(uint32_t id) const { return at(pos_[id] - 1).key; }
  double key_at(uint64_t k) const { return at(k).key; }  // node k, in heap (not sorted) order
  uint64_t per_page() const { return per_page_; }

  // Hint for batch updates: bring id's node and its parent toward the CPU cache.
  void prefetch(uint32_t id) const {
    uint32_t k = pos_[id];
    if (k) {
      touch(&at(k - 1));
      if (k > 1) touch(&at((k - 2) / 2));
    }
  }

  void push(uint32_t id, double key);
  void remove(uint32_t id);
  void update(uint32_t id, double key);  // id must be present

  // Rebuild support: clear() forgets everything (pos[] of former members must be reset by the
  // caller, which knows the id range), append() adds without ordering, heapify() orders in O(n).
  void clear() { *size_ = 0; }
  void append(uint32_t id, double key);
  void heapify();

  // Verifies the heap property and pos[] consistency; returns "" or a description of the fault.
  std::string check(uint64_t num_ids) const;

 private:
  // Node k: page k / npp of the table, entry k % npp. The division is a multiply by
  // ceil(2^64 / npp), exact for k < 2^32 (npp is not a power of two, and a hardware division on
  // every step of a sift costs more than the step's own work when its nodes are cached).
  HeapNode& at(uint64_t k) const {
    bool last;
    return *locate(k, &last);
  }
  // Node k's address, and whether it is the last node of its page (node k + 1 then lies on
  // another page; otherwise right after it).
  HeapNode* locate(uint64_t k, bool* last_on_page) const {
    uint64_t q = static_cast<uint64_t>((static_cast<unsigned __int128>(k) * magic_) >> 64);
    uint64_t r = k - q * per_page_;
    *last_on_page = r + 1 == per_page_;
    return reinterpret_cast<HeapNode*>(data_ + (static_cast<uint64_t>(table_[q]) << page_shift_)) + r;
  }
  // A prefetch the compiler keeps: GCC drops a __builtin_prefetch whose address needs the page
  // table load and the reciprocal multiply of at() (update_scores lost every heap prefetch and ran
  // slower: docs/benchmark_history.md, "Speed, main vs the allocator (layout 6)"), while an asm
  // statement stays.
  static void touch(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p);
#endif
  }
  void place(uint64_t k, const HeapNode& n) {
    at(k) = n;
    pos_[n.id] = static_cast<uint32_t>(k + 1);
  }
  void sift_up(uint64_t k);
  void sift_down(uint64_t k);

  char* data_ = nullptr;
  const uint32_t* table_ = nullptr;
  uint32_t* pos_ = nullptr;
  uint64_t* size_ = nullptr;
  uint32_t page_shift_ = 0;
  uint64_t per_page_ = 1;
  uint64_t magic_ = 0;
};

}  // namespace shadecache
