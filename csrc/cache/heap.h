// An indexed binary min-heap over eviction priorities, stored in shared memory.
//
// nodes[0..size) hold {key, id}; pos[id] holds the node position + 1 (0 = absent), so a priority
// change for any id is O(log n) and a zero-filled segment is an empty heap. Not thread-safe: every
// call is made with the cache mutex held (the "do_" contract of cache.cc). A crash mid-operation
// can leave it inconsistent; the cache's repair rebuilds it with heapify().
#pragma once

#include <cstdint>
#include <string>

#include "cache/layout.h"

namespace shadecache {

class IndexedHeap {
 public:
  IndexedHeap() = default;
  IndexedHeap(HeapNode* nodes, uint32_t* pos, uint64_t* size) : nodes_(nodes), pos_(pos), size_(size) {}

  uint64_t size() const { return *size_; }
  bool empty() const { return *size_ == 0; }
  bool contains(uint32_t id) const { return pos_[id] != 0; }
  const HeapNode& top() const { return nodes_[0]; }
  double key_of(uint32_t id) const { return nodes_[pos_[id] - 1].key; }

  // Hint for batch updates: bring id's node and its parent toward the CPU cache.
  void prefetch(uint32_t id) const {
    uint32_t k = pos_[id];
    if (k) {
      __builtin_prefetch(&nodes_[k - 1], 1);
      if (k > 1) __builtin_prefetch(&nodes_[(k - 2) / 2], 0);
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
  void place(uint64_t k, const HeapNode& n) {
    nodes_[k] = n;
    pos_[n.id] = static_cast<uint32_t>(k + 1);
  }
  void sift_up(uint64_t k);
  void sift_down(uint64_t k);

  HeapNode* nodes_ = nullptr;
  uint32_t* pos_ = nullptr;
  uint64_t* size_ = nullptr;
};

}  // namespace shadecache
