// Making room: the victim search (policy keys, admission, pinned values set aside), eviction of
// one value, and page moves between size classes. Every function runs with the mutex held.
#include "cache/cache.h"

#include <cmath>
#include <limits>

namespace shadecache {

// Over budget: the cached copy of `id` (if any; it goes once the new slot is won) does not count.
bool Cache::do_over_budget(uint32_t id, uint64_t len) const {
  uint64_t cur = idx_get(id, std::memory_order_relaxed);
  uint64_t old = cur ? slab_.slot(cur - 1)->len : 0;
  return hdr_->bytes_used - old + len > hdr_->capacity_bytes;
}

// Values that views pin are set aside during one allocation (they cannot be evicted now) and go
// back into the heap when it ends, whatever happens (an exception would otherwise leave them out
// of the heap). A page's key sum still counts them (aside_ tells do_add_key their keys).
struct SetAside {
  IndexedHeap& heap;
  std::vector<HeapNode>& nodes;
  ~SetAside() {
    for (const HeapNode& n : nodes) heap.push(n.id, n.key);
    nodes.clear();
  }
};

bool Cache::do_next_victim(double key, bool* reaped, HeapNode* victim, uint64_t* voff) {
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
    *voff = off;
    return true;
  }
  return false;
}

// Finds a free slot of class `cls` for `len` bytes of `id` whose priority will be `key`, evicting
// while the value bytes would exceed the budget (capacity_bytes) or the class has no free slot.
// Returns the slot offset + 1, or 0 when the policy refuses (static full, or importance admission
// fails because `key` does not beat the lowest cached priority).
uint64_t Cache::do_alloc_slot(uint32_t cls, uint32_t id, uint64_t len, double key) {
  auto over_budget = [&] { return do_over_budget(id, len); };
  // A full cache may refuse the value (importance: unless it beats the lowest cached key). A
  // cache is full when the value is over budget, or when no page is free and its free slots are
  // under 1/8 of the data area: the few slots a page move frees beyond the one it needed must not
  // let low-key values in through the side door (with a mix of sizes, nearly every admission
  // would otherwise take such a slot). Empty pages are free pages (Slab::do_release_if_empty).
  bool over = over_budget();
  if (!heap_.empty() && !policy_->admits(key, heap_.top().key) &&
      (over || (hdr_->free_page_head == 0 && slab_.free_slot_bytes() < hdr_->data_bytes / 8)))
    return 0;
  if (!over)
    if (uint64_t u = slab_.do_take_slot(cls)) return u;
  if (!policy_->evicts()) return 0;
  SetAside put_back{heap_, aside_};
  bool reaped = false;
  uint64_t got = 0;
  HeapNode top;
  uint64_t voff;
  while (do_next_victim(key, &reaped, &top, &voff)) {
    uint64_t vpage = slab_.page_of(voff);
    if (over || pages_[vpage].cls == cls || pages_[vpage].cls == kRunHead) {
      // Over budget any victim helps (its page goes to the free list once empty); within budget
      // a victim of our class frees the slot we need (its page stays: we fill it), and a large
      // victim frees whole pages (its run goes to the free list, where our class takes one).
      bool freed = do_evict(top.id);
      hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
      if (!freed) continue;  // a view pinned it at the last moment: it is a zombie now; take the next
      if (pages_[vpage].cls != cls) slab_.do_release_if_empty(vpage);
      over = over_budget();
      if (!over && (got = slab_.do_take_slot(cls))) break;
      continue;
    }
    // The lowest-priority value sits in another size class: memory must move to ours, a page at a
    // time. This is how memory follows the size mix (a cache full of 3 KB values can take 100 KB
    // ones). Move the page of another class whose values matter least on average (lowest mean
    // key), not merely the victim's page: that one holds a random sample of its class, and moving
    // it would evict values of every priority.
    uint64_t page = do_pick_page_to_move(cls, aside_);
    if (page == kNoPage) break;
    if (do_move_page(page, cls)) {
      got = slab_.do_pop_free_slot(cls);
      break;
    }
    // A view pins a value of that page: it now holds a zombie and is not picked again.
  }
  return got;
}

// A run of pages for a value of `len` (> a page) bytes: free pages side by side, else victims in
// heap order (the policy's admission and set-aside pins as in do_alloc_slot) until the budget
// holds it and freed pages form a run. Pages never move for a run: a slab page frees when its
// last value goes. (Choosing a window of pages to empty would evict less; heap order is the
// policy's order and keeps this simple.)
uint64_t Cache::do_alloc_run(uint32_t id, uint64_t len, double key) {
  uint64_t k = slab_.run_pages_for(len);
  bool over = do_over_budget(id, len);
  if (!over)
    if (uint64_t h = slab_.do_take_run(k)) return (h - 1) * page_size_ + 1;
  if (!policy_->evicts()) return 0;
  SetAside put_back{heap_, aside_};
  bool reaped = false;
  HeapNode top;
  uint64_t voff;
  while (do_next_victim(key, &reaped, &top, &voff)) {
    uint64_t vpage = slab_.page_of(voff);
    bool freed = do_evict(top.id);
    hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
    if (!freed) continue;
    bool released = slab_.do_release_if_empty(vpage);
    bool was_over = over;
    over = do_over_budget(id, len);
    // Look for a run (an O(pages) scan) only when it may have appeared: a page came free, or the
    // budget holds for the first time (the free run may have been there all along).
    if (!over && (released || was_over))
      if (uint64_t h = slab_.do_take_run(k)) return (h - 1) * page_size_ + 1;
  }
  // Within budget but no run (pins, zombies or the policy's admission keep the pages): refused.
  return 0;
}

// Changes the eviction key of cached `id`, keeping its page's key_sum in step.
void Cache::do_rekey(uint32_t id, double key) {
  uint64_t off = idx_get(id, std::memory_order_relaxed) - 1;
  double old = heap_.key_of(id);
  heap_.update(id, key);
  do_add_key(slab_.page_of(off), old, key);
}

// key_sum of page p: minus `removed`, plus `added`; the heap already holds the new state. A
// running sum loses its small terms when a huge key passes through it (1e30 in, then out, leaves
// 0 for fifty keys of 1); then the page's sum is taken again from its live values (O(slots)).
void Cache::do_add_key(uint64_t p, double removed, double added) {
  PageMeta& pm = pages_[p];
  pm.key_sum = pm.key_sum - removed + added;
  if (!(std::fabs(removed) + std::fabs(added) > 1e9 * std::fabs(pm.key_sum))) return;
  // A run head has one slot, at the page start.
  bool run = pm.cls == kRunHead;
  uint32_t slots = run ? 1 : slab_.cls(pm.cls).slots_per_page;
  uint64_t slot_size = run ? page_size_ : slab_.cls(pm.cls).slot_size;
  double sum = 0;
  for (uint32_t i = 0; i < slots; ++i) {
    uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * slot_size;
    const SlotHeader* s = slab_.slot(off);
    if (s->id >= n_ || s->zombie || idx_get(s->id, std::memory_order_relaxed) != off + 1) continue;
    if (heap_.contains(s->id)) {
      sum += heap_.key_of(s->id);
    } else {  // set aside by do_alloc_slot while a view pins it: still cached, still counted
      for (const HeapNode& a : aside_)
        if (a.id == s->id) sum += a.key;
    }
  }
  pm.key_sum = sum;
}

// The page, outside class `cls`, with the lowest mean key (an empty page first), among pages that
// hold no zombie, no pinned value and none of the values `aside` (taken out of the heap, pinned,
// by the caller: they must still be cached when it puts them back). O(pages): runs once per page move, i.e. at most once per
// slots-per-page allocations of the class.
uint64_t Cache::do_pick_page_to_move(uint32_t cls, const std::vector<HeapNode>& aside) {
  std::vector<uint8_t> blocked;
  if (pins_.any()) do_reap_dead_pins();  // pins of the dead must not block pages forever
  if (hdr_->zombies || pins_.any() || !aside.empty()) {
    blocked.assign(hdr_->num_pages, 0);
    for (const HeapNode& n : aside) blocked[slab_.page_of(idx_get(n.id, std::memory_order_relaxed) - 1)] = 1;
    for (uint64_t u = hdr_->zombie_head; u; u = slab_.slot((u - 1) * kAlign)->next_free)
      blocked[slab_.page_of((u - 1) * kAlign)] = 1;
    std::vector<uint32_t> codes;
    pins_.snapshot(&codes);
    for (uint32_t c : codes)
      if ((c - 1) * kAlign < data_bytes_) blocked[slab_.page_of(uint64_t{c - 1} * kAlign)] = 1;
  }
  uint64_t best = kNoPage;
  double best_mean = 0;
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.cls == cls || pm.cls >= slab_.num_classes() || (!blocked.empty() && blocked[p])) continue;
    double mean = pm.live ? pm.key_sum / pm.live : -std::numeric_limits<double>::infinity();
    if (best == kNoPage || mean < best_mean) {
      best = p;
      best_mean = mean;
    }
  }
  return best;
}

bool Cache::do_evict(uint32_t id) {
  uint64_t off = idx_get(id, std::memory_order_relaxed) - 1;
  SlotHeader* s = slab_.slot(off);
  idx_set(id, 0, std::memory_order_release);  // new readers miss from here on
  crash_point(CrashPoint::kEvictAfterUnpublish);
  PageMeta& pm = pages_[slab_.page_of(off)];
  bool freed = !do_slot_pinned(off);
  if (freed) {
    uint64_t seq = s->seq.load(std::memory_order_relaxed);
    s->seq.store(seq + 1, std::memory_order_relaxed);  // readers mid-copy see the change and retry
    std::atomic_thread_fence(std::memory_order_release);
    s->id = kNoId;
    s->seq.store(seq + 2, std::memory_order_release);
    slab_.do_free_slot(off);
  } else {
    do_push_zombie(off);  // bytes untouched: a view reads them
  }
  crash_point(CrashPoint::kEvictAfterFree);
  if (heap_.contains(id)) {
    double key = heap_.key_of(id);
    heap_.remove(id);
    do_add_key(slab_.page_of(off), key, 0);
  }
  slab_.do_count_live(off, -1);
  if (pm.live == 0) pm.key_sum = 0;  // drop the rounding residue of the additions
  --hdr_->items;
  hdr_->bytes_used -= s->len;
  return freed;
}

bool Cache::do_move_page(uint64_t p, uint32_t cls) {
  PageMeta& pm = pages_[p];
  uint32_t old = pm.cls;
  const ClassMeta& ocm = slab_.cls(old);
  uint64_t base = p * page_size_;
  // Pass 1: evict every value on the page onto its class's free list. A value a view pins turns
  // into a zombie instead, and a page holding a zombie cannot move.
  bool blocked = false;
  for (uint32_t i = 0; i < ocm.slots_per_page; ++i) {
    SlotHeader* s = slab_.slot(base + static_cast<uint64_t>(i) * ocm.slot_size);
    if (s->zombie) {
      blocked = true;
    } else if (s->id != kNoId) {
      blocked |= !do_evict(s->id);
      hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
    }
    if (i == ocm.slots_per_page / 2) crash_point(CrashPoint::kMovePageMid);
  }
  if (blocked) return false;
  // Pass 2: every slot is free and unpublished (no view can pin it any more): take them off the
  // free list and recut the page.
  for (uint32_t i = 0; i < ocm.slots_per_page; ++i)
    slab_.do_unlink_free_slot(old, base + static_cast<uint64_t>(i) * ocm.slot_size);
  --slab_.cls(old).pages;
  slab_.do_cut_page(p, cls);
  hdr_->stats.page_moves.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace shadecache
