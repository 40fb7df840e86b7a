// The slab allocator: the data area is cut into pages of page_size bytes; each page is free,
// holds heap nodes, or belongs to one class and is cut into equal slots of that class. Class 0
// cuts a page into 16 chunks (raw value bytes, no header); every other class into head slots.
// A value is a head slot plus len / chunk_size chunks anywhere (layout.h), so memory is only
// ever needed a slot or a page at a time, never side by side.
//
// Head-slot classes are fitted to the values, not fixed: the creator may preset classes fitted to
// the sample sizes it was given (geometry.h: fit_classes), and a head no class fits closely
// creates its own class (do_class_for), taking a free entry of the table or one whose pages are
// all gone. Entry 1 is always the whole-page class, so every head has somewhere to go.
//
// Pages move between classes (and the heap) through the free page list: a page whose last slot
// is freed goes back at once (do_release_if_empty), and the cache empties pages on purpose by
// moving their values into free slots of the same class elsewhere (compaction.cc).
//
// Every do_ method is called with the cache mutex held. Readers only ever look at slot headers,
// chunks and page generations (see docs/shared_memory.md for the seqlock protocol).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/geometry.h"
#include "cache/layout.h"

namespace shadecache {

class Slab {
 public:
  Slab() = default;
  // free_page_head / free_pages / class_gen: the Header's fields of those names.
  Slab(char* data, PageMeta* pages, ClassMeta* classes, uint32_t* chunk_owner, uint64_t* free_page_head,
       uint64_t* free_pages, uint64_t* class_gen, uint64_t num_pages, uint64_t page_size, uint64_t chunk_size,
       uint32_t unit_shift, uint32_t num_classes)
      : data_(data), pages_(pages), classes_(classes), chunk_owner_(chunk_owner), free_page_head_(free_page_head),
        free_pages_(free_pages), class_gen_(class_gen), num_pages_(num_pages), page_size_(page_size),
        chunk_size_(chunk_size), chunk_shift_(static_cast<uint32_t>(__builtin_ctzll(chunk_size))),
        unit_shift_(unit_shift), num_classes_(num_classes) {}

  // ---- shapes -----------------------------------------------------------------------------
  uint64_t chunks_of(uint64_t len) const { return shadecache::chunks_of(len, chunk_shift_); }
  uint64_t tail_of(uint64_t len) const { return len & (chunk_size_ - 1); }
  // The head slot a value of `len` bytes needs (header, chunk numbers, tail), in slot units.
  uint64_t head_need(uint64_t len) const { return align_up(head_bytes(len, chunk_shift_), unit()); }
  uint64_t unit() const { return uint64_t{1} << unit_shift_; }

  // Creator: entry 0 the chunks, entry 1 the whole page, then one class per slot size in `fitted`
  // (ascending, each < page_size), the rest of the kMaxClasses entries unused. Returns kMaxClasses.
  static uint32_t init_classes(ClassMeta* classes, uint64_t page_size, const std::vector<uint32_t>& fitted);
  // Creator, and repair: every page free, every class empty, no free slot anywhere.
  void init();

  // The head class for a head slot of `need` bytes (head_need): the smallest class whose slot
  // holds it when that slot wastes little (at most what cutting a class for it would, or 1/32),
  // else a new class cut to fit it (an unused entry, or one that has no page left), else the
  // smallest class that holds it. Mutex held: may change the class table.
  uint32_t do_class_for(uint64_t need);
  // The head classes in use, (slot_size, class) ascending by slot (this process's copy of the
  // table, rebuilt when Header::class_gen moved). Mutex held.
  const std::vector<std::pair<uint32_t, uint32_t>>& do_head_classes();
  // Classes that hold pages, and how many may: a quarter of the pages (at least 3).
  uint64_t do_classes_in_use() const;
  static uint64_t max_classes_in_use(uint64_t num_pages) { return std::max<uint64_t>(3, num_pages / 4); }

  SlotHeader* slot(uint64_t off) const { return reinterpret_cast<SlotHeader*>(data_ + off); }
  char* value(uint64_t off) const { return data_ + off + sizeof(SlotHeader); }
  char* at(uint64_t off) const { return data_ + off; }
  uint32_t* refs(uint64_t off) const { return reinterpret_cast<uint32_t*>(data_ + off + sizeof(SlotHeader)); }
  uint64_t page_of(uint64_t off) const { return off / page_size_; }
  PageMeta& page(uint64_t p) const { return pages_[p]; }
  ClassMeta& cls(uint32_t c) const { return classes_[c]; }
  uint64_t num_pages() const { return num_pages_; }
  uint64_t page_size() const { return page_size_; }
  uint64_t chunk_size() const { return chunk_size_; }
  uint32_t chunk_shift() const { return chunk_shift_; }
  uint32_t num_classes() const { return num_classes_; }
  uint64_t num_chunks() const { return num_pages_ * kChunksPerPage; }
  // Chunk c's owner (an id) or kNoId when free.
  uint32_t& owner(uint64_t c) const { return chunk_owner_[c]; }
  // The offset of slot i of page p (of its class's slot size).
  uint64_t slot_off(uint64_t p, uint32_t i) const { return p * page_size_ + uint64_t{i} * classes_[pages_[p].cls].slot_size; }
  // True when `off` is the start of a head slot in a page currently cut for a head class.
  bool is_slot_start(uint64_t off) const;
  // Whether slot `off` of a page of class c is free (a head slot with no id; a chunk nobody owns).
  bool is_free(uint32_t c, uint64_t off) const {
    return c == kChunkClass ? chunk_owner_[off >> chunk_shift_] == kNoId : slot(off)->id == kNoId;
  }
  uint32_t code(uint64_t off) const { return static_cast<uint32_t>((off >> unit_shift_) + 1); }
  uint64_t offset(uint32_t code) const { return static_cast<uint64_t>(code - 1) << unit_shift_; }

  // Free slots of a class (doubly linked through the slots' bytes 8..15).
  uint64_t do_pop_free_slot(uint32_t c);  // slot offset + 1, or 0 when the class has none
  void do_push_free_slot(uint32_t c, uint64_t off);
  void do_unlink_free_slot(uint32_t c, uint64_t off);
  // A slot that stops being live or a zombie: onto its class's free list.
  void do_free_slot(uint64_t off) { do_push_free_slot(pages_[page_of(off)].cls, off); }

  // A free page cut for class c (its slots on c's free list); false when no page is free.
  bool do_take_free_page(uint32_t c);
  // A page off the free page list, not cut (for the heap): its index, or num_pages when none.
  uint64_t do_pop_free_page();
  void do_push_free_page(uint64_t p);
  // Page p goes back to the free page list when it holds no live slot and no zombie (all its
  // slots are on its class's free list: they are unlinked). Returns whether it went.
  bool do_release_if_empty(uint64_t p);

  // The page and class counters of a slot that becomes live, stops being live, or becomes / stops
  // being a zombie. The only places those counters change outside a page cut or a repair.
  void do_count_live(uint64_t off, int delta) {
    PageMeta& pm = pages_[page_of(off)];
    pm.live += delta;
    classes_[pm.cls].items += delta;
  }
  void do_count_zombie(uint64_t off, int delta) { pages_[page_of(off)].zombies += delta; }
  // Recuts page p (which holds no live slot and none of whose slots is on a free list) for class c.
  // Bumps the page generation around the change so that readers holding a stale offset retry.
  void do_cut_page(uint64_t p, uint32_t c);
  // Bumps page p's generation to odd (begin) or back to even (end) around a change of its role.
  static void begin_change(PageMeta& pm);
  static void end_change(PageMeta& pm);

  // Walks the free lists and the free page list; returns "" or a description of the first fault.
  std::string check_free_lists() const;

 private:
  char* data_ = nullptr;
  PageMeta* pages_ = nullptr;
  ClassMeta* classes_ = nullptr;
  uint32_t* chunk_owner_ = nullptr;
  uint64_t* free_page_head_ = nullptr;
  uint64_t* free_pages_ = nullptr;
  uint64_t* class_gen_ = nullptr;
  // This process's copy of the head classes, (slot_size, class) ascending by slot, for the class
  // table generation sorted_gen_ (mutex held to read or rebuild it), and the last answer.
  std::vector<std::pair<uint32_t, uint32_t>> sorted_;
  uint64_t sorted_gen_ = ~uint64_t{0};
  uint64_t last_need_ = 0;
  uint32_t last_cls_ = 0;
  uint64_t num_pages_ = 0;
  uint64_t page_size_ = 0;
  uint64_t chunk_size_ = 0;
  uint32_t chunk_shift_ = 0;
  uint32_t unit_shift_ = kMinUnitShift;
  uint32_t num_classes_ = 0;
};

}  // namespace shadecache
