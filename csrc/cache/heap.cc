#include "cache/heap.h"

#include <cstdint>

namespace shadecache {

void IndexedHeap::sift_up(uint64_t k) {
  // The hole moves up: each step reads one parent and writes it down into the hole (by address,
  // so no node's place is computed twice).
  HeapNode* hole = &at(k);
  const HeapNode n = *hole;
  while (k > 0) {
    const uint64_t parent = (k - 1) / 2;
    HeapNode* p = &at(parent);
    if (!(n.key < p->key)) break;
    *hole = *p;
    pos_[hole->id] = static_cast<uint32_t>(k + 1);
    hole = p;
    k = parent;
  }
  *hole = n;
  pos_[n.id] = static_cast<uint32_t>(k + 1);
}

void IndexedHeap::sift_down(uint64_t k) {
  const uint64_t n_size = *size_;
  HeapNode* hole = &at(k);
  const HeapNode n = *hole;
  for (;;) {
    const uint64_t child = 2 * k + 1;
    if (child >= n_size) break;
    bool last_on_page;
    HeapNode* c = locate(child, &last_on_page);
    uint64_t to = child;
    if (child + 1 < n_size) {
      HeapNode* d = last_on_page ? &at(child + 1) : c + 1;
      if (d->key < c->key) {
        c = d;
        ++to;
      }
    }
    if (!(c->key < n.key)) break;
    *hole = *c;
    pos_[hole->id] = static_cast<uint32_t>(k + 1);
    hole = c;
    k = to;
  }
  *hole = n;
  pos_[n.id] = static_cast<uint32_t>(k + 1);
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
  HeapNode* hole = &at(k);
  double old_key = hole->key;
  *hole = moved;
  pos_[moved.id] = static_cast<uint32_t>(k + 1);
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
