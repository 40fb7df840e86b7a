#include "cache/crash_point.h"

#include <signal.h>
#include <unistd.h>

namespace shadecache {

std::atomic<long> g_create_delay_ms{0};
std::atomic<int> g_crash_point{0};
std::atomic<long> g_crash_countdown{0};

void crash_point_hit(CrashPoint) {
  if (g_crash_countdown.fetch_sub(1, std::memory_order_relaxed) <= 1) ::kill(::getpid(), SIGKILL);
}

const std::vector<std::pair<const char*, CrashPoint>>& crash_point_names() {
  static const std::vector<std::pair<const char*, CrashPoint>> names = {
      {"put_after_alloc", CrashPoint::kPutAfterAlloc},
      {"put_mid_write", CrashPoint::kPutMidWrite},
      {"put_after_write", CrashPoint::kPutAfterWrite},
      {"put_after_publish", CrashPoint::kPutAfterPublish},
      {"evict_after_unpublish", CrashPoint::kEvictAfterUnpublish},
      {"evict_after_free", CrashPoint::kEvictAfterFree},
      {"compact_mid", CrashPoint::kCompactMid},
      {"scores_mid", CrashPoint::kScoresMid},
      {"next_use_mid", CrashPoint::kNextUseMid},
      {"relocate_after_copy", CrashPoint::kRelocateAfterCopy},
      {"relocate_after_publish", CrashPoint::kRelocateAfterPublish},
      {"chunk_move_after_copy", CrashPoint::kChunkMoveAfterCopy},
      {"chunk_move_mid_relink", CrashPoint::kChunkMoveMidRelink},
      {"heap_grow_mid", CrashPoint::kHeapGrowMid},
      {"heap_shrink_mid", CrashPoint::kHeapShrinkMid},
  };
  return names;
}

}  // namespace shadecache
