// A process-shared robust pthread mutex living in shared memory.
//
// When its owner dies holding it, the next locker gets EOWNERDEAD: it runs the repair callback
// (which must bring the guarded structure back to a consistent state and be idempotent, because
// the repairer itself may be killed), then marks the mutex consistent. A repair that throws
// leaves the mutex to the next locker, which repairs again.
#pragma once

#include <pthread.h>

#include <functional>

namespace shadecache {

// Initializes `m` in place (creator only, before the segment is published).
void robust_mutex_init(pthread_mutex_t* m);

// Locks `m`. Returns true when a dead owner's state was repaired with `repair` on the way in.
bool robust_mutex_lock(pthread_mutex_t* m, const std::function<void()>& repair);

// Like robust_mutex_lock but returns false at once, without blocking, if the mutex is busy.
// `repaired` is set as robust_mutex_lock's result would be.
bool robust_mutex_try_lock(pthread_mutex_t* m, const std::function<void()>& repair, bool* repaired);

void robust_mutex_unlock(pthread_mutex_t* m);

}  // namespace shadecache
