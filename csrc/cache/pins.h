// Pins: the bookkeeping behind zero-copy views. A view points straight into a slot; while it is
// held, writers must not free, rewrite or move that slot.
//
// The truth is a table in the segment, one record per process that holds views (PinOwner in
// layout.h): each record lists the slots its process has pinned. There are no pin counts: a
// count cannot survive a SIGKILL between "record" and "count", a list entry is one aligned store.
// A writer asks `pinned(slot)` by scanning the records in use, each up to its high-water mark.
//
// Contracts (the Dekker pairing that makes views safe without a reader lock):
// - Reader: store the entry (seq_cst), THEN re-validate the slot (index, seq, page gen; seq_cst
//   loads). If the slot changed, the view is not handed out (the entry is overwritten or cleared).
// - Writer (mutex held): make the slot unreachable first (unpublish its index entry or make its
//   seq odd), issue a seq_cst fence, THEN ask pinned(). Either the writer sees the entry, or the
//   reader sees the change: a reader can never hold a view of a slot that a writer reuses.
// - A record is claimed by its process with a CAS of pid 0 -> pid. A record whose process is
//   known to be gone (pid gone, or reused: another start time) is taken by a CAS of its pid to
//   kReaping, cleared, then either freed (pid 0: a writer's reap_dead, mutex held) or claimed (a
//   process finding the table full). Entries are written only by the owner process (any of its
//   threads, each entry claimed by CAS 0 -> slot). All processes must share one pid namespace.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "cache/layout.h"

namespace shadecache {

class PinTable {
 public:
  void bind(PinOwner* owners, std::atomic<uint64_t>* active_bits) {
    owners_ = owners;
    active_ = active_bits;
  }

  // ---- owner side (no lock) -----------------------------------------------------------------
  // Stores `code` (the slot as the index names it: offset >> unit_shift + 1) in a free entry of
  // this process's record, claiming a record first if the process has none. Returns a token for
  // set/release. Throws kCapacity when the process already holds kPinsPerOwner pins, or every
  // record is taken. `pid`: getpid() as the caller read it in the same call (0: claim reads it).
  uint32_t claim(uint32_t code, const std::string& cache_name, int64_t pid = 0);
  // claim() for codes[0..n) at once: tokens[k] for codes[k]. One pass over the record (claim
  // scans it from the start for every pin: a batch of n would cost n * n / 2 loads), the
  // high-water mark raised before each entry is set, as claim does. All or nothing: on
  // kCapacity the entries taken are released before it is thrown.
  void claim_many(const uint32_t* codes, size_t n, uint32_t* tokens, const std::string& cache_name, int64_t pid);
  // Re-points an entry this process holds (a retry of the same view after a race).
  void set(uint32_t token, uint32_t code) { entry(token).store(code, std::memory_order_seq_cst); }
  // Drops an entry. Only in the process that claimed it (a forked child must not call it).
  void release(uint32_t token) { entry(token).store(0, std::memory_order_release); }

  // ---- writer side (mutex held) --------------------------------------------------------------
  // True when any record in use lists `code`. Caller: make the slot unreachable, fence(seq_cst),
  // then ask. Records of dead processes count until reap_dead() drops them.
  bool pinned(uint32_t code) const;
  bool any() const { return active_[0].load(std::memory_order_seq_cst) | active_[1].load(std::memory_order_seq_cst); }
  // Every code listed by a record in use, sorted, duplicates kept (for batch decisions).
  void snapshot(std::vector<uint32_t>* out) const;
  // Clears the records of processes that are gone (pid gone, or reused: start time differs).
  // Returns how many records were freed.
  uint32_t reap_dead();
  // Pins held by live processes (no lock: for stats).
  uint64_t count_live() const;

 private:
  std::atomic<uint32_t>& entry(uint32_t token) {
    uint32_t t = token - 1;
    return owners_[t / kPinsPerOwner].slots[t % kPinsPerOwner];
  }
  int my_record(const std::string& cache_name, int64_t pid);
  // True only when the owner `pid` of record `o` is known to be gone (exited, even if not yet
  // waited for, or its pid reused): common/proc.h's process_gone, where doubt means alive.
  static bool dead(const PinOwner& o, int64_t pid);
  // Moves a dead owner's record from `pid` to kReaping and clears its entries; false when another
  // reaper or claimer got there first.
  static bool take_over(PinOwner& o, int64_t pid);
  static constexpr int64_t kReaping = -1;
  // Calls f(code) for each non-zero entry of every record in use (up to its high-water mark;
  // seq_cst loads: see the contract above) until f returns true; returns whether one did.
  template <class F>
  bool any_entry(F f) const {
    for (uint32_t w = 0; w < 2; ++w) {
      uint64_t bits = active_[w].load(std::memory_order_seq_cst);
      while (bits) {
        const PinOwner& o = owners_[w * 64 + static_cast<uint32_t>(__builtin_ctzll(bits))];
        bits &= bits - 1;
        uint32_t hwm = o.hwm.load(std::memory_order_seq_cst);
        for (uint32_t k = 0; k < hwm && k < kPinsPerOwner; ++k)
          if (uint32_t c = o.slots[k].load(std::memory_order_seq_cst); c && f(c)) return true;
      }
    }
    return false;
  }

  PinOwner* owners_ = nullptr;
  std::atomic<uint64_t>* active_ = nullptr;  // bit r of word r/64: record r is claimed
  // The record this process claimed, as pid * 256 + record + 1 (0 = none): a forked child sees
  // another pid and claims its own. Atomic because threads share it; two threads that both claim
  // first only leave the process two records.
  std::atomic<int64_t> mine_{0};
};

}  // namespace shadecache
