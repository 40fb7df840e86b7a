// The node cache: one shared-memory segment holding values for dense sample ids 0..N-1, a score
// for every id, an eviction heap and a slab allocator. Many processes map it at once.
// capacity_bytes is its memory: the segment is capacity_bytes plus a fixed part (geometry.h).
//
// Contracts (docs/shared_memory.md has the full protocol):
// - Readers (read, contains, pin, snapshots) take no lock; stats() takes the mutex briefly for
//   the writer-state counters (items, bytes_used, zombies, free pages). A reader copies a value
//   out (its chunks, then its tail) under the head slot's seqlock and the page's generation and
//   retries if a writer raced it; a reader that dies holds nothing.
// - Writers (put, remove, update_scores, check) take the segment's one robust mutex. Methods named
//   do_* require it held. A writer killed anywhere leaves a state that the next locker repairs
//   (do_repair rebuilds every derived structure from the index, the head slots and their chunk
//   numbers).
// - Nothing here knows Python; the bindings release the GIL around every method that can block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/crash_point.h"
#include "cache/geometry.h"
#include "cache/heap.h"
#include "cache/layout.h"
#include "cache/pins.h"
#include "cache/policy.h"
#include "cache/segment.h"
#include "cache/slab.h"
#include "common/error.h"
#include "common/proc.h"

namespace shadecache {

// Bumped in the child after every fork (see cache.cc).
extern std::atomic<uint64_t> g_fork_generation;
// Wall-clock time, ns since the Unix epoch (creation and attach times in the header).
uint64_t unix_now_ns();

struct CacheStats {
  uint64_t hits, misses, read_retries, inserts, updates, evictions, rejected, page_moves, relocations,
      recoveries, score_updates, items, bytes_used, capacity_bytes, num_samples, page_size, chunk_size,
      num_pages, free_pages, heap_pages, segment_bytes, max_item_bytes, pinned, zombies, data_bytes;
  int64_t creator_pid;
  uint64_t creator_start_time;
  uint32_t policy;
};

// One value of a batch put: id, bytes, and the crc32c computed outside the lock.
struct PutItem {
  uint32_t id;
  const char* data;
  uint32_t len;
  uint32_t crc;
};

class Cache {
 public:
  static std::unique_ptr<Cache> create(const std::string& name, const CacheOptions& opts);
  // touch: record this attach as the cache's last use (`shadecache ls` and `gc` look without it).
  static std::unique_ptr<Cache> attach(const std::string& name, bool touch = true);
  // Size a segment for `opts` would take: capacity_bytes and the fixed part.
  static uint64_t segment_bytes(const CacheOptions& opts);
  // pid and start time of the process that created segment `name`, read without taking its lock.
  static bool read_creator(const std::string& name, int64_t* pid, uint64_t* start_time);

  ~Cache() = default;
  // Refuses every call from now on. The mapping goes when the last user of it ends: a call that
  // runs without the GIL in another thread (a put waiting for the mutex), or a view still held.
  // At once when there is none. So close() never unmaps under a running call or a view.
  void close();

  // Marks a call that may run while another thread calls close() (the bindings release the GIL
  // around it): close() leaves the mapping until the call ends. Throws kClosed when already closed.
  class Use {
   public:
    explicit Use(Cache& c) : c_(c) { c_.begin_use(); }
    ~Use() { c_.end_use(); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    Cache& c_;
  };
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  const std::string& name() const { return name_; }
  uint64_t num_samples() const { return n_; }
  Policy policy() const { return static_cast<Policy>(hdr_->policy); }
  uint64_t capacity_bytes() const { return hdr_->capacity_bytes; }
  uint64_t max_item_bytes() const { return hdr_->max_item_bytes; }
  uint64_t page_size() const { return page_size_; }
  bool persist() const { return hdr_->persist != 0; }
  std::string fingerprint() const { return std::string(hdr_->fingerprint, strnlen(hdr_->fingerprint, sizeof hdr_->fingerprint)); }
  uint64_t created_unix_ns() const { return hdr_->created_unix_ns; }
  uint64_t last_attach_unix_ns() const { return hdr_->last_attach_unix_ns.load(std::memory_order_relaxed); }

  // ---- readers: no lock -------------------------------------------------------------------
  // Copies the value of `id` into alloc(len) and returns len, or returns -1 on a miss. alloc may
  // be called again (with a new length) when a writer raced the copy. The caller has already
  // checked that the cache is open and `id` is in range (check_open, check_id): a batch is
  // checked once, up front, not once per value.
  template <class Alloc>
  int64_t read(uint64_t id, Alloc&& alloc);
  // read() without the shared hit/miss/retry counters: a batch read (csrc/bindings/
  // batch_gather.cc) adds its counts once per batch with count_reads, not one atomic add per value
  // (a locked add per value also orders the loads around it). *retries is incremented per retry.
  template <class Alloc>
  int64_t read_uncounted(uint64_t id, Alloc&& alloc, uint64_t* retries);
  void count_reads(uint64_t hits, uint64_t misses, uint64_t retries) {
    ReaderStats& st = stripe();
    if (hits) st.hits.fetch_add(hits, std::memory_order_relaxed);
    if (misses) st.misses.fetch_add(misses, std::memory_order_relaxed);
    if (retries) st.read_retries.fetch_add(retries, std::memory_order_relaxed);
  }
  bool contains(uint64_t id);
  // Batch reads call these a few ids ahead so that the index entry, then the slot header and the
  // first lines of the value, are on their way from DRAM while an earlier value is being copied
  // (a batch over a working set larger than the CPU caches is bound by these misses). A single
  // get calls prefetch_value with the length it expects, so that every line of a small value is
  // requested at once, as soon as the index entry arrives, instead of one miss for the header and
  // then the hardware streamer ramping up behind the copy (docs/shared_memory.md, "The read
  // protocol").
  // Hints only: no ordering, no effect on correctness; `id` must already be range-checked.
  static constexpr uint32_t kPrefetchMaxBytes = 4096;  // beyond this the hardware streamer keeps up
  void prefetch_index(uint64_t id) const { __builtin_prefetch(&index_[id]); }
  void prefetch_value(uint64_t id, uint32_t value_bytes = 512 - sizeof(SlotHeader)) const {
    uint32_t u = index_[id].load(std::memory_order_relaxed);
    uint64_t off = static_cast<uint64_t>(u - 1) << unit_shift_;
    if (u == 0 || off >= data_bytes_) return;
    const char* p = data_ + off;
    __builtin_prefetch(&pages_[off >> page_shift_]);
    uint64_t end = std::min<uint64_t>({uint64_t{value_bytes} + sizeof(SlotHeader), kPrefetchMaxBytes, data_bytes_ - off});
    for (uint64_t b = 0; b < end; b += kAlign) __builtin_prefetch(p + b);
  }
  // ---- zero-copy views: no lock (csrc/cache/pins.h has the protocol) -------------------------
  // pin() records the head slot of `id` in this process's pin record and returns where its value
  // lies: no writer frees, rewrites or moves that slot until unpin(token). A value in chunks is
  // not contiguous: its view is a private copy instead (the token then names the copy, seq is 0
  // and gen kCopyGen; unpin frees it). false on a miss. Throws kCapacity when this process
  // already holds kPinsPerOwner pins. `id` must be checked. `self`: this process's pid as the
  // caller read it (getpid) in the same native call, so that a batch reads it once; 0: pin reads it.
  struct Pinned {
    const char* data;
    uint32_t len;
    uint32_t token;
    uint64_t seq, gen;  // the slot's seq and its page's generation when it was pinned
    uint32_t crc = 0;   // the crc32c put() recorded for the value (the peer server sends it)
  };
  static constexpr uint64_t kCopyGen = ~uint64_t{0};
  bool pin(uint64_t id, Pinned* out, int64_t self = 0);
  // The length of the value of `id` as the cache holds it now (false on a miss): a lock-free
  // look that pins nothing, so it may be stale by the time it is used (a plan, not a view).
  // `id` must be checked.
  bool peek_length(uint64_t id, uint32_t* len) const;
  // pin() for ids[0..n) at once (each checked by the caller): found[k] says whether out[k] holds
  // a view of ids[k]. The entries of the values found are claimed in one pass over this
  // process's record (PinTable::claim_many) and the shared counters added once, then each slot
  // is validated as pin() validates it (a value a writer moved meanwhile is pinned again by
  // pin()). Returns how many were found. Throws kCapacity, holding nothing of the batch, when
  // the process cannot hold them all.
  size_t pin_many(const uint64_t* ids, size_t n, Pinned* out, bool* found, int64_t self = 0);
  // A forked child's copy of a view names its parent's pin, which the parent may end at any time.
  // The child pins the same slot in its own record, then checks that the slot still holds the
  // value the view showed (seq and page generation unchanged: no writer freed, rewrote or moved it
  // since; the Dekker pairing of pins.h makes the check final). On success `p->token` is the
  // child's; false (nothing pinned) when the value is gone. A copy (gen kCopyGen) is the child's
  // own memory after the fork: its token is found again, nothing is pinned.
  bool repin(uint64_t id, Pinned* p);
  // Ends a view. `pinned_by` is the pid that pinned it: a forked child ending an inherited view
  // drops nothing of its parent's. Unmaps a closed cache when its last view ends. `self` as for pin.
  void unpin(uint32_t token, int64_t pinned_by, int64_t self = 0);
  // unpin() of tokens[0..n), all pinned by `pinned_by`.
  void unpin_many(const uint32_t* tokens, size_t n, int64_t pinned_by, int64_t self = 0);
  // Test only: stores a pin entry naming the slot index[id] names now, without validating it, as a
  // reader that raced a writer leaves it while it backs out (or dies). 0 if id is not indexed.
  uint32_t stale_pin_for_tests(uint64_t id);
  void stale_unpin_for_tests(uint32_t token) { pins_.release(token); }

  void cached_mask(uint8_t* out);   // out[N]
  void scores_snapshot(float* out);  // out[N]
  CacheStats stats();

  // ---- writers: take the mutex --------------------------------------------------------------
  // Validates, then inserts each item (one lock for the batch). admitted[i] = 0 where admission
  // refused it. scores, when given, are set first (they drive admission under "importance").
  void put_many(std::vector<PutItem>& items, const float* scores, uint8_t* admitted);
  // One item. try_put returns -1 without blocking when the mutex is busy, so that the caller can
  // keep the GIL on the uncontended path and release it only to wait (then call put).
  int try_put(const PutItem& it, const float* score);
  bool put(const PutItem& it, const float* score);
  // Builds a PutItem (validating id and length, computing the crc); call without the lock.
  PutItem make_item(uint64_t id, const char* data, uint64_t len);
  // The largest value put accepts (Header::max_item_bytes).
  uint64_t max_value() const { return max_len_; }
  bool remove(uint64_t id);
  void update_scores(const int64_t* ids, const float* scores, size_t n);
  // The clairvoyant policy's input (csrc/cache/next_use.cc): positions[i] is the next position at
  // which the node reads ids[i], -1 when none is known. One lock per call; a no-op (after the
  // checks) under a policy that does not key on next use.
  void set_next_use(const int64_t* ids, const int64_t* positions, size_t n);
  // The clairvoyant blend weight (finite, >= 0): rekeys every cached value, one lock.
  void set_policy_weight(double w);
  double policy_weight();
  bool keys_on_next_use() const { return policy_->keys_on_next_use(); }
  // out[i]: whether a full cache would admit ids[i] once displaced[i] of its cached values have
  // given way to others, by the policy that decides puts (csrc/cache/admission.cc).
  void would_admit(const int64_t* ids, const int64_t* displaced, size_t n, uint8_t* out);
  // Walks every structure under the lock; throws Error(kCorruption) describing the first fault.
  void check();

  void check_open() const {
    if (closed_.load(std::memory_order_relaxed)) throw Error(ErrorKind::kClosed, "cache '" + name_ + "' is closed");
  }
  void check_id(uint64_t id) const {
    if (id >= n_)
      throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " is out of range for cache '" +
                                              name_ + "' with num_samples=" + std::to_string(n_));
  }

  void check_id_signed(int64_t id) const {
    if (id < 0)
      throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " is negative (cache '" + name_ + "')");
    check_id(static_cast<uint64_t>(id));
  }
  void check_score(int64_t id, float score) const {
    // NaN never compares, and ±inf (or a double beyond float range) makes eviction sums inf - inf.
    if (!std::isfinite(score))
      throw Error(ErrorKind::kInvalidArgument, "score for sample id " + std::to_string(id) + " is " +
                                                   (score != score ? "NaN" : "not finite (beyond float32 range)"));
  }

 private:
  friend class WriteLock;
  Cache() = default;
  void bind(Segment seg, const std::string& name);

  // All do_* run with the mutex held.
  bool do_put(const PutItem& it);
  // Memory for a new value of `k` chunks whose head goes to class `cls`, for `id` (whose cached
  // copy, if any, goes after the new one is written) under key `key`: what is free, else what
  // moving values frees (do_compact_one), else what evicting in the policy's order frees. Takes
  // the head slot (*head: its offset) and the chunks (*chunks), owned by `id`, all counted live
  // on their pages already, and makes room in the heap. false when the policy refuses (static full, or importance admission fails
  // because `key` does not beat the lowest cached priority) or views pin every candidate.
  bool do_alloc(uint32_t cls, uint64_t k, uint32_t id, double key, uint64_t* head, std::vector<uint32_t>* chunks);
  // Pages that allocation still needs from the free page list (head slot, chunks, heap room).
  uint64_t do_pages_short(uint32_t cls, uint64_t k, uint32_t id) const;
  // The victim walk: the next value to evict for a new one of `key`, in the policy's order. Keys
  // readers moved are applied first; pinned values are set aside in aside_ (dead processes' views
  // reaped once per walk, *reaped). false when the heap is empty or the policy will not evict the
  // top for `key`.
  bool do_next_victim(double key, bool* reaped, HeapNode* victim);
  // Unpublishes `id` and frees its head slot and chunks (their pages go back to the free page
  // list once empty), or, when a view pins it, leaves the head's bytes as they are on the zombie
  // list. Returns false in that case.
  bool do_evict(uint32_t id);
  void do_rekey(uint32_t id, double key) { heap_.update(id, key); }
  // Empties one page by moving its values into free slots of the same class on other pages, so
  // that the page can serve another class or the heap: the class with a page's worth of free
  // slots whose emptiest page costs least to move. false when no class has one to give.
  bool do_compact_one();
  // Moves every value of page `p` elsewhere in its class; true when the page went free (false:
  // a view pinned one of them, which became a zombie, and the page stays).
  bool do_empty_page(uint64_t p);
  bool do_move_head(uint64_t off);   // false: a view pinned it meanwhile (now a zombie)
  void do_move_chunk(uint64_t off);
  // The heap's pages: room for one more node (a page taken off the free list when the heap is
  // full), and pages given back once the heap, with `reserve` more nodes, has shrunk by more than
  // a quarter page beyond one (true when a page went back).
  uint64_t heap_capacity() const { return hdr_->heap_pages * heap_.per_page(); }
  void do_heap_grow();
  bool do_heap_trim(uint64_t reserve = 0) {
    // Asked at the end of every write and of every allocation short of pages: the answer is
    // nearly always no, and costs no call.
    const uint64_t npp = heap_.per_page(), pages = hdr_->heap_pages, nodes = heap_.size() + reserve;
    if (pages == 0 || (nodes != 0 && nodes + npp / 4 > (pages - 1) * npp)) return false;
    return do_heap_give_back(reserve);
  }
  bool do_heap_give_back(uint64_t reserve);
  // After making slot `off` unreachable (index entry unpublished, or seq odd): does a view pin it?
  bool do_slot_pinned(uint64_t off);
  void do_push_zombie(uint64_t off);
  void do_reclaim_zombies();  // frees every zombie no view pins any more
  void do_reap_dead_pins();   // drops pins of dead processes; at most every 100 ms per process
  uint32_t slot_code(uint64_t off) const { return slab_.code(off); }  // the index's form, as pins name slots
  void do_set_score(uint32_t id, float score);
  void do_repair();
  std::string do_check();
  // Writes value `it` into head slot `off` and its chunks (`chunks`: the chunk numbers, written
  // into the head; nullptr keeps the ones the head names, for a rewrite in place), all under the
  // head's odd seq. With check_pins (a rewrite in place of a published value) it first makes seq
  // odd and gives up, changing nothing, when a view pins the slot.
  bool write_value(uint64_t off, const PutItem& it, const uint32_t* chunks, bool check_pins = false);
  // A copy of value `id` into a private buffer registered under a copy token (pin of a value in
  // chunks). false on a miss.
  bool pin_copy(uint64_t id, Pinned* out);
  // pin() for a value of a pin_many batch that the batch could not take (a writer moved it):
  // false, not kCapacity, when no entry is left, so that the batch's other pins are not lost.
  bool pin_again(uint64_t id, Pinned* out, int64_t self);

  // A slot found by probe(): the index value naming it, its offset, page, page generation, header,
  // seq, length and crc32c, as read (the caller checks they still hold after using the slot).
  // The crc is read here, before that check, and never from the header after it: a slot that
  // becomes a zombie while pinned keeps its bytes and length, but its crc word is the zombie
  // list's link from then on (layout.h, SlotHeader), and making a zombie changes no seq.
  struct SlotAt {
    uint32_t v;  // the index entry
    uint64_t off;
    PageMeta* page;
    uint64_t gen;
    SlotHeader* slot;
    uint32_t seq;
    uint32_t len;
    uint32_t crc;
  };
  enum class Probe { kMiss, kRetry, kFound };
  Probe probe(uint64_t id, SlotAt* at) const;
  // After a pin entry was set for `at`: whether index[id], the slot's seq and its page's generation
  // are still what probe() read (seq_cst loads: see pins.h), so the pinned slot is this value.
  // The acquire fence orders probe()'s relaxed loads (len, crc) before these checks, as the
  // seqlock readers' fence does (no instruction on x86).
  bool still_at(uint64_t id, const SlotAt& at) const {
    std::atomic_thread_fence(std::memory_order_acquire);
    return index_[id].load(std::memory_order_seq_cst) == at.v && at.slot->seq.load(std::memory_order_seq_cst) == at.seq &&
           at.page->gen.load(std::memory_order_seq_cst) == at.gen;
  }
  // Copies the value described by `at` into dst (its chunks, then its tail); false when a chunk
  // number read is out of range (a writer raced: the caller retries).
  bool copy_value(const SlotAt& at, char* dst) const;

  void note_hit(uint64_t id) {
    if (stamp_hits_) {
      // Readers do not advance the clock (a read-modify-write of one shared word by every get in
      // every process would bounce its cache line between cores); writers advance it on every
      // insert. So a hit is stamped with the time of the latest insert: recency at the
      // granularity of inserts, which is what eviction (itself driven by inserts) can observe.
      // The stamp is only stored when it changes, so repeated hits do not dirty shared lines.
      uint64_t now = hdr_->clock.load(std::memory_order_relaxed);
      if (ticks_[id].load(std::memory_order_relaxed) != now) ticks_[id].store(now, std::memory_order_relaxed);
    }
  }

  // This process's reader-stats stripe. A forked child must not keep counting in its parent's
  // stripe: g_fork_generation (bumped by a pthread_atfork child handler) tells it to pick again.
  ReaderStats& stripe() {
    if (__builtin_expect(stripe_gen_ != g_fork_generation.load(std::memory_order_relaxed), 0)) pick_stripe();
    return *stripe_;
  }
  void pick_stripe();

  Segment seg_;
  std::string name_;
  ReaderStats* stripe_ = nullptr;
  uint64_t stripe_gen_ = ~uint64_t{0};
  Header* hdr_ = nullptr;
  uint64_t n_ = 0;
  // index_[id]: 0 = not cached, else head slot offset >> unit_shift + 1 (slots start on
  // 2^unit_shift bounds). 4 bytes per id rather than 8 halves the array that every lookup misses
  // on. idx_get/idx_set speak "slot offset + 1, 0 = none", the form the rest of the code uses.
  std::atomic<uint32_t>* index_ = nullptr;
  uint64_t idx_get(uint64_t id, std::memory_order mo) const {
    uint32_t u = index_[id].load(mo);
    return u ? (static_cast<uint64_t>(u - 1) << unit_shift_) + 1 : 0;
  }
  void idx_set(uint64_t id, uint64_t off_plus1, std::memory_order mo) {
    index_[id].store(off_plus1 ? static_cast<uint32_t>(((off_plus1 - 1) >> unit_shift_) + 1) : 0, mo);
  }
  uint32_t* heap_pos_ = nullptr;
  std::atomic<float>* scores_ = nullptr;
  std::atomic<uint64_t>* ticks_ = nullptr;
  PageMeta* pages_ = nullptr;
  char* data_ = nullptr;
  uint64_t data_bytes_ = 0;
  uint64_t page_size_ = 0;
  uint32_t page_shift_ = 0;  // log2(page_size_): the read path shifts where a division costs ~30 cycles
  uint32_t chunk_shift_ = 0;
  uint32_t unit_shift_ = kMinUnitShift;
  uint64_t num_chunks_ = 0;
  uint64_t max_len_ = 0;     // Header::max_item_bytes: a length read beyond it is a race, not a value
  uint32_t* heap_table_ = nullptr;
  Slab slab_;
  IndexedHeap heap_;
  PinTable pins_;
  const EvictionPolicy* policy_ = nullptr;
  PolicyState pstate_{};
  bool stamp_hits_ = false;  // policy_->stamps_hits(), read on the hot path
  // Heap nodes of pinned values that do_alloc took out of the heap for the time of one
  // allocation (mutex held; empty between calls).
  std::vector<HeapNode> aside_;
  // Views of values in chunks are private copies (pin_copy): token -> buffer, this process only.
  // A copy token has kCopyToken set, pin tokens never do (pins.h: at most 2^16).
  static constexpr uint32_t kCopyToken = 0x80000000u;
  std::mutex copies_mu_;
  std::unordered_map<uint32_t, std::unique_ptr<char[]>> copies_;
  uint32_t next_copy_ = 0;
  std::vector<uint32_t> chunk_buf_;  // the chunks do_alloc took for the put in progress (mutex held)
  // users_: calls in flight without the GIL (Use) plus views not yet unpinned. begin_use
  // increments it then loads closed_, close() stores closed_ then loads it (all seq_cst): one of
  // the two sees the other, so a call either fails with kClosed or runs on a mapping that stays.
  void begin_use();
  void end_use(uint64_t uses = 1);  // ends `uses` of them at once
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> users_{0};
  std::mutex unmap_mu_;  // close() vs. the last end_use(): exactly one of them unmaps
  uint64_t last_reap_ns_ = 0;            // mutex held
};

// Holds the cache mutex for a scope, repairing a dead owner's state on the way in.
class WriteLock {
 public:
  enum Mode { kWait, kTry };
  explicit WriteLock(Cache* c, Mode mode = kWait);
  ~WriteLock();
  WriteLock(const WriteLock&) = delete;
  WriteLock& operator=(const WriteLock&) = delete;
  bool owns() const { return owns_; }  // false only for kTry on a busy mutex

 private:
  Cache* c_;
  bool owns_ = false;
};

// ---- the lock-free read path (inline: it is the hot path) -------------------------------------

constexpr int kMaxReadAttempts = 64;

// One attempt at the first half of the read protocol (docs/shared_memory.md), shared by read and
// pin: the slot index[id] names, proven to be a stable slot header of `id` in the page layout of
// generation `gen`. kMiss: not cached (or a corrupt offset, which check() reports); kRetry: a
// writer is changing it; kFound: `at` describes it. The caller validates after using it.
inline Cache::Probe Cache::probe(uint64_t id, SlotAt* at) const {
  uint32_t v = index_[id].load(std::memory_order_acquire);
  uint64_t off = static_cast<uint64_t>(v - 1) << unit_shift_;
  if (v == 0 || off >= data_bytes_) return Probe::kMiss;
  PageMeta& page = pages_[off >> page_shift_];
  uint64_t gen = page.gen.load(std::memory_order_acquire);
  // Reading the index again after the generation proves `off` was published within this page
  // layout, so it is a slot header and not the middle of some other value.
  if ((gen & 1) || index_[id].load(std::memory_order_acquire) != v) return Probe::kRetry;
  SlotHeader* s = slab_.slot(off);
  uint32_t seq = s->seq.load(std::memory_order_acquire);
  if (seq & 1) return Probe::kRetry;
  uint32_t sid = __atomic_load_n(&s->id, __ATOMIC_RELAXED);
  uint32_t len = __atomic_load_n(&s->len, __ATOMIC_RELAXED);
  uint32_t crc = __atomic_load_n(&s->crc, __ATOMIC_RELAXED);
  if (sid != id) return Probe::kRetry;
  // Bounds only (relaxed reads a racing writer may have torn; the seq and gen rechecks after the
  // copy decide): the head lies inside its page, the length within what a put accepts.
  if (__builtin_expect(len > max_len_ || (off & (page_size_ - 1)) + head_bytes(len, chunk_shift_) > page_size_, 0))
    return Probe::kRetry;
  *at = SlotAt{v, off, &page, gen, s, seq, len, crc};
  return Probe::kFound;
}

inline bool Cache::copy_value(const SlotAt& at, char* dst) const {
  const char* head = slab_.value(at.off);
  const uint64_t k = at.len >> chunk_shift_;
  if (__builtin_expect(k == 0, 1)) {  // a value smaller than a chunk: one slot, one copy
    std::memcpy(dst, head, at.len);
    return true;
  }
  // Chunks in order, each a chunk_size copy; chunks side by side (a value written into fresh
  // pages) are copied as one run.
  const uint32_t* refs = reinterpret_cast<const uint32_t*>(head);
  const uint64_t chunk = uint64_t{1} << chunk_shift_;
  for (uint64_t i = 0; i < k;) {
    uint32_t first = __atomic_load_n(&refs[i], __ATOMIC_RELAXED);
    uint64_t run = 1;
    while (i + run < k && __atomic_load_n(&refs[i + run], __ATOMIC_RELAXED) == first + run) ++run;
    if (first + run > num_chunks_) return false;
    std::memcpy(dst + (i << chunk_shift_), data_ + (static_cast<uint64_t>(first) << chunk_shift_), run * chunk);
    i += run;
  }
  std::memcpy(dst + (k << chunk_shift_), head + 4 * k, at.len & (chunk - 1));
  return true;
}

template <class Alloc>
int64_t Cache::read(uint64_t id, Alloc&& alloc) {
  uint64_t retries = 0;
  int64_t len = read_uncounted(id, alloc, &retries);
  count_reads(len >= 0, len < 0, retries);
  return len;
}

template <class Alloc>
int64_t Cache::read_uncounted(uint64_t id, Alloc&& alloc, uint64_t* retries) {
  for (int attempt = 0; attempt < kMaxReadAttempts; ++attempt) {
    if (attempt) ++*retries;
    SlotAt at;
    Probe p = probe(id, &at);
    if (p == Probe::kMiss) break;
    if (p == Probe::kRetry) continue;
    char* dst = alloc(at.len);
    if (!copy_value(at, dst)) continue;
    // Acquire fence: the seq/gen loads below cannot move above the copy, so an unchanged seq and
    // gen prove no writer touched the value during it (the writer's release fence pairs with
    // this; a writer changes a chunk or a chunk number only under the head's odd seq).
    std::atomic_thread_fence(std::memory_order_acquire);
    if (at.slot->seq.load(std::memory_order_relaxed) != at.seq ||
        at.page->gen.load(std::memory_order_relaxed) != at.gen)
      continue;
    note_hit(id);
    return at.len;
  }
  return -1;
}

}  // namespace shadecache
