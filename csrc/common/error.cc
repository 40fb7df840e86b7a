#include "common/error.h"

#include <cerrno>
#include <cstring>

namespace shadecache {

void throw_errno(const std::string& what, int err) {
  ErrorKind kind = ErrorKind::kOs;
  if (err == ENOENT) kind = ErrorKind::kNotFound;
  if (err == EEXIST) kind = ErrorKind::kExists;
  if (err == ENOSPC || err == ENOMEM) kind = ErrorKind::kCapacity;
  throw Error(kind, what + ": " + std::strerror(err), err);
}

}  // namespace shadecache
