// What /proc says about a process: whether it still runs, and when it started. Used to tell a
// live owner (of a segment, of a pin record) from one that is gone or whose pid was reused.
// All processes that share a cache must share one pid namespace.
#pragma once

#include <cstdint>

namespace shadecache {

struct ProcessInfo {
  bool exists = false;      // /proc/<pid>/stat could be read
  char state = 0;           // field 3: 'R', 'S', 'D', 'Z' (exited, not yet waited for), 'X', ...
  uint64_t start_time = 0;  // field 22: clock ticks since boot; with the pid it names one process
};

// Reads /proc/<pid>/stat. exists == false when there is no such process (or /proc is unreadable:
// callers that must not mistake doubt for death check kill(pid, 0) as well, see process_gone).
ProcessInfo process_info(int64_t pid);

// Start time of process `pid`, 0 if there is no such process.
uint64_t process_start_time(int64_t pid);

// True only when process `pid` is known to be gone: no such pid, an exited process that its
// parent has not waited for yet (state Z or X: it maps nothing any more), or another process that
// reused the pid (both start times known and different; start_time 0 = unknown). When in doubt
// (/proc unreadable: fd limit, hidepid) it answers false: the callers would rather keep a dead
// owner's resources a while than take a live owner's.
bool process_gone(int64_t pid, uint64_t start_time);

}  // namespace shadecache
