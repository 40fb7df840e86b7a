// Test-only fault injection: kill this process with SIGKILL at a chosen step of a write.
//
// The crash tests arm a point with a countdown (through the hidden binding _core._arm_crash_point);
// the write path calls crash_point(P) between the steps whose interleaving matters. Disarmed (the
// normal case) it costs one relaxed load of a global.
#pragma once

#include <atomic>

namespace shadecache {

enum class CrashPoint : int {
  kNone = 0,
  kPutAfterAlloc,     // slot taken from a free list, nothing written
  kPutMidWrite,       // slot seq odd, value half written
  kPutAfterWrite,     // slot stable, index not yet published
  kPutAfterPublish,   // index published, heap and counters not updated
  kEvictAfterUnpublish,  // index cleared, slot not yet freed
  kEvictAfterFree,    // slot freed, heap not yet updated
  kMovePageMid,       // a page is half way through moving to another class
  kScoresMid,         // half of a score batch applied
  kNextUseMid,        // half of a next-use batch applied (clairvoyant)
  kRunMidTake,        // a run of pages for a large value half taken off the free page list
  kRunMidRelease,     // a freed run half way back on the free page list
  kCount,
};

// Test-only: Cache::create sleeps this long after sizing the segment and before reserving it,
// as a create of many gigabytes does in posix_fallocate (attach must wait for it).
extern std::atomic<long> g_create_delay_ms;

extern std::atomic<int> g_crash_point;
extern std::atomic<long> g_crash_countdown;

// Called on the write path; SIGKILLs this process when point `p` is armed and its countdown ends.
void crash_point_hit(CrashPoint p);

inline void crash_point(CrashPoint p) {
  if (__builtin_expect(g_crash_point.load(std::memory_order_relaxed) == static_cast<int>(p), 0))
    crash_point_hit(p);
}

}  // namespace shadecache
