#include "cache/slab.h"

#include <algorithm>
#include <cstring>

namespace shadecache {

uint32_t Slab::init_classes(ClassMeta* classes, uint64_t page_size, const std::vector<uint32_t>& fitted) {
  std::memset(classes, 0, kMaxClasses * sizeof(ClassMeta));
  classes[kChunkClass].slot_size = static_cast<uint32_t>(page_size / kChunksPerPage);
  classes[kChunkClass].slots_per_page = kChunksPerPage;
  classes[kPageClass].slot_size = static_cast<uint32_t>(page_size);
  classes[kPageClass].slots_per_page = 1;
  uint32_t n = kPageClass + 1;
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
  *free_pages_ = 0;
  for (uint64_t p = num_pages_; p-- > 0;) do_push_free_page(p);
}

const std::vector<std::pair<uint32_t, uint32_t>>& Slab::do_head_classes() {
  if (sorted_gen_ != *class_gen_) {
    sorted_.clear();
    for (uint32_t c = kPageClass; c < num_classes_; ++c)
      if (classes_[c].slot_size) sorted_.emplace_back(classes_[c].slot_size, c);
    std::sort(sorted_.begin(), sorted_.end());
    sorted_gen_ = *class_gen_;
  }
  return sorted_;
}

uint32_t Slab::do_class_for(uint64_t need) {
  if (sorted_gen_ == *class_gen_ && need == last_need_) return last_cls_;
  do_head_classes();
  auto fit = std::lower_bound(sorted_.begin(), sorted_.end(), std::make_pair(static_cast<uint32_t>(need), 0u));
  // Entry 1 (the whole page) holds any head that may be put, so `fit` is never the end.
  const uint64_t u = unit();
  uint64_t widest = page_size_ / (page_size_ / need) / u * u;
  uint32_t cls = fit->second;
  // A head within the sizes the classes were fitted to goes to its fitted class: they were cut
  // for the whole mix. Otherwise the closest class, and when that one wastes more than a class
  // cut for this size would, at a quarter of the pages in use, the smallest class that holds it
  // among those that have pages.
  auto first_fitted = std::find_if(fit, sorted_.end(), [&](const auto& e) { return classes_[e.second].fitted; });
  bool loose = fit->first > std::max(widest, need + need / 32);
  if (first_fitted != sorted_.end()) {
    cls = first_fitted->second;
  } else if (loose && do_classes_in_use() >= max_classes_in_use(num_pages_)) {
    auto used = std::find_if(fit, sorted_.end(), [&](const auto& e) { return classes_[e.second].pages > 0; });
    if (used != sorted_.end()) cls = used->second;
  } else if (loose) {
    // Too loose: cut a class for this size, in an unused entry or one with no page left. Not
    // when classes hold a quarter of the pages already: each class keeps a page partly cut.
    uint32_t free_entry = 0;
    for (uint32_t c = kPageClass + 1; c < num_classes_ && !free_entry; ++c)
      if (classes_[c].slot_size == 0) free_entry = c;
    for (uint32_t c = kPageClass + 1; c < num_classes_ && !free_entry; ++c)
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
      return do_class_for(need);
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
  if (c == kChunkClass || c >= num_classes_ || classes_[c].slot_size == 0) return false;
  const ClassMeta& cm = classes_[c];
  uint64_t in_page = off - p * page_size_;
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
  if (cm.free_head) slot(offset(static_cast<uint32_t>(cm.free_head)))->prev_free = code(off);
  cm.free_head = code(off);
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
  // The caller has already taken the page out of its class (no live slot, no listed free slot)
  // or off the heap.
  pages_[p].cls = kFreePage;
  pages_[p].live = 0;
  pages_[p].zombies = 0;
  pages_[p].next_free_page = static_cast<uint32_t>(*free_page_head_);
  *free_page_head_ = p + 1;
  ++*free_pages_;
}

uint64_t Slab::do_pop_free_page() {
  if (*free_page_head_ == 0) return num_pages_;
  uint64_t p = *free_page_head_ - 1;
  *free_page_head_ = pages_[p].next_free_page;
  pages_[p].next_free_page = 0;
  --*free_pages_;
  return p;
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

bool Slab::do_take_free_page(uint32_t c) {
  uint64_t p = do_pop_free_page();
  if (p == num_pages_) return false;
  do_cut_page(p, c);
  return true;
}

void Slab::begin_change(PageMeta& pm) {
  // Odd generation first: a reader that read the even one before will see it changed and retry.
  uint64_t g = pm.gen.load(std::memory_order_relaxed);
  pm.gen.store(g | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}

void Slab::end_change(PageMeta& pm) {
  uint64_t g = pm.gen.load(std::memory_order_relaxed);
  pm.gen.store((g | 1) + 1, std::memory_order_release);
}

void Slab::do_cut_page(uint64_t p, uint32_t c) {
  PageMeta& pm = pages_[p];
  begin_change(pm);
  ClassMeta& cm = classes_[c];
  pm.cls = c;
  pm.live = 0;
  pm.zombies = 0;
  ++cm.pages;
  uint64_t base = p * page_size_;
  for (uint32_t i = cm.slots_per_page; i-- > 0;) {
    uint64_t off = base + static_cast<uint64_t>(i) * cm.slot_size;
    if (c == kChunkClass) {
      chunk_owner_[off >> chunk_shift_] = kNoId;
    } else {
      SlotHeader* s = slot(off);
      s->seq.store(0, std::memory_order_relaxed);
      s->id = kNoId;
    }
    do_push_free_slot(c, off);
  }
  end_change(pm);
}

std::string Slab::check_free_lists() const {
  for (uint32_t c = 0; c < num_classes_; ++c) {
    const ClassMeta& cm = classes_[c];
    uint64_t count = 0, prev = 0;
    for (uint64_t u = cm.free_head; u; u = slot(offset(static_cast<uint32_t>(u)))->next_free) {
      uint64_t off = offset(static_cast<uint32_t>(u));
      uint64_t p = page_of(off);
      if (p >= num_pages_ || pages_[p].cls != c || (off - p * page_size_) % cm.slot_size ||
          (off - p * page_size_) / cm.slot_size >= cm.slots_per_page)
        return "free list of class " + std::to_string(c) + " names offset " + std::to_string(off) +
               ", not a slot of a page of that class";
      if (!is_free(c, off)) return "free slot at offset " + std::to_string(off) + " of class " + std::to_string(c) + " is in use";
      if (slot(off)->prev_free != prev) return "free list of class " + std::to_string(c) + " has a broken back link";
      prev = u;
      if (++count > cm.free_slots) break;
    }
    if (count != cm.free_slots)
      return "class " + std::to_string(c) + " counts " + std::to_string(cm.free_slots) + " free slots but its list holds " +
             std::to_string(count);
  }
  uint64_t listed = 0;
  for (uint64_t u = *free_page_head_; u && listed <= num_pages_; u = pages_[u - 1].next_free_page) {
    if (u > num_pages_ || pages_[u - 1].cls != kFreePage) return "free page list names a page in use";
    ++listed;
  }
  if (listed != *free_pages_) return "free page list holds " + std::to_string(listed) + " pages, the header counts " +
                                     std::to_string(*free_pages_);
  return "";
}

}  // namespace shadecache
