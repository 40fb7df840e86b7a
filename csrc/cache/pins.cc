#include "cache/pins.h"

#include <unistd.h>

#include <algorithm>

#include "common/error.h"
#include "common/proc.h"

namespace shadecache {

bool PinTable::dead(const PinOwner& o, int64_t pid) {
  // Free (0) or being taken over (kReaping): not a process. A record being claimed has no start
  // time yet (0 = unknown): then only a missing or exited pid counts (common/proc.h).
  return pid > 0 && process_gone(pid, o.start_time.load(std::memory_order_acquire));
}

bool PinTable::take_over(PinOwner& o, int64_t pid) {
  // pid -> kReaping: only one of the reapers and claimers that found the owner dead clears it.
  if (!o.pid.compare_exchange_strong(pid, kReaping, std::memory_order_seq_cst)) return false;
  for (uint32_t k = 0; k < kPinsPerOwner; ++k) o.slots[k].store(0, std::memory_order_relaxed);
  o.hwm.store(0, std::memory_order_relaxed);
  o.start_time.store(0, std::memory_order_release);
  return true;
}

int PinTable::my_record(const std::string& cache_name, int64_t pid) {
  int64_t m = mine_.load(std::memory_order_relaxed);
  // The pid check on the record itself: a record is only ever taken from its owner when the owner
  // looked dead, and then this process must not keep writing into it.
  if (m && m / 256 == pid && owners_[m % 256 - 1].pid.load(std::memory_order_acquire) == pid)
    return static_cast<int>(m % 256) - 1;
  const uint64_t st = process_start_time(pid);
  // Another Cache object of this process attached to the same segment may have claimed one.
  for (uint32_t r = 0; r < kPinOwners; ++r) {
    if (owners_[r].pid.load(std::memory_order_acquire) == pid &&
        owners_[r].start_time.load(std::memory_order_acquire) == st) {
      mine_.store(pid * 256 + r + 1, std::memory_order_relaxed);
      return static_cast<int>(r);
    }
  }
  // A free record; failing that, one whose process is gone (processes that exit leave their
  // record claimed: nothing else frees it until the table is full).
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t r = 0; r < kPinOwners; ++r) {
      PinOwner& o = owners_[r];
      int64_t expected = pass ? o.pid.load(std::memory_order_acquire) : 0;
      if (pass && !(dead(o, expected) && take_over(o, expected))) continue;
      if (pass) expected = kReaping;
      if (!o.pid.compare_exchange_strong(expected, pid, std::memory_order_seq_cst)) continue;
      o.start_time.store(st, std::memory_order_release);
      // Visible to writers before any entry of the record is (both seq_cst).
      active_[r / 64].fetch_or(uint64_t{1} << (r % 64), std::memory_order_seq_cst);
      mine_.store(pid * 256 + r + 1, std::memory_order_relaxed);
      return static_cast<int>(r);
    }
  }
  throw Error(ErrorKind::kCapacity, "cache '" + cache_name + "': " + std::to_string(kPinOwners) +
                                        " processes already hold views; release views in other processes");
}

uint32_t PinTable::claim(uint32_t code, const std::string& cache_name, int64_t pid) {
  const int r = my_record(cache_name, pid ? pid : ::getpid());
  PinOwner& o = owners_[r];
  for (uint32_t k = 0; k < kPinsPerOwner; ++k) {
    if (o.slots[k].load(std::memory_order_relaxed) != 0) continue;
    // Raise the high-water mark before the entry can be non-zero: a writer that scans up to an
    // older mark would miss it (both seq_cst, so a writer either sees the mark or the reader sees
    // the writer's change; see the header).
    uint32_t hwm = o.hwm.load(std::memory_order_seq_cst);
    while (hwm < k + 1 && !o.hwm.compare_exchange_weak(hwm, k + 1, std::memory_order_seq_cst)) {
    }
    uint32_t expected = 0;
    if (o.slots[k].compare_exchange_strong(expected, code, std::memory_order_seq_cst))
      return static_cast<uint32_t>(r) * kPinsPerOwner + k + 1;
  }
  throw Error(ErrorKind::kCapacity, "this process already holds " + std::to_string(kPinsPerOwner) +
                                        " views of cache '" + cache_name +
                                        "' (the most one process may hold); release some first");
}

void PinTable::claim_many(const uint32_t* codes, size_t n, uint32_t* tokens, const std::string& cache_name,
                          int64_t pid) {
  if (!n) return;
  const int r = my_record(cache_name, pid ? pid : ::getpid());
  PinOwner& o = owners_[r];
  uint32_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    for (;; ++k) {
      if (k == kPinsPerOwner) {
        for (size_t j = 0; j < i; ++j) release(tokens[j]);
        throw Error(ErrorKind::kCapacity, "this process already holds " + std::to_string(kPinsPerOwner) +
                                              " views of cache '" + cache_name +
                                              "' (the most one process may hold); release some first");
      }
      if (o.slots[k].load(std::memory_order_relaxed) != 0) continue;
      // As in claim: the mark first, then the entry (both seq_cst).
      uint32_t hwm = o.hwm.load(std::memory_order_seq_cst);
      while (hwm < k + 1 && !o.hwm.compare_exchange_weak(hwm, k + 1, std::memory_order_seq_cst)) {
      }
      uint32_t expected = 0;  // another thread of this process may have taken it meanwhile
      if (o.slots[k].compare_exchange_strong(expected, codes[i], std::memory_order_seq_cst)) {
        tokens[i] = static_cast<uint32_t>(r) * kPinsPerOwner + k + 1;
        ++k;
        break;
      }
    }
  }
}

bool PinTable::pinned(uint32_t code) const {
  return any_entry([code](uint32_t c) { return c == code; });
}

void PinTable::snapshot(std::vector<uint32_t>* out) const {
  out->clear();
  any_entry([out](uint32_t c) {
    out->push_back(c);
    return false;
  });
  std::sort(out->begin(), out->end());
}

uint32_t PinTable::reap_dead() {
  uint32_t reaped = 0;
  for (uint32_t r = 0; r < kPinOwners; ++r) {
    PinOwner& o = owners_[r];
    int64_t pid = o.pid.load(std::memory_order_acquire);
    // The owner is gone, and this reaper won the record (a claimer may take it over instead).
    if (!dead(o, pid) || !take_over(o, pid)) continue;
    active_[r / 64].fetch_and(~(uint64_t{1} << (r % 64)), std::memory_order_seq_cst);
    o.pid.store(0, std::memory_order_release);  // last: free for a new claim
    ++reaped;
  }
  return reaped;
}

uint64_t PinTable::count_live() const {
  uint64_t n = 0;
  for (uint32_t r = 0; r < kPinOwners; ++r) {
    const PinOwner& o = owners_[r];
    int64_t pid = o.pid.load(std::memory_order_acquire);
    if (pid <= 0 || dead(o, pid)) continue;
    uint32_t hwm = std::min(o.hwm.load(std::memory_order_acquire), kPinsPerOwner);
    for (uint32_t k = 0; k < hwm; ++k) n += o.slots[k].load(std::memory_order_relaxed) != 0;
  }
  return n;
}

}  // namespace shadecache
