// Everything the dead-owner path runs (EOWNERDEAD from the robust mutex: WriteLock calls it),
// in one place, like LMDB's mdb_mutex_failed.
#include "cache/cache.h"

#include <algorithm>
#include <cstring>

namespace shadecache {

// Runs when a writer died holding the mutex. The ground truth is the index plus the head slots
// (each changed by single aligned stores in an order that keeps them meaningful) and the chunk
// numbers in them: a head slot is live iff its seq is even, it names an id, index[id] points at
// it, and its chunk numbers name chunks of chunk pages that no other live head names; a chunk is
// live iff a live head names it. Everything else (free lists, chunk owners, page and class
// counts, the heap, items, bytes_used) is derived again from that truth, with the heap's pages
// from heap_table and its count. Idempotent: a repairer killed half way leaves EOWNERDEAD for the
// next locker, which starts over.
namespace {

// A head slot that is not live (seq as read: odd when a writer died mid-write) becomes free: seq
// odd, id none, seq even. The id goes while seq is odd (the index may still name the slot until
// the end of the repair, and a reader must never find an even seq and a matching id on bytes a
// dead writer left half written), and the seq moves on whatever it was, so that a reader that
// validated it before the repair retries.
void drop_head(SlotHeader* s, uint32_t seq) {
  if (!(seq & 1)) s->seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&s->id, kNoId, __ATOMIC_RELAXED);
  s->seq.store((seq | 1) + 1, std::memory_order_release);
}

}  // namespace

void Cache::do_repair() {
  // The dead writer may have unpublished a slot without reaching its own fence before the pin
  // check (pins.h): this one orders its stores before the table loads below.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  pins_.reap_dead();
  std::vector<uint32_t> pinned;  // one snapshot: scanning the table per slot would be O(slots x pins)
  pins_.snapshot(&pinned);
  const uint64_t page_count = hdr_->num_pages;
  hdr_->zombie_head = 0;
  hdr_->zombies = 0;
  hdr_->items = 0;
  hdr_->bytes_used = 0;
  hdr_->free_page_head = 0;  // rebuilt in step 3
  hdr_->free_pages = 0;
  heap_.clear();
  std::memset(heap_pos_, 0, n_ * sizeof(uint32_t));
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    ClassMeta& cm = slab_.cls(c);
    cm.free_head = cm.free_slots = cm.pages = cm.items = 0;
    // A writer killed while cutting a new class (Slab::do_class_for) may have left the entry's
    // slots_per_page for another slot size.
    if (cm.slot_size) cm.slots_per_page = static_cast<uint32_t>(page_size_ / cm.slot_size);
  }
  ++hdr_->class_gen;  // every process rebuilds its copy of the class table

  // 1. Pages: one caught mid-change (odd gen: being cut, or joining the heap) holds nothing live
  // (its slots were all free or moved before the change began). Heap pages are those heap_table
  // names up to the count; any other page marked for the heap is free. Chunk pages start with
  // every chunk unowned: live heads claim theirs below.
  auto is_class_page = [&](uint64_t p) {
    uint32_t c = pages_[p].cls;
    return c < slab_.num_classes() && slab_.cls(c).slot_size != 0;
  };
  for (uint64_t p = 0; p < page_count; ++p) {
    PageMeta& pm = pages_[p];
    uint64_t g = pm.gen.load(std::memory_order_relaxed);
    if (g & 1) {
      pm.gen.store(g + 1, std::memory_order_release);
      pm.cls = kFreePage;
    }
    if (pm.cls == kHeapPage) pm.cls = kFreePage;  // put back below when heap_table names it
    if (!is_class_page(p)) pm.cls = kFreePage;
    pm.live = pm.zombies = 0;
    if (pm.cls == kChunkClass)
      for (uint32_t i = 0; i < kChunksPerPage; ++i) slab_.owner(p * kChunksPerPage + i) = kNoId;
  }
  uint64_t heap_pages = 0;
  for (; heap_pages < hdr_->heap_pages && heap_pages < hdr_->heap_table_len; ++heap_pages) {
    uint32_t p = heap_table_[heap_pages];
    if (p >= page_count || pages_[p].cls != kFreePage) break;  // out of range, or named twice
    pages_[p].cls = kHeapPage;
  }
  hdr_->heap_pages = heap_pages;

  // 2. Head slots: live or not, the live ones claiming their chunks.
  auto chunk_page = [&](uint64_t c) { return c < num_chunks_ && pages_[c / kChunksPerPage].cls == kChunkClass; };
  std::vector<uint64_t> live;  // head slot offsets
  for (uint64_t p = 0; p < page_count; ++p) {
    uint32_t c = pages_[p].cls;
    if (c >= slab_.num_classes() || c == kChunkClass) continue;
    const ClassMeta& cm = slab_.cls(c);
    for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
      uint64_t off = p * page_size_ + uint64_t{i} * cm.slot_size;
      SlotHeader* s = slab_.slot(off);
      uint32_t seq = s->seq.load(std::memory_order_relaxed);
      bool ok = !(seq & 1) && s->id < n_ && idx_get(s->id, std::memory_order_relaxed) == off + 1 && s->len <= max_len_ &&
                head_bytes(s->len, chunk_shift_) <= cm.slot_size;
      uint64_t k = ok ? s->len >> chunk_shift_ : 0, claimed = 0;
      const uint32_t* refs = slab_.refs(off);
      for (; ok && claimed < k; ++claimed) {
        uint32_t r = refs[claimed];
        ok = chunk_page(r) && slab_.owner(r) == kNoId;
        if (ok) slab_.owner(r) = s->id;
      }
      if (ok) {
        live.push_back(off);
        continue;
      }
      // Undo a partial claim: the loop stopped one past the chunk it refused.
      for (uint64_t j = 0; j + 1 < claimed; ++j) slab_.owner(refs[j]) = kNoId;
      // Not live.
      if (s->id != kNoId && std::binary_search(pinned.begin(), pinned.end(), slot_code(off)) &&
          !(seq & 1) && (s->len >> chunk_shift_) == 0) {
        // A view may be reading it: keep the bytes, as a zombie. (A torn slot is never under a
        // view that was handed out: a writer checks the pins after making seq odd and before
        // writing. An entry naming one is a reader's that is backing out.)
        continue;
      }
      // A whole head (even seq) goes odd first, as in an eviction: its chunks go back to the
      // free list below and a put may write over them, so a reader still copying them (it
      // found the head before the dead writer unpublished it) must fail its seq recheck.
      drop_head(s, seq);
    }
  }

  // 3. Free pages, then the heap's room: every live value needs a node. (Always there: a put
  // makes room in the heap before it publishes. A value beyond it is dropped, not kept unkeyed.)
  for (uint64_t p = page_count; p-- > 0;)
    if (pages_[p].cls == kFreePage) slab_.do_push_free_page(p);
  while (live.size() > heap_capacity() && hdr_->free_pages && hdr_->heap_pages < hdr_->heap_table_len) do_heap_grow();
  while (live.size() > heap_capacity()) {
    uint64_t off = live.back();
    live.pop_back();
    SlotHeader* s = slab_.slot(off);
    const uint32_t* refs = slab_.refs(off);
    for (uint64_t j = 0; j < (s->len >> chunk_shift_); ++j) slab_.owner(refs[j]) = kNoId;
    drop_head(s, s->seq.load(std::memory_order_relaxed));
  }
  for (uint64_t off : live) {
    SlotHeader* s = slab_.slot(off);
    heap_.append(s->id, policy_->repair_key(pstate_, s->id));
    ++hdr_->items;
    hdr_->bytes_used += s->len;
  }

  // 4. Slots of every class page: live (a head above, a claimed chunk), a zombie (a pinned
  // head that is not live), or free. Counts and free lists from that; a page left with nothing
  // goes to the free page list.
  for (uint64_t p = page_count; p-- > 0;) {
    uint32_t c = pages_[p].cls;
    if (c >= slab_.num_classes()) continue;
    ClassMeta& cm = slab_.cls(c);
    ++cm.pages;
    for (uint32_t i = cm.slots_per_page; i-- > 0;) {
      uint64_t off = p * page_size_ + uint64_t{i} * cm.slot_size;
      if (c == kChunkClass) {
        if (slab_.owner(off >> chunk_shift_) != kNoId)
          slab_.do_count_live(off, +1);
        else
          slab_.do_free_slot(off);
        continue;
      }
      SlotHeader* s = slab_.slot(off);
      if (s->id == kNoId) {
        slab_.do_free_slot(off);
      } else if (idx_get(s->id, std::memory_order_relaxed) == off + 1 && heap_.contains(s->id)) {
        slab_.do_count_live(off, +1);
      } else {
        do_push_zombie(off);
      }
    }
    slab_.do_release_if_empty(p);
  }
  // 5. Index entries that do not name a live head (a put that died before its slot was stable, an
  // eviction that died after unpublishing, a value dropped above) are cleared.
  for (uint64_t id = 0; id < n_; ++id)
    if (heap_pos_[id] == 0 && index_[id].load(std::memory_order_relaxed)) idx_set(id, 0, std::memory_order_release);
  heap_.heapify();
}

}  // namespace shadecache
