// The slab allocator: the data area is cut into pages of page_size bytes; each page belongs to one
// size class (or is free) and is cut into equal slots of that class. Pages move between classes
// when the size mix changes (the cache decides when; see Cache::do_alloc_slot).
//
// Size classes are fitted to the values, not fixed: the creator may preset classes fitted to the
// sample sizes it was given (geometry.h: fit_classes), and a value no class fits closely creates
// its own class (do_class_for), taking a free entry of the table or one whose pages are all gone.
// Entry 0 is always the whole-page class, so every value up to a page has somewhere to go.
//
// A value larger than a page (need_for(len) > page_size) gets a run of contiguous free pages of its
// own instead of a slot (do_take_run; layout.h, PageMeta): one slot header at the start of the
// head page, the value straight after it through the following pages, so a reader copies it
// with one memcpy under the same seqlock as any slot. Runs are never recut while a value is in
// them and go back to the free page list whole (do_release_if_empty).
//
// Every do_ method is called with the cache mutex held. Readers only ever look at slot headers and
// page generations (see docs/shared_memory.md for the seqlock protocol).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/layout.h"

namespace shadecache {

class Slab {
 public:
  Slab() = default;
  // free_page_head: the head of the free page list (page index + 1, 0 = none), kept in the Header.
  // class_gen: Header::class_gen, bumped on every change to the class table.
  Slab(char* data, PageMeta* pages, ClassMeta* classes, uint64_t* free_page_head, uint64_t* class_gen,
       uint64_t num_pages, uint64_t page_size, uint32_t num_classes)
      : data_(data), pages_(pages), classes_(classes), free_page_head_(free_page_head), class_gen_(class_gen),
        num_pages_(num_pages), page_size_(page_size), num_classes_(num_classes) {}

  // The slot a value of `value_len` bytes needs: its header and value, rounded up to kAlign.
  static uint64_t need_for(uint64_t value_len) { return align_up(value_len + sizeof(SlotHeader), kAlign); }
  // Whether a value of `value_len` bytes needs a run of pages, and how many pages.
  bool is_large(uint64_t value_len) const { return need_for(value_len) > page_size_; }
  uint64_t run_pages_for(uint64_t value_len) const { return (value_len + sizeof(SlotHeader) + page_size_ - 1) / page_size_; }
  bool is_run_head(uint64_t p) const { return pages_[p].cls == kRunHead; }
  // Pages in the run headed by page p (mutex held, or as a reader's bound: relaxed).
  uint64_t run_len(uint64_t p) const { return __atomic_load_n(&pages_[p].next_free_page, __ATOMIC_RELAXED); }
  // The widest slot that cuts as many slots from a page as `need` does (the rest of the page would
  // be lost anyway); >= need.
  static uint64_t widest_slot(uint64_t need, uint64_t page_size) {
    return page_size / (page_size / need) / kAlign * kAlign;
  }
  // Creator: entry 0 the whole-page class, then one class per slot size in `fitted` (ascending,
  // each <= page_size), the rest of the kMaxClasses entries unused. Returns kMaxClasses.
  static uint32_t init_classes(ClassMeta* classes, uint64_t page_size, const std::vector<uint32_t>& fitted);
  // Creator, and repair: every page free, every class empty, no free slot anywhere.
  void init();

  // The class a value of `value_len` (<= page_size - header) bytes goes to: the smallest class
  // whose slot holds it when that slot wastes little (at most what cutting a class for it would,
  // or 1/32), else a new class cut to fit it (an unused entry, or one that has no page left),
  // else the smallest class that holds it. Mutex held: may change the class table.
  uint32_t do_class_for(uint64_t value_len);
  // Classes that hold pages, and how many may: a quarter of the pages (at least 2).
  uint64_t do_classes_in_use() const;
  static uint64_t max_classes_in_use(uint64_t num_pages) { return std::max<uint64_t>(2, num_pages / 4); }

  SlotHeader* slot(uint64_t off) const { return reinterpret_cast<SlotHeader*>(data_ + off); }
  char* value(uint64_t off) const { return data_ + off + sizeof(SlotHeader); }
  uint64_t page_of(uint64_t off) const { return off / page_size_; }
  PageMeta& page(uint64_t p) const { return pages_[p]; }
  ClassMeta& cls(uint32_t c) const { return classes_[c]; }
  uint64_t num_pages() const { return num_pages_; }
  uint64_t page_size() const { return page_size_; }
  uint32_t num_classes() const { return num_classes_; }
  // True when `off` is the start of a slot in a page currently cut for some class.
  bool is_slot_start(uint64_t off) const;

  // Bytes in free slots of every class (not counting free pages). O(classes).
  uint64_t free_slot_bytes() const {
    uint64_t b = 0;
    for (uint32_t c = 0; c < num_classes_; ++c) b += classes_[c].free_slots * classes_[c].slot_size;
    return b;
  }

  // Free slots of a class (doubly linked through the slot headers).
  uint64_t do_pop_free_slot(uint32_t c);  // slot offset + 1, or 0 when the class has none
  void do_push_free_slot(uint32_t c, uint64_t off);
  void do_unlink_free_slot(uint32_t c, uint64_t off);

  // A free slot of class c (offset + 1): from the class's free list, else from a free page cut
  // for c; 0 when neither has one.
  uint64_t do_take_slot(uint32_t c);
  // Free pages. do_take_free_page cuts a free page for class c and frees its slots; false if none.
  bool do_take_free_page(uint32_t c);
  void do_push_free_page(uint64_t p);
  // A run of k contiguous free pages, taken off the free page list and marked (head kRunHead,
  // tails kRunTail) with its slot header free (id kNoId): the head page index + 1, 0 when no k
  // free pages lie side by side. O(pages).
  uint64_t do_take_run(uint64_t k);
  // A slot that stops being live or a zombie: onto its class's free list. A run's slot has no
  // free list: its pages go back whole in do_release_if_empty.
  void do_free_slot(uint64_t off) {
    uint32_t c = pages_[page_of(off)].cls;
    if (c != kRunHead) do_push_free_slot(c, off);
  }
  // Page p goes back to the free page list when it holds no live value and no zombie (all its
  // slots are on its class's free list: they are unlinked; a run head: every page of its run).
  // Returns whether it went.
  bool do_release_if_empty(uint64_t p);

  // The page and class counters of a slot that becomes live, stops being live, or becomes / stops
  // being a zombie. The only places those counters change outside a page cut or a repair.
  void do_count_live(uint64_t off, int delta) {
    PageMeta& pm = pages_[page_of(off)];
    pm.live += delta;
    if (pm.cls < num_classes_) classes_[pm.cls].items += delta;
  }
  void do_count_zombie(uint64_t off, int delta) { pages_[page_of(off)].zombies += delta; }
  // Recuts page p (which holds no live slot and none of whose slots is on a free list) for class c.
  // Bumps the page generation around the change so that readers holding a stale offset retry.
  void do_cut_page(uint64_t p, uint32_t c);

  // Walks the free lists and pages; returns "" or a description of the first fault found.
  std::string check_free_lists() const;

 private:
  static uint32_t unit(uint64_t off) { return static_cast<uint32_t>(off / kAlign + 1); }
  static uint64_t offset(uint32_t u) { return static_cast<uint64_t>(u - 1) * kAlign; }

  char* data_ = nullptr;
  PageMeta* pages_ = nullptr;
  ClassMeta* classes_ = nullptr;
  uint64_t* free_page_head_ = nullptr;
  uint64_t* class_gen_ = nullptr;
  // This process's copy of the class table, (slot_size, class) ascending by slot, for the class
  // table generation sorted_gen_ (mutex held to read or rebuild it), and the last answer.
  std::vector<std::pair<uint32_t, uint32_t>> sorted_;
  uint64_t sorted_gen_ = ~uint64_t{0};
  uint64_t last_need_ = 0;
  uint32_t last_cls_ = 0;
  uint64_t num_pages_ = 0;
  uint64_t page_size_ = 0;
  uint32_t num_classes_ = 0;
};

}  // namespace shadecache
