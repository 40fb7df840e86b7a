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
  if (hdr_->heap_pages > hdr_->heap_table_len) return "heap page count beyond its table";
  if (heap_.size() > heap_capacity()) return "heap holds more nodes than its pages";
  std::vector<uint8_t> heap_page(hdr_->num_pages);
  for (uint64_t h = 0; h < hdr_->heap_pages; ++h) {
    uint32_t p = heap_table_[h];
    if (p >= hdr_->num_pages || pages_[p].cls != kHeapPage || heap_page[p]) return "heap table names page " + std::to_string(p) + ", not a heap page of its own";
    heap_page[p] = 1;
  }
  std::string f = heap_.check(n_);
  if (!f.empty()) return f;
  f = slab_.check_free_lists();
  if (!f.empty()) return f;
  uint64_t items = 0, bytes = 0, zombies = 0;
  std::vector<uint64_t> class_pages(slab_.num_classes()), class_items(slab_.num_classes()),
      class_zombies(slab_.num_classes());
  std::vector<uint32_t> chunk_users(num_chunks_, kNoId);  // the live head naming each chunk
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.gen.load(std::memory_order_relaxed) & 1) return "page " + std::to_string(p) + " is stuck mid-change";
    if (pm.cls == kFreePage) continue;
    if (pm.cls == kHeapPage) {
      if (!heap_page[p]) return "page " + std::to_string(p) + " holds heap nodes but the heap table does not name it";
      continue;
    }
    if (pm.cls >= slab_.num_classes() || slab_.cls(pm.cls).slot_size == 0)
      return "page " + std::to_string(p) + " has invalid class " + std::to_string(pm.cls);
    ++class_pages[pm.cls];
    if (pm.cls == kChunkClass) continue;  // counted from the heads that name the chunks, below
    const ClassMeta& cm = slab_.cls(pm.cls);
    uint32_t live = 0, page_zombies = 0;
    for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
      uint64_t off = p * page_size_ + uint64_t{i} * cm.slot_size;
      const SlotHeader* s = slab_.slot(off);
      if (s->id == kNoId) continue;
      std::string where = "slot at offset " + std::to_string(off) + " (id " + std::to_string(s->id) + ")";
      if (s->id >= n_) return where + " names an id out of range";
      if (idx_get(s->id, std::memory_order_relaxed) != off + 1) {  // not live: kept for a view
        ++class_zombies[pm.cls];
        ++zombies;
        ++page_zombies;
        continue;
      }
      if (s->seq.load(std::memory_order_relaxed) & 1) return where + " is stuck mid-write";
      if (head_bytes(s->len, chunk_shift_) > cm.slot_size) return where + " claims a length larger than its slot";
      const uint64_t k = s->len >> chunk_shift_;
      const uint32_t* refs = slab_.refs(off);
      for (uint64_t j = 0; j < k; ++j) {
        uint32_t c = refs[j];
        if (c >= num_chunks_ || pages_[c / kChunksPerPage].cls != kChunkClass)
          return where + " names chunk " + std::to_string(c) + ", not a chunk of a chunk page";
        if (chunk_users[c] != kNoId) return where + " names chunk " + std::to_string(c) + ", which another value names too";
        if (slab_.owner(c) != s->id) return where + " names chunk " + std::to_string(c) + ", owned by " + std::to_string(slab_.owner(c));
        chunk_users[c] = s->id;
      }
      std::vector<char> v(s->len);
      SlotAt at{index_[s->id].load(std::memory_order_relaxed), off, &pages_[p], pm.gen.load(std::memory_order_relaxed),
                const_cast<SlotHeader*>(s), s->seq.load(std::memory_order_relaxed), s->len, s->crc};
      copy_value(at, v.data());
      if (crc32c(v.data(), s->len) != s->crc) return where + " fails its checksum";
      if (!heap_.contains(s->id)) return where + " is not in the eviction heap";
      double key = heap_.key_of(s->id);
      std::string bad = policy_->check_key(pstate_, s->id, key);
      if (!bad.empty()) return where + " " + bad;
      ++live;
      bytes += s->len;
    }
    if (live != pm.live) return "page " + std::to_string(p) + " counts " + std::to_string(pm.live) + " live slots, holds " + std::to_string(live);
    if (page_zombies != pm.zombies)
      return "page " + std::to_string(p) + " counts " + std::to_string(pm.zombies) + " zombies, holds " + std::to_string(page_zombies);
    if (live == 0 && page_zombies == 0)
      return "page " + std::to_string(p) + " of class " + std::to_string(pm.cls) + " holds nothing but is not on the free page list";
    class_items[pm.cls] += live;
    items += live;
  }
  // Chunks: owned exactly when a live head names them, counted per page.
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    if (pages_[p].cls != kChunkClass) continue;
    uint32_t live = 0;
    for (uint32_t i = 0; i < kChunksPerPage; ++i) {
      uint64_t c = p * kChunksPerPage + i;
      if ((slab_.owner(c) != kNoId) != (chunk_users[c] != kNoId))
        return "chunk " + std::to_string(c) + " has owner " + std::to_string(slab_.owner(c)) + " but " +
               (chunk_users[c] == kNoId ? "no value names it" : "a value names it");
      live += chunk_users[c] != kNoId;
    }
    if (live != pages_[p].live) return "chunk page " + std::to_string(p) + " counts " + std::to_string(pages_[p].live) + " chunks in use, holds " + std::to_string(live);
    if (live == 0) return "chunk page " + std::to_string(p) + " holds nothing but is not on the free page list";
    class_items[kChunkClass] += live;
  }
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    const ClassMeta& cm = slab_.cls(c);
    if (cm.pages != class_pages[c] || cm.items != class_items[c])
      return "class " + std::to_string(c) + " counts disagree with its pages";
    if (cm.items + cm.free_slots + class_zombies[c] != cm.pages * cm.slots_per_page)
      return "class " + std::to_string(c) + ": items + free slots + zombies != slots in its pages";
  }
  uint64_t listed_zombies = 0;
  for (uint64_t u = hdr_->zombie_head; u && listed_zombies <= zombies; u = slab_.slot(slab_.offset(static_cast<uint32_t>(u)))->next_zombie) {
    uint64_t off = slab_.offset(static_cast<uint32_t>(u));
    const SlotHeader* s = slab_.slot(off);
    if (off >= data_bytes_ || !slab_.is_slot_start(off) || s->id == kNoId || idx_get(s->id, std::memory_order_relaxed) == off + 1)
      return "zombie list names slot " + std::to_string(u) + ", which is not a zombie";
    ++listed_zombies;
  }
  if (listed_zombies != zombies || zombies != hdr_->zombies)
    return "zombie list holds " + std::to_string(listed_zombies) + " slots, header counts " +
           std::to_string(hdr_->zombies) + ", pages hold " + std::to_string(zombies);
  if (items != hdr_->items || items != heap_.size())
    return "items: header " + std::to_string(hdr_->items) + ", heap " + std::to_string(heap_.size()) + ", slots " + std::to_string(items);
  if (bytes != hdr_->bytes_used) return "bytes_used says " + std::to_string(hdr_->bytes_used) + ", slots hold " + std::to_string(bytes);
  uint64_t indexed = 0;
  for (uint64_t id = 0; id < n_; ++id) indexed += index_[id].load(std::memory_order_relaxed) != 0;
  if (indexed != items) return std::to_string(indexed) + " index entries for " + std::to_string(items) + " live slots";
  return "";
}

}  // namespace shadecache
