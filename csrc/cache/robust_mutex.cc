#include "cache/robust_mutex.h"

#include <cerrno>

#include "common/error.h"

namespace shadecache {
namespace {

// Finishes an acquisition that returned `rc`; true if a repair ran.
bool finish(pthread_mutex_t* m, int rc, const std::function<void()>& repair) {
  if (rc == 0) return false;
  if (rc == EOWNERDEAD) {
    try {
      repair();
    } catch (...) {
      // A repair that cannot finish must not hand the structure out: unlocking without
      // pthread_mutex_consistent makes the mutex ENOTRECOVERABLE for every later locker, which
      // then reports the cache as corrupt. (A repairer that is killed instead leaves EOWNERDEAD
      // again, and the next locker repairs from scratch.)
      pthread_mutex_unlock(m);
      throw;
    }
    pthread_mutex_consistent(m);
    return true;
  }
  if (rc == ENOTRECOVERABLE)
    throw Error(ErrorKind::kCorruption, "cache mutex is not recoverable (a previous repair was abandoned); "
                                        "remove the cache and create it again");
  throw_errno("pthread_mutex_lock", rc);
}

}  // namespace

void robust_mutex_init(pthread_mutex_t* m) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  int rc = pthread_mutex_init(m, &a);
  pthread_mutexattr_destroy(&a);
  if (rc != 0) throw_errno("pthread_mutex_init", rc);
}

bool robust_mutex_lock(pthread_mutex_t* m, const std::function<void()>& repair) {
  return finish(m, pthread_mutex_lock(m), repair);
}

bool robust_mutex_try_lock(pthread_mutex_t* m, const std::function<void()>& repair, bool* repaired) {
  int rc = pthread_mutex_trylock(m);
  if (rc == EBUSY) return false;
  *repaired = finish(m, rc, repair);
  return true;
}

void robust_mutex_unlock(pthread_mutex_t* m) { pthread_mutex_unlock(m); }

}  // namespace shadecache
