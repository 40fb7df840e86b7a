// check(): the whole structure walked under the lock, the first fault described.
#include "cache/cache.h"

#include <cmath>

#include "common/crc32c.h"

namespace shadecache {

void Cache::check() {
  Use use(*this);
  std::string fault;
  {
    WriteLock lock(this);
    fault = do_check();
  }
  if (!fault.empty()) throw Error(ErrorKind::kCorruption, "cache '" + name_ + "': " + fault);
}

std::string Cache::do_check() {
  std::string f = heap_.check(n_);
  if (!f.empty()) return f;
  f = slab_.check_free_lists();
  if (!f.empty()) return f;
  uint64_t items = 0, bytes = 0, free_pages = 0, zombies = 0;
  std::vector<uint64_t> class_pages(slab_.num_classes()), class_items(slab_.num_classes()),
      class_zombies(slab_.num_classes());
  uint64_t run_head = 0, run_end = 0;  // the latest run seen: pages [run_head, run_end)
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.gen.load(std::memory_order_relaxed) & 1) return "page " + std::to_string(p) + " is stuck mid-move";
    if (pm.cls == kFreePage) {
      if (run_end > p) return "page " + std::to_string(p) + " lies inside a run but is free";
      ++free_pages;
      continue;
    }
    if (pm.cls == kRunTail) {
      if (run_end <= p || pm.next_free_page != run_head + 1)
        return "page " + std::to_string(p) + " is a run tail outside the run that it names";
      continue;
    }
    bool run = pm.cls == kRunHead;
    if (!run && pm.cls >= slab_.num_classes()) return "page " + std::to_string(p) + " has invalid class " + std::to_string(pm.cls);
    if (run_end > p) return "page " + std::to_string(p) + " lies inside a run but is not its tail";
    if (run) {
      uint64_t k = slab_.run_len(p);
      if (k < 2 || k > hdr_->num_pages - p) return "run at page " + std::to_string(p) + " has length " + std::to_string(k);
      run_head = p;
      run_end = p + k;
    } else {
      ++class_pages[pm.cls];
    }
    // A run head has one slot, as long as its run; a page of a class, slots_per_page slots.
    uint32_t slots = run ? 1 : slab_.cls(pm.cls).slots_per_page;
    uint64_t slot_size = run ? (run_end - p) * page_size_ : slab_.cls(pm.cls).slot_size;
    uint32_t live = 0, page_zombies = 0;
    double key_sum = 0;
    for (uint32_t i = 0; i < slots; ++i) {
      uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * slot_size;
      const SlotHeader* s = slab_.slot(off);
      if (s->zombie) {  // kept for a view; its bytes are the view's business
        if (!run) ++class_zombies[pm.cls];
        ++zombies;
        ++page_zombies;
        continue;
      }
      if (s->id == kNoId) continue;
      std::string where = "slot at offset " + std::to_string(off) + " (id " + std::to_string(s->id) + ")";
      if (s->id >= n_) return where + " names an id out of range";
      if (s->seq.load(std::memory_order_relaxed) & 1) return where + " is stuck mid-write";
      if (idx_get(s->id, std::memory_order_relaxed) != off + 1) return where + " is not the one the index names";
      if (s->len > slot_size - sizeof(SlotHeader)) return where + " claims a length larger than its slot";
      if (crc32c(slab_.value(off), s->len) != s->crc) return where + " fails its checksum";
      if (!heap_.contains(s->id)) return where + " is not in the eviction heap";
      double key = heap_.key_of(s->id);
      std::string bad = policy_->check_key(pstate_, s->id, key);
      if (!bad.empty()) return where + " " + bad;
      ++live;
      key_sum += key;
      bytes += s->len;
    }
    if (live != pm.live) return "page " + std::to_string(p) + " counts " + std::to_string(pm.live) + " live slots, holds " + std::to_string(live);
    if (page_zombies != pm.zombies)
      return "page " + std::to_string(p) + " counts " + std::to_string(pm.zombies) + " zombies, holds " + std::to_string(page_zombies);
    if (live == 0 && page_zombies == 0)
      return "page " + std::to_string(p) + " of class " + std::to_string(pm.cls) + " holds nothing but is not on the free page list";
    if (std::fabs(key_sum - pm.key_sum) > 1e-6 * (std::fabs(key_sum) + live + 1))
      return "page " + std::to_string(p) + " key sum " + std::to_string(pm.key_sum) + " but its values' keys add to " +
             std::to_string(key_sum);
    if (!run) class_items[pm.cls] += live;
    items += live;
  }
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    const ClassMeta& cm = slab_.cls(c);
    if (cm.pages != class_pages[c] || cm.items != class_items[c])
      return "class " + std::to_string(c) + " counts disagree with its pages";
    if (cm.items + cm.free_slots + class_zombies[c] != cm.pages * cm.slots_per_page)
      return "class " + std::to_string(c) + ": items + free slots + zombies != slots in its pages";
  }
  uint64_t listed = 0;
  for (uint64_t u = hdr_->free_page_head; u && listed <= hdr_->num_pages; u = pages_[u - 1].next_free_page) {
    if (u > hdr_->num_pages || pages_[u - 1].cls != kFreePage) return "free page list names a page in use";
    ++listed;
  }
  uint64_t listed_zombies = 0;
  for (uint64_t u = hdr_->zombie_head; u && listed_zombies <= zombies; u = slab_.slot((u - 1) * kAlign)->next_free) {
    if ((u - 1) * kAlign >= data_bytes_ || !slab_.is_slot_start((u - 1) * kAlign) || !slab_.slot((u - 1) * kAlign)->zombie)
      return "zombie list names slot " + std::to_string(u) + ", which is not a zombie";
    ++listed_zombies;
  }
  if (listed_zombies != zombies || zombies != hdr_->zombies)
    return "zombie list holds " + std::to_string(listed_zombies) + " slots, header counts " +
           std::to_string(hdr_->zombies) + ", pages hold " + std::to_string(zombies);
  if (listed != free_pages) return "free page list holds " + std::to_string(listed) + " pages, " + std::to_string(free_pages) + " are free";
  if (items != hdr_->items || items != heap_.size())
    return "items: header " + std::to_string(hdr_->items) + ", heap " + std::to_string(heap_.size()) + ", slots " + std::to_string(items);
  if (bytes > hdr_->capacity_bytes)
    return "values hold " + std::to_string(bytes) + " bytes, over the budget of " + std::to_string(hdr_->capacity_bytes);
  if (bytes != hdr_->bytes_used) return "bytes_used says " + std::to_string(hdr_->bytes_used) + ", slots hold " + std::to_string(bytes);
  uint64_t indexed = 0;
  for (uint64_t id = 0; id < n_; ++id) indexed += idx_get(id, std::memory_order_relaxed) != 0;
  if (indexed != items) return std::to_string(indexed) + " index entries for " + std::to_string(items) + " live slots";
  return "";
}

}  // namespace shadecache
