#include "cache/slab.h"

#include <algorithm>
#include <cstring>

#include "cache/crash_point.h"

namespace shadecache {

uint32_t Slab::init_classes(ClassMeta* classes, uint64_t page_size, const std::vector<uint32_t>& fitted) {
  std::memset(classes, 0, kMaxClasses * sizeof(ClassMeta));
  classes[0].slot_size = static_cast<uint32_t>(page_size);
  classes[0].slots_per_page = 1;
  uint32_t n = 1;
  for (uint32_t slot : fitted) {
    if (n == kMaxClasses || slot >= page_size) break;
    classes[n].slot_size = slot;
    classes[n].slots_per_page = static_cast<uint32_t>(page_size / slot);
    classes[n].fitted = 1;
    ++n;
  }
  return kMaxClasses;
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

uint32_t Slab::do_class_for(uint64_t value_len) {
  uint64_t need = need_for(value_len);
  if (sorted_gen_ == *class_gen_ && need == last_need_) return last_cls_;
  if (sorted_gen_ != *class_gen_) {
    sorted_.clear();
    for (uint32_t c = 0; c < num_classes_; ++c)
      if (classes_[c].slot_size) sorted_.emplace_back(classes_[c].slot_size, c);
    std::sort(sorted_.begin(), sorted_.end());
    sorted_gen_ = *class_gen_;
  }
  auto fit = std::lower_bound(sorted_.begin(), sorted_.end(), std::make_pair(static_cast<uint32_t>(need), 0u));
  // Entry 0 (the whole page) holds any value that may be put, so `fit` is never the end.
  uint64_t widest = widest_slot(need, page_size_);
  uint32_t cls = fit->second;
  // A value within the sizes the classes were fitted to goes to its fitted class: they were cut
  // for the whole mix and the cache's page count. Otherwise the closest class, and when that one
  // wastes more than a class cut for this size would, at a quarter of the pages in use, the
  // smallest class that holds it among those that have pages.
  auto first_fitted = std::find_if(fit, sorted_.end(), [&](const auto& e) { return classes_[e.second].fitted; });
  bool in_fitted_range = first_fitted != sorted_.end();
  if (in_fitted_range) {
    cls = first_fitted->second;
  } else if (fit->first > std::max(widest, need + need / 32) && do_classes_in_use() >= max_classes_in_use(num_pages_)) {
    auto used = std::find_if(fit, sorted_.end(), [&](const auto& e) { return classes_[e.second].pages > 0; });
    if (used != sorted_.end()) cls = used->second;
  } else if (fit->first > std::max(widest, need + need / 32)) {
    // Too loose: cut a class for this size, in an unused entry or one with no page left. Not
    // when classes hold a quarter of the pages already: each class keeps a page partly cut, and
    // in a cache of few pages a class per size would move pages back and forth between classes.
    uint32_t free_entry = 0;
    for (uint32_t c = 1; c < num_classes_ && !free_entry; ++c)
      if (classes_[c].slot_size == 0) free_entry = c;
    for (uint32_t c = 1; c < num_classes_ && !free_entry; ++c)
      if (classes_[c].pages == 0 && !classes_[c].fitted) free_entry = c;  // no page, hence no slot
    if (free_entry) {
      ClassMeta& cm = classes_[free_entry];
      // The generation first (every process drops its copy of the table, even if we die next),
      // then the entry, slot_size last (nonzero marks it in use). Repair recomputes
      // slots_per_page from slot_size, so a writer killed in between leaves a consistent entry.
      ++*class_gen_;
      cm.slot_size = 0;
      cm.slots_per_page = static_cast<uint32_t>(page_size_ / widest);
      cm.free_head = cm.free_slots = cm.pages = cm.items = cm.fitted = 0;
      cm.slot_size = static_cast<uint32_t>(widest);
      sorted_gen_ = ~uint64_t{0};
      return do_class_for(value_len);
    }
  }
  last_need_ = need;
  last_cls_ = cls;
  return cls;
}

uint64_t Slab::do_classes_in_use() const {
  uint64_t n = 0;
  for (uint32_t c = 0; c < num_classes_; ++c) n += classes_[c].slot_size && classes_[c].pages;
  return n;
}

bool Slab::is_slot_start(uint64_t off) const {
  uint64_t p = page_of(off);
  if (p >= num_pages_) return false;
  uint32_t c = pages_[p].cls;
  uint64_t in_page = off - p * page_size_;
  if (c == kRunHead) return in_page == 0;
  if (c >= num_classes_ || classes_[c].slot_size == 0) return false;
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
  if (pm.cls == kRunHead && !pm.live && !pm.zombies) {
    // Its slot is unpublished and unpinned (seq bumped when it was freed); a reader still holding
    // the old offset fails on that seq, and the page generation changes when a page is reused.
    uint64_t k = run_len(p);
    for (uint64_t q = p + k; q-- > p;) {
      do_push_free_page(q);
      if (q == p + k / 2) crash_point(CrashPoint::kRunMidRelease);
    }
    return true;
  }
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

uint64_t Slab::do_take_run(uint64_t k) {
  if (k == 0 || k > num_pages_) return 0;
  uint64_t head = num_pages_;
  for (uint64_t p = 0, free_run = 0; p < num_pages_; ++p) {
    free_run = pages_[p].cls == kFreePage ? free_run + 1 : 0;
    if (free_run == k) {
      head = p + 1 - k;
      break;
    }
  }
  if (head == num_pages_) return 0;
  // Off the free page list (one pass over it), then marked page by page, each under an odd
  // generation (a reader holding a stale offset into one of them retries). A writer killed half
  // way leaves pages that are neither listed nor a whole run: repair frees them.
  uint64_t prev = 0;  // page index + 1 of the last page kept on the list, 0 = the head pointer
  for (uint64_t u = *free_page_head_; u;) {
    uint64_t q = u - 1;
    uint64_t next = pages_[q].next_free_page;
    if (q >= head && q < head + k) {
      if (prev) pages_[prev - 1].next_free_page = static_cast<uint32_t>(next); else *free_page_head_ = next;
    } else {
      prev = u;
    }
    u = next;
  }
  for (uint64_t q = head; q < head + k; ++q) {
    PageMeta& pm = pages_[q];
    uint64_t g = pm.gen.load(std::memory_order_relaxed);
    pm.gen.store(g + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    pm.live = pm.zombies = 0;
    pm.key_sum = 0;
    if (q == head) {
      SlotHeader* s = slot(q * page_size_);
      s->seq.store(0, std::memory_order_relaxed);
      s->id = kNoId;
      s->len = s->crc = s->zombie = s->next_free = s->prev_free = 0;
      pm.next_free_page = static_cast<uint32_t>(k);
      pm.cls = kRunHead;
    } else {
      pm.next_free_page = static_cast<uint32_t>(head + 1);
      pm.cls = kRunTail;
    }
    pm.gen.store(g + 2, std::memory_order_release);
    if (q == head + k / 2) crash_point(CrashPoint::kRunMidTake);
  }
  return head + 1;
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
