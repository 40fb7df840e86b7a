#include "common/proc.h"

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace shadecache {

ProcessInfo process_info(int64_t pid) {
  ProcessInfo info;
  if (pid <= 0) return info;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "re");
  if (!f) return info;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ') return info;
  p += 2;
  info.exists = true;
  info.state = *p;
  for (int field = 3; field < 22 && p; ++field) {
    p = std::strchr(p, ' ');
    if (p) ++p;
  }
  if (p) info.start_time = std::strtoull(p, nullptr, 10);
  return info;
}

uint64_t process_start_time(int64_t pid) { return process_info(pid).start_time; }

bool process_gone(int64_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  ProcessInfo info = process_info(pid);
  if (!info.exists) return false;  // the pid exists but /proc said nothing: doubt
  if (info.state == 'Z' || info.state == 'X') return true;
  return start_time && info.start_time && info.start_time != start_time;
}

}  // namespace shadecache
