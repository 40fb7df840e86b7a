// Making room: what a new value needs (a head slot, chunks, a heap node), the victim search
// (policy keys, admission, pinned values set aside) and eviction of one value. Every function
// runs with the mutex held.
#include "cache/cache.h"

#include <algorithm>

namespace shadecache {

// Values that views pin are set aside during one allocation (they cannot be evicted now) and go
// back into the heap when it ends, whatever happens (an exception would otherwise leave them out
// of the heap).
struct SetAside {
  IndexedHeap& heap;
  std::vector<HeapNode>& nodes;
  ~SetAside() {
    for (const HeapNode& n : nodes) heap.push(n.id, n.key);
    nodes.clear();
  }
};

bool Cache::do_next_victim(double key, bool* reaped, HeapNode* victim) {
  while (!heap_.empty()) {
    HeapNode top = heap_.top();
    double now = policy_->current_key(pstate_, top.id, top.key);
    if (now != top.key) {  // readers moved it since (lru hit stamps): apply, look again
      do_rekey(top.id, now);
      continue;
    }
    if (!policy_->admits(key, top.key)) return false;
    uint64_t off = idx_get(top.id, std::memory_order_relaxed) - 1;
    if (pins_.any() && pins_.pinned(slot_code(off))) {
      // A hint (the value is still published): views of dead processes are dropped once, then
      // a value still pinned is passed over. do_evict decides for real.
      if (!*reaped) {
        *reaped = true;
        do_reap_dead_pins();
        continue;
      }
      aside_.push_back(top);  // first: if it throws, the node is still in the heap
      heap_.remove(top.id);
      continue;
    }
    *victim = top;
    return true;
  }
  return false;
}

uint64_t Cache::do_pages_short(uint32_t cls, uint64_t k, uint32_t id) const {
  uint64_t need = slab_.cls(cls).free_slots == 0;
  uint64_t chunks = slab_.cls(kChunkClass).free_slots;
  if (k > chunks) need += (k - chunks + kChunksPerPage - 1) / kChunksPerPage;
  // The heap holds a node per cached value, those set aside included; `id` keeps its own when
  // it is cached (the new copy replaces the old). Cached is asked of the index entry, whose line
  // do_put has just read, rather than of heap_pos (one more cache miss per put).
  bool has_node = idx_get(id, std::memory_order_relaxed) != 0;
  need += heap_.size() + aside_.size() + !has_node > heap_capacity();
  return need > hdr_->free_pages ? need - hdr_->free_pages : 0;
}

// The order of the ways to find memory is the allocator's whole policy. Free slots and pages
// first. Then memory that is free but scattered: a class holding a page's worth of free slots
// gives a page by moving values, which evicts nothing (do_compact_one). Only then eviction, in
// the policy's order: the victims are the lowest keys cached, whatever their size or class, and
// the slots they free either serve this value or, once a class has a page's worth of them, move
// to the class that needs them through compaction. So memory follows the size mix without
// evicting a value out of the policy's order.
bool Cache::do_alloc(uint32_t cls, uint64_t k, uint32_t id, double key, uint64_t* head, std::vector<uint32_t>* chunks) {
  {
    SetAside put_back{heap_, aside_};
    bool reaped = false;
    HeapNode victim;
    while (do_pages_short(cls, k, id) > 0) {
      if (do_compact_one()) continue;
      // The victims' nodes left the heap: its spare pages (the nodes set aside, and this value's
      // own when the id has none, stay reserved) serve the value before anything more is evicted.
      // Without this a value needing nearly every page evicted the whole cache, then was refused.
      if (do_heap_trim(aside_.size() + (idx_get(id, std::memory_order_relaxed) == 0))) continue;
      if (!policy_->evicts() || !do_next_victim(key, &reaped, &victim)) return false;
      do_evict(victim.id);  // pinned at the last moment: a zombie now, its node gone; go on
      hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // Enough pages are free for what is short: take them in turn.
  if (!idx_get(id, std::memory_order_relaxed) && heap_.size() + 1 > heap_capacity()) do_heap_grow();
  while (slab_.cls(kChunkClass).free_slots < k) slab_.do_take_free_page(kChunkClass);
  chunks->clear();
  for (uint64_t i = 0; i < k; ++i) {
    uint64_t off = slab_.do_pop_free_slot(kChunkClass) - 1;
    uint64_t c = off >> chunk_shift_;
    chunks->push_back(static_cast<uint32_t>(c));
    slab_.owner(c) = id;
    slab_.do_count_live(off, +1);
  }
  if (slab_.cls(cls).free_slots == 0) slab_.do_take_free_page(cls);
  *head = slab_.do_pop_free_slot(cls) - 1;
  // Counted live at once, as the chunks are: evicting the id's old copy before the publish must
  // not find the page empty and free it under the new head.
  slab_.do_count_live(*head, +1);
  return true;
}

bool Cache::do_evict(uint32_t id) {
  uint64_t off = idx_get(id, std::memory_order_relaxed) - 1;
  SlotHeader* s = slab_.slot(off);
  idx_set(id, 0, std::memory_order_release);  // new readers miss from here on
  crash_point(CrashPoint::kEvictAfterUnpublish);
  const uint32_t len = s->len;
  const uint64_t k = len >> chunk_shift_;
  const uint32_t* refs = slab_.refs(off);  // intact below: freeing links only bytes 8..15 of a slot
  // A value in chunks has no views (they are copies); a pin entry naming its head is a reader's
  // backing out.
  bool freed = k > 0 || !do_slot_pinned(off);
  if (freed) {
    uint32_t seq = s->seq.load(std::memory_order_relaxed);
    s->seq.store(seq + 1, std::memory_order_relaxed);  // readers mid-copy see the change and retry
    std::atomic_thread_fence(std::memory_order_release);
    for (uint64_t i = 0; i < k; ++i) {  // after the odd seq: freeing writes links into the chunk
      uint64_t c = refs[i];
      slab_.owner(c) = kNoId;
      slab_.do_free_slot(c << chunk_shift_);
      slab_.do_count_live(c << chunk_shift_, -1);
    }
    s->id = kNoId;
    s->seq.store(seq + 2, std::memory_order_release);
    slab_.do_free_slot(off);
  } else {
    do_push_zombie(off);  // bytes untouched: a view reads them
  }
  crash_point(CrashPoint::kEvictAfterFree);
  if (heap_.contains(id)) heap_.remove(id);
  slab_.do_count_live(off, -1);
  --hdr_->items;
  hdr_->bytes_used -= len;
  // Pages left holding nothing go back to the free page list, for any class or the heap.
  for (uint64_t i = 0; i < k; ++i) slab_.do_release_if_empty(slab_.page_of(static_cast<uint64_t>(refs[i]) << chunk_shift_));
  slab_.do_release_if_empty(slab_.page_of(off));
  return freed;
}

}  // namespace shadecache
