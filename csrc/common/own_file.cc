#include "common/own_file.h"

#include <pwd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <vector>

#include "common/error.h"

namespace shadecache {

std::string user_name(uid_t uid) {
  std::string s = "uid " + std::to_string(uid);
  struct passwd pw;
  struct passwd* found = nullptr;
  std::vector<char> buf(4096);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr)
    s += std::string(" (") + found->pw_name + ")";
  return s;
}

namespace {

// "a directory", "a FIFO", ... for messages about what is found where a file should be.
const char* kind_of(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "an unknown kind of file";
}

[[noreturn]] void throw_foreign(const std::string& path, const std::string& what, const struct stat& st,
                                const std::string& advice) {
  std::string kind = S_ISREG(st.st_mode) ? "" : std::string(", ") + kind_of(st.st_mode);
  throw Error(ErrorKind::kOs,
              what + " (" + path + kind + ") belongs to " + user_name(st.st_uid) + ", not to this user (" +
                  user_name(::geteuid()) + "): refused, never attached. " + advice,
              EACCES);
}

}  // namespace

struct stat check_own_file(int fd, const std::string& path, const std::string& what,
                           const std::string& advice) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno("fstat(" + path + ")", errno);
  // The owner first: whatever another user planted (a file, a directory, a FIFO) is refused as
  // theirs, so the message says whom to ask.
  if (st.st_uid != ::geteuid()) throw_foreign(path, what, st, advice);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kOs,
                what + " (" + path + ") is " + kind_of(st.st_mode) + " of this user (" + user_name(st.st_uid) +
                    "), not a regular file: refused; remove it",
                EACCES);
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(ErrorKind::kOs,
                what + " (" + path + ") is open to group or others (mode " + mode +
                    "): refused, another user may have read or written it. " + advice,
                EACCES);
  }
  return st;
}

void throw_open_failed(const std::string& call, const std::string& path, const std::string& what,
                       const std::string& advice, int err) {
  // Whatever the kernel said (EACCES, ELOOP, EINVAL for a directory from shm_open, ENXIO, ...),
  // an entry of another user is refused as theirs. A missing one stays "not found".
  struct stat st;
  if (err != ENOENT && ::lstat(path.c_str(), &st) == 0 && st.st_uid != ::geteuid())
    throw_foreign(path, what, st, advice);
  throw_errno(call + "(" + path + ")", err);
}

bool owned_by_another(const std::string& path, uid_t* uid) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return false;
  *uid = st.st_uid;
  return st.st_uid != ::geteuid();
}

}  // namespace shadecache
