// Test-only fault injection: kill this process with SIGKILL at a chosen step of a write.
//
// The crash tests arm a point with a countdown (through the hidden binding _core._arm_crash_point);
// the write path calls crash_point(P) between the steps whose interleaving matters. Disarmed (the
// normal case) it costs one relaxed load of a global. docs/shared_memory.md ("Crash repair") says
// what repair finishes or undoes at each point.
#pragma once

#include <atomic>
#include <utility>
#include <vector>

namespace shadecache {

enum class CrashPoint : int {
  kNone = 0,
  kPutAfterAlloc,         // head slot and chunks taken from free lists, nothing written
  kPutMidWrite,           // head seq odd, value (chunks, tail) half written
  kPutAfterWrite,         // head stable, index not yet published
  kPutAfterPublish,       // index published, heap and counters not updated
  kEvictAfterUnpublish,   // index cleared, head and chunks not yet freed
  kEvictAfterFree,        // head and chunks freed, heap not yet updated
  kCompactMid,            // a page half way through being emptied by moving its values
  kScoresMid,             // half of a score batch applied
  kNextUseMid,            // half of a next-use batch applied (clairvoyant)
  kRelocateAfterCopy,     // a head copied to a new slot, the index still names the old one
  kRelocateAfterPublish,  // the index names the new slot, the old one not yet freed
  kChunkMoveAfterCopy,    // a chunk copied to a free chunk that its value does not name yet
  kChunkMoveMidRelink,    // the value's head seq odd, its chunk number rewritten
  kHeapGrowMid,           // a free page marked as heap nodes, the heap page count not raised
  kHeapShrinkMid,         // the heap page count lowered, its page not yet on the free list
  kCount,
};

// Every point by the name the tests use (_core.CRASH_POINTS).
const std::vector<std::pair<const char*, CrashPoint>>& crash_point_names();

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
