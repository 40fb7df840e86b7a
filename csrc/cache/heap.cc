#include "cache/heap.h"

namespace shadecache {

void IndexedHeap::sift_up(uint64_t k) {
  HeapNode n = at(k);
  while (k > 0) {
    uint64_t parent = (k - 1) / 2;
    HeapNode p = at(parent);
    if (!(n.key < p.key)) break;
    place(k, p);
    k = parent;
  }
  place(k, n);
}

void IndexedHeap::sift_down(uint64_t k) {
  const uint64_t n_size = *size_;
  HeapNode n = at(k);
  for (;;) {
    uint64_t child = 2 * k + 1;
    if (child >= n_size) break;
    HeapNode c = at(child);
    if (child + 1 < n_size) {
      HeapNode d = at(child + 1);
      if (d.key < c.key) {
        c = d;
        ++child;
      }
    }
    if (!(c.key < n.key)) break;
    place(k, c);
    k = child;
  }
  place(k, n);
}

void IndexedHeap::push(uint32_t id, double key) {
  uint64_t k = (*size_)++;
  place(k, HeapNode{key, id});
  sift_up(k);
}

void IndexedHeap::remove(uint32_t id) {
  uint64_t k = pos_[id] - 1;
  pos_[id] = 0;
  uint64_t last = --(*size_);
  if (k == last) return;
  HeapNode moved = at(last);
  double old_key = at(k).key;
  place(k, moved);
  if (moved.key < old_key)
    sift_up(k);
  else
    sift_down(k);
}

void IndexedHeap::update(uint32_t id, double key) {
  uint64_t k = pos_[id] - 1;
  HeapNode& n = at(k);
  double old_key = n.key;
  n.key = key;
  if (key < old_key)
    sift_up(k);
  else if (old_key < key)
    sift_down(k);
}

void IndexedHeap::append(uint32_t id, double key) { place((*size_)++, HeapNode{key, id}); }

void IndexedHeap::heapify() {
  for (uint64_t k = *size_ / 2; k-- > 0;) sift_down(k);
}

std::string IndexedHeap::check(uint64_t num_ids) const {
  const uint64_t n = *size_;
  for (uint64_t k = 0; k < n; ++k) {
    const HeapNode node = at(k);
    if (node.id >= num_ids) return "heap node " + std::to_string(k) + " holds id " + std::to_string(node.id) + " out of range";
    if (pos_[node.id] != k + 1)
      return "heap position of id " + std::to_string(node.id) + " is " + std::to_string(pos_[node.id]) +
             ", expected " + std::to_string(k + 1);
    if (k > 0 && node.key < at((k - 1) / 2).key) return "heap order broken at node " + std::to_string(k);
  }
  return "";
}

}  // namespace shadecache
