// Compaction: a page is emptied by moving its values into free slots of the same class on other
// pages, so that it can serve another class, the chunks or the heap. This is how memory moves
// between classes without evicting anything out of the policy's order (eviction.cc, do_alloc),
// and how the heap's pages come and go. Every function runs with the mutex held.
//
// Moving a head: copy it (header, chunk numbers, tail) into a free slot under that slot's seqlock,
// publish the index entry naming the copy, then free the old slot (seq odd, id none, seq even).
// A reader of the old slot fails its seq or id check and reads the index again. A view that
// pinned the old slot in the meantime keeps it, as a zombie (the page then stays).
// Moving a chunk: copy it into a free chunk, then, under its value's odd head seq, rewrite the
// chunk number in the head; the old chunk is free from there on. A reader that copied the old
// chunk fails its head seq check.
#include "cache/cache.h"

#include <limits>

namespace shadecache {

bool Cache::do_compact_one() {
  // Classes holding at least a page's worth of free slots: the emptiest of their pages has no more
  // values than there are free slots on the others.
  // (The chunks, then the head classes in use: a put into a full cache asks this every time.)
  auto qualifies = [&](uint32_t c) {
    const ClassMeta& cm = slab_.cls(c);
    return cm.free_slots >= cm.slots_per_page ? uint64_t{1} << c : 0;
  };
  uint64_t classes = qualifies(kChunkClass);
  for (const auto& entry : slab_.do_head_classes()) classes |= qualifies(entry.second);
  if (!classes) return false;
  // Pages that views keep (a zombie, a pinned value) cannot be emptied.
  std::vector<uint8_t> pinned;
  if (pins_.any()) {
    do_reap_dead_pins();
    std::vector<uint32_t> codes;
    pins_.snapshot(&codes);
    pinned.assign(hdr_->num_pages, 0);
    for (uint32_t c : codes)
      if (slab_.offset(c) < data_bytes_) pinned[slab_.page_of(slab_.offset(c))] = 1;
  }
  uint64_t best = hdr_->num_pages, best_cost = std::numeric_limits<uint64_t>::max();
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.cls >= slab_.num_classes() || !((classes >> pm.cls) & 1) || pm.zombies || (!pinned.empty() && pinned[p]))
      continue;
    uint64_t cost = uint64_t{pm.live} * slab_.cls(pm.cls).slot_size;  // bytes to copy
    if (cost < best_cost) {
      best = p;
      best_cost = cost;
    }
  }
  if (best == hdr_->num_pages) return false;
  do_empty_page(best);  // progress either way: the page goes free, or it holds a zombie now
  return true;
}

bool Cache::do_empty_page(uint64_t p) {
  PageMeta& pm = pages_[p];
  const uint32_t c = pm.cls;
  ClassMeta& cm = slab_.cls(c);
  // Its free slots leave the free list first, so that every value moves to another page.
  for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
    uint64_t off = slab_.slot_off(p, i);
    if (slab_.is_free(c, off)) slab_.do_unlink_free_slot(c, off);
  }
  bool stays = false;
  for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
    uint64_t off = slab_.slot_off(p, i);
    if (!slab_.is_free(c, off)) {
      if (c == kChunkClass)
        do_move_chunk(off);
      else
        stays |= !do_move_head(off);
    }
    if (i == cm.slots_per_page / 2) crash_point(CrashPoint::kCompactMid);
  }
  if (stays) {  // a zombie keeps the page in its class: its free slots go back on the list
    for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
      uint64_t off = slab_.slot_off(p, i);
      if (slab_.is_free(c, off)) slab_.do_push_free_slot(c, off);
    }
    return false;
  }
  --cm.pages;
  slab_.do_push_free_page(p);
  hdr_->stats.page_moves.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool Cache::do_move_head(uint64_t off) {
  SlotHeader* s = slab_.slot(off);
  const uint32_t id = s->id, len = s->len;
  const uint64_t to = slab_.do_pop_free_slot(pages_[slab_.page_of(off)].cls) - 1;
  SlotHeader* d = slab_.slot(to);
  uint32_t seq = d->seq.load(std::memory_order_relaxed);
  d->seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  d->id = id;
  d->len = len;
  d->crc = s->crc;
  std::memcpy(slab_.value(to), slab_.value(off), head_bytes(len, chunk_shift_) - sizeof(SlotHeader));
  d->seq.store(seq + 2, std::memory_order_release);
  crash_point(CrashPoint::kRelocateAfterCopy);
  idx_set(id, to + 1, std::memory_order_release);  // readers go to the copy from here on
  crash_point(CrashPoint::kRelocateAfterPublish);
  slab_.do_count_live(to, +1);
  slab_.do_count_live(off, -1);
  hdr_->stats.relocations.fetch_add(1, std::memory_order_relaxed);
  // The old slot is unreachable now (pins.h: unpublish, then ask).
  if ((len >> chunk_shift_) == 0 && do_slot_pinned(off)) {
    do_push_zombie(off);
    return false;
  }
  uint32_t old = s->seq.load(std::memory_order_relaxed);
  s->seq.store(old + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s->id = kNoId;
  s->seq.store(old + 2, std::memory_order_release);
  return true;
}

void Cache::do_move_chunk(uint64_t off) {
  const uint64_t c = off >> chunk_shift_;
  const uint32_t id = slab_.owner(c);
  const uint64_t head = idx_get(id, std::memory_order_relaxed) - 1;
  SlotHeader* h = slab_.slot(head);
  uint32_t* refs = slab_.refs(head);
  const uint64_t k = h->len >> chunk_shift_;
  uint64_t i = 0;
  while (i < k && refs[i] != c) ++i;  // chunk_owner names the value, so its head names the chunk
  const uint64_t to = slab_.do_pop_free_slot(kChunkClass) - 1;
  std::memcpy(slab_.at(to), slab_.at(off), uint64_t{1} << chunk_shift_);
  crash_point(CrashPoint::kChunkMoveAfterCopy);
  uint32_t seq = h->seq.load(std::memory_order_relaxed);
  h->seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&refs[i], static_cast<uint32_t>(to >> chunk_shift_), __ATOMIC_RELAXED);
  crash_point(CrashPoint::kChunkMoveMidRelink);
  h->seq.store(seq + 2, std::memory_order_release);
  slab_.owner(to >> chunk_shift_) = id;
  slab_.owner(c) = kNoId;
  slab_.do_count_live(to, +1);
  slab_.do_count_live(off, -1);
  hdr_->stats.relocations.fetch_add(1, std::memory_order_relaxed);
}

// ---- the heap's pages --------------------------------------------------------------------------
// A page joins the heap under an odd generation (a reader holding a stale offset into it
// retries), is named in heap_table, and only then counted: a writer killed before the count
// leaves a heap page that repair frees. Leaving, the count drops first, then the page is freed.

void Cache::do_heap_grow() {
  uint64_t p = slab_.do_pop_free_page();  // the caller made sure one is free
  PageMeta& pm = pages_[p];
  Slab::begin_change(pm);
  pm.cls = kHeapPage;
  pm.live = pm.zombies = 0;
  Slab::end_change(pm);
  heap_table_[hdr_->heap_pages] = static_cast<uint32_t>(p);
  crash_point(CrashPoint::kHeapGrowMid);
  ++hdr_->heap_pages;
}

bool Cache::do_heap_give_back(uint64_t reserve) {
  const uint64_t npp = heap_.per_page();
  const uint64_t nodes = heap_.size() + reserve;
  bool gave = false;
  // Keep a quarter page of room beyond the nodes in use, so that a cache whose item count
  // hovers at a page boundary does not give and take a page on every put.
  while (hdr_->heap_pages && (nodes == 0 || nodes + npp / 4 <= (hdr_->heap_pages - 1) * npp)) {
    uint64_t p = heap_table_[--hdr_->heap_pages];
    crash_point(CrashPoint::kHeapShrinkMid);
    slab_.do_push_free_page(p);
    gave = true;
  }
  return gave;
}

}  // namespace shadecache
