// Pins seen from the writer side, and zombies: slots a view keeps after their value was evicted,
// replaced or removed (docs/shared_memory.md, "Views"). Every function runs with the mutex held.
#include "cache/cache.h"

#include <time.h>

#include <algorithm>

namespace shadecache {

bool Cache::do_slot_pinned(uint64_t off) {
  // Orders the caller's unpublish / odd seq before the pin table loads (see pins.h).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return pins_.any() && pins_.pinned(slot_code(off));
}

void Cache::do_push_zombie(uint64_t off) {
  SlotHeader* s = slab_.slot(off);
  s->next_zombie = static_cast<uint32_t>(hdr_->zombie_head);
  hdr_->zombie_head = slot_code(off);
  ++hdr_->zombies;
  slab_.do_count_zombie(off, +1);
}

void Cache::do_reclaim_zombies() {
  if (hdr_->zombies == 0) return;
  std::vector<uint32_t> codes;
  pins_.snapshot(&codes);
  bool still_pinned = false;
  // prev: the zombie before `u` that stays listed (nullptr: `u` is the head).
  uint64_t u = hdr_->zombie_head;
  SlotHeader* prev = nullptr;
  while (u) {
    uint64_t off = slab_.offset(static_cast<uint32_t>(u));
    SlotHeader* s = slab_.slot(off);
    uint64_t next = s->next_zombie;
    if (std::binary_search(codes.begin(), codes.end(), static_cast<uint32_t>(u))) {
      still_pinned = true;
      prev = s;
    } else {
      // Unreachable (unpublished) and no view left: free it. A crash between the unlink and the
      // push leaves it on neither list; repair rebuilds both from the slot headers.
      if (prev) prev->next_zombie = static_cast<uint32_t>(next); else hdr_->zombie_head = next;
      --hdr_->zombies;
      uint32_t seq = s->seq.load(std::memory_order_relaxed);
      s->seq.store(seq + 1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
      s->id = kNoId;
      s->seq.store(seq + 2, std::memory_order_release);
      slab_.do_free_slot(off);
      slab_.do_count_zombie(off, -1);
      slab_.do_release_if_empty(slab_.page_of(off));
    }
    u = next;
  }
  if (still_pinned) do_reap_dead_pins();  // the next call frees what dead processes pinned
}

void Cache::do_reap_dead_pins() {
  // Each check reads /proc for every record in use: throttled, as pins of the dead only cost memory.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  if (last_reap_ns_ && now - last_reap_ns_ < 100000000ull) return;
  last_reap_ns_ = now;
  pins_.reap_dead();
}

}  // namespace shadecache
