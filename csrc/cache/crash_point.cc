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

}  // namespace shadecache
