#include "cache/slab.h"

#include <cstring>

namespace shadecache {

uint32_t Slab::build_classes(ClassMeta* classes, uint64_t page_size) {
  uint32_t n = 0;
  uint64_t size = 128;
  while (size < page_size && n < kMaxClasses - 1) {
    // Give each class the largest slot that still fits the same number of slots in a page: the
    // space would be lost at the end of the page anyway.
    uint64_t per_page = page_size / size;
    uint64_t widest = (page_size / per_page) / kAlign * kAlign;
    if (widest >= page_size) break;
    std::memset(&classes[n], 0, sizeof(ClassMeta));
    classes[n].slot_size = static_cast<uint32_t>(widest);
    classes[n].slots_per_page = static_cast<uint32_t>(page_size / widest);
    ++n;
    size = align_up(static_cast<uint64_t>(widest * 1.25) + 1, kAlign);
  }
  std::memset(&classes[n], 0, sizeof(ClassMeta));
  classes[n].slot_size = static_cast<uint32_t>(page_size);
  classes[n].slots_per_page = 1;
  return n + 1;
}

void Slab::init() {
  for (uint32_t c = 0; c < num_classes_; ++c) {
    classes_[c].free_head = 0;
    classes_[c].free_slots = 0;
    classes_[c].pages = 0;
    classes_[c].items = 0;
  }
  *free_page_head_ = 0;
  for (uint64_t p = num_pages_; p-- > 0;) {
    pages_[p].cls = kFreePage;
    pages_[p].live = 0;
    pages_[p].zombies = 0;
    pages_[p].next_free_page = static_cast<uint32_t>(*free_page_head_);
    *free_page_head_ = p + 1;
  }
}

int Slab::class_for(uint64_t value_len) const {
  uint64_t need = value_len + sizeof(SlotHeader);
  // Classes are few (<= 64) and sorted: a linear scan over one or two cache lines of slot sizes
  // would be as fast as a binary search; we binary search anyway to keep it O(log) for big pages.
  uint32_t lo = 0, hi = num_classes_;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (classes_[mid].slot_size >= need)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo < num_classes_ ? static_cast<int>(lo) : -1;
}

bool Slab::is_slot_start(uint64_t off) const {
  uint64_t p = page_of(off);
  if (p >= num_pages_) return false;
  uint32_t c = pages_[p].cls;
  if (c >= num_classes_) return false;
  uint64_t in_page = off - p * page_size_;
  const ClassMeta& cm = classes_[c];
  return in_page % cm.slot_size == 0 && in_page / cm.slot_size < cm.slots_per_page;
}

uint64_t Slab::do_pop_free_slot(uint32_t c) {
  ClassMeta& cm = classes_[c];
  if (cm.free_head == 0) return 0;
  uint64_t off = offset(static_cast<uint32_t>(cm.free_head));
  do_unlink_free_slot(c, off);
  return off + 1;
}

void Slab::do_push_free_slot(uint32_t c, uint64_t off) {
  ClassMeta& cm = classes_[c];
  SlotHeader* s = slot(off);
  s->prev_free = 0;
  s->next_free = static_cast<uint32_t>(cm.free_head);
  if (cm.free_head) slot(offset(static_cast<uint32_t>(cm.free_head)))->prev_free = unit(off);
  cm.free_head = unit(off);
  ++cm.free_slots;
}

void Slab::do_unlink_free_slot(uint32_t c, uint64_t off) {
  ClassMeta& cm = classes_[c];
  SlotHeader* s = slot(off);
  if (s->prev_free)
    slot(offset(s->prev_free))->next_free = s->next_free;
  else
    cm.free_head = s->next_free;
  if (s->next_free) slot(offset(s->next_free))->prev_free = s->prev_free;
  s->next_free = s->prev_free = 0;
  --cm.free_slots;
}

void Slab::do_push_free_page(uint64_t p) {
  // The caller has already taken the page out of its class (no live slot, no listed free slot).
  pages_[p].cls = kFreePage;
  pages_[p].live = 0;
  pages_[p].zombies = 0;
  pages_[p].key_sum = 0;
  pages_[p].next_free_page = static_cast<uint32_t>(*free_page_head_);
  *free_page_head_ = p + 1;
}

bool Slab::do_release_if_empty(uint64_t p) {
  PageMeta& pm = pages_[p];
  if (pm.cls >= num_classes_ || pm.live || pm.zombies) return false;
  ClassMeta& cm = classes_[pm.cls];
  for (uint32_t i = 0; i < cm.slots_per_page; ++i) do_unlink_free_slot(pm.cls, p * page_size_ + uint64_t{i} * cm.slot_size);
  --cm.pages;
  do_push_free_page(p);
  return true;
}

uint64_t Slab::do_take_slot(uint32_t c) {
  if (uint64_t u = do_pop_free_slot(c)) return u;
  return do_take_free_page(c) ? do_pop_free_slot(c) : 0;
}

bool Slab::do_take_free_page(uint32_t c) {
  if (*free_page_head_ == 0) return false;
  uint64_t p = *free_page_head_ - 1;
  *free_page_head_ = pages_[p].next_free_page;
  pages_[p].next_free_page = 0;
  do_cut_page(p, c);
  return true;
}

void Slab::do_cut_page(uint64_t p, uint32_t c) {
  PageMeta& pm = pages_[p];
  uint64_t g = pm.gen.load(std::memory_order_relaxed);
  // Odd generation first: a reader that read the even one before will see it changed and retry.
  pm.gen.store(g + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  ClassMeta& cm = classes_[c];
  pm.cls = c;
  pm.live = 0;
  pm.zombies = 0;
  pm.key_sum = 0;
  ++cm.pages;
  uint64_t base = p * page_size_;
  for (uint32_t i = cm.slots_per_page; i-- > 0;) {
    uint64_t off = base + static_cast<uint64_t>(i) * cm.slot_size;
    SlotHeader* s = slot(off);
    s->seq.store(0, std::memory_order_relaxed);
    s->id = kNoId;
    s->len = 0;
    s->crc = 0;
    s->zombie = 0;
    do_push_free_slot(c, off);
  }
  pm.gen.store(g + 2, std::memory_order_release);
}

std::string Slab::check_free_lists() const {
  for (uint32_t c = 0; c < num_classes_; ++c) {
    const ClassMeta& cm = classes_[c];
    uint64_t count = 0, prev = 0;
    for (uint64_t u = cm.free_head; u; u = slot(offset(static_cast<uint32_t>(u)))->next_free) {
      uint64_t off = offset(static_cast<uint32_t>(u));
      if (off >= num_pages_ * page_size_ || !is_slot_start(off))
        return "free list of class " + std::to_string(c) + " points outside any slot (offset " + std::to_string(off) + ")";
      if (pages_[page_of(off)].cls != c)
        return "free slot at offset " + std::to_string(off) + " is on a page of another class";
      const SlotHeader* s = slot(off);
      if (s->id != kNoId) return "free slot at offset " + std::to_string(off) + " still names id " + std::to_string(s->id);
      if (s->prev_free != prev) return "free list of class " + std::to_string(c) + " has a broken back link";
      prev = u;
      if (++count > cm.free_slots) break;
    }
    if (count != cm.free_slots)
      return "class " + std::to_string(c) + " counts " + std::to_string(cm.free_slots) + " free slots but its list holds " +
             std::to_string(count);
  }
  return "";
}

}  // namespace shadecache
