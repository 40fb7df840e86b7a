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

[[noreturn]] void throw_foreign(const std::string& path, const std::string& what, uid_t uid,
                                const std::string& advice) {
  throw Error(ErrorKind::kOs,
              what + " (" + path + ") belongs to " + user_name(uid) + ", not to this user (" +
                  user_name(::geteuid()) + "): refused, never attached. " + advice,
              EACCES);
}

}  // namespace

struct stat check_own_file(int fd, const std::string& path, const std::string& what,
                           const std::string& advice) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno("fstat(" + path + ")", errno);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kOs, what + " (" + path + ") is not a regular file: refused", EACCES);
  if (st.st_uid != ::geteuid()) throw_foreign(path, what, st.st_uid, advice);
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
  uid_t uid;
  if ((err == EACCES || err == EPERM || err == ELOOP) && owned_by_another(path, &uid))
    throw_foreign(path, what, uid, advice);
  throw_errno(call + "(" + path + ")", err);
}

bool owned_by_another(const std::string& path, uid_t* uid) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return false;
  *uid = st.st_uid;
  return st.st_uid != ::geteuid();
}

}  // namespace shadecache
