// Everything the dead-owner path runs (EOWNERDEAD from the robust mutex: WriteLock calls it),
// in one place, like LMDB's mdb_mutex_failed.
#include "cache/cache.h"

#include <cstring>

namespace shadecache {

// Runs when a writer died holding the mutex. The ground truth is the index plus the slot headers
// (each changed by single aligned stores in an order that keeps them meaningful): a slot is live
// iff its seq is even, it names an id, and index[id] points at it. Everything else (free lists,
// page and class counts, the heap, items, bytes_used) is derived again from that truth. Idempotent:
// a repairer killed half way leaves EOWNERDEAD for the next locker, which starts over.
void Cache::do_repair() {
  // The dead writer may have unpublished a slot without reaching its own fence before the pin
  // check (pins.h): this one orders its stores before the table loads below.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  pins_.reap_dead();
  std::vector<uint32_t> pinned;  // one snapshot: scanning the table per slot would be O(slots x pins)
  pins_.snapshot(&pinned);
  hdr_->zombie_head = 0;
  hdr_->zombies = 0;
  heap_.clear();
  std::memset(heap_pos_, 0, n_ * sizeof(uint32_t));
  uint64_t page_count = hdr_->num_pages;
  // Pages: classes and runs keep their pages; a page caught mid-move (or mid-take into a run)
  // becomes free (none of its slots can be live: the mover unpublished them all before cutting it).
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    ClassMeta& cm = slab_.cls(c);
    cm.free_head = cm.free_slots = cm.pages = cm.items = 0;
    // A writer killed while cutting a new class (Slab::do_class_for) may have left the entry's
    // slots_per_page for another slot size.
    if (cm.slot_size) cm.slots_per_page = static_cast<uint32_t>(page_size_ / cm.slot_size);
  }
  ++hdr_->class_gen;  // every process rebuilds its copy of the class table
  hdr_->free_page_head = 0;
  hdr_->items = 0;
  hdr_->bytes_used = 0;
  for (uint64_t p = 0; p < page_count; ++p) {
    PageMeta& pm = pages_[p];
    uint64_t g = pm.gen.load(std::memory_order_relaxed);
    if (g & 1) {
      pm.gen.store(g + 1, std::memory_order_release);
      pm.cls = kFreePage;
    }
  }
  // Runs (large values): a head whose every tail names it is whole; anything else of a run (a
  // writer killed while taking or releasing one) is freed. owned[q]: q is a tail of a whole run.
  std::vector<uint8_t> whole(page_count), owned(page_count);
  for (uint64_t p = 0; p < page_count; ++p) {
    if (pages_[p].cls != kRunHead) continue;
    uint64_t k = slab_.run_len(p);
    bool ok = k >= 2 && k <= page_count - p;
    for (uint64_t q = p + 1; ok && q < p + k; ++q)
      ok = pages_[q].cls == kRunTail && pages_[q].next_free_page == p + 1;
    whole[p] = ok;
    for (uint64_t q = p + 1; ok && q < p + k; ++q) owned[q] = 1;
  }
  for (uint64_t p = page_count; p-- > 0;) {
    PageMeta& pm = pages_[p];
    bool run = pm.cls == kRunHead && whole[p];
    if (pm.cls == kRunTail && owned[p]) continue;  // its head (a lower page, visited later) decides
    if (!run && (pm.cls >= slab_.num_classes() || slab_.cls(pm.cls).slot_size == 0)) {
      slab_.do_push_free_page(p);
      continue;
    }
    // A run head has one slot, as long as its run; a page of a class, slots_per_page slots.
    uint32_t slots = run ? 1 : slab_.cls(pm.cls).slots_per_page;
    uint64_t slot_size = run ? slab_.run_len(p) * page_size_ : slab_.cls(pm.cls).slot_size;
    if (!run) ++slab_.cls(pm.cls).pages;
    pm.live = 0;
    pm.zombies = 0;
    pm.key_sum = 0;
    for (uint32_t i = slots; i-- > 0;) {
      uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * slot_size;
      SlotHeader* s = slab_.slot(off);
      uint64_t seq = s->seq.load(std::memory_order_relaxed);
      bool live = !(seq & 1) && s->id < n_ && idx_get(s->id, std::memory_order_relaxed) == off + 1 &&
                  s->len <= slot_size - sizeof(SlotHeader);
      if (live) {
        s->zombie = 0;
        double key = policy_->repair_key(pstate_, s->id);
        heap_.append(s->id, key);
        pm.key_sum += key;
        slab_.do_count_live(off, +1);
        ++hdr_->items;
        hdr_->bytes_used += s->len;
      } else {
        // Not live. Its id goes first, while a torn slot's seq is still odd: the index may still
        // name it (cleared below, after every page), and a reader must never find an even seq
        // with a matching id on bytes that a dead writer left half written.
        __atomic_store_n(&s->id, kNoId, __ATOMIC_RELAXED);
        std::atomic_thread_fence(std::memory_order_release);
        if (seq & 1) s->seq.store(seq + 1, std::memory_order_release);
        if (std::binary_search(pinned.begin(), pinned.end(), slot_code(off))) {
          // A view may be reading it: keep the bytes, as a zombie. (A torn slot is never under a
          // view that was handed out: a writer checks the pins after making seq odd and before
          // writing. Its entry is a reader's that is backing out.)
          do_push_zombie(off);
        } else {
          s->zombie = 0;
          slab_.do_free_slot(off);
        }
      }
    }
    slab_.do_release_if_empty(p);  // a page left empty (a dead writer's fresh page or run) is free
  }
  // Index entries that do not name a live slot (a put that died before its slot was stable, an
  // eviction that died after unpublishing) are cleared.
  for (uint64_t id = 0; id < n_; ++id) {
    uint64_t v = idx_get(id, std::memory_order_relaxed);
    if (v && heap_pos_[id] == 0) idx_set(id, 0, std::memory_order_release);
  }
  heap_.heapify();
}

}  // namespace shadecache
