#include "cache/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "common/own_file.h"

namespace shadecache {
namespace {

constexpr const char* kPrefix = "shadecache.";
constexpr const char* kShmDir = "/dev/shm";

std::string shm_name(const std::string& name) { return std::string("/") + kPrefix + name; }

std::string human(size_t n) {
  char buf[32];
  snprintf(buf, sizeof buf, "%.1f MiB", n / 1048576.0);
  return buf;
}

std::string what(const std::string& name) { return "cache '" + name + "'"; }

std::string advice(const std::string& name) {
  return "Use another cache name, or remove this one with `shadecache rm " + name + "` if it is yours.";
}

// Closes the fd on every path out of create/attach.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

void Segment::validate_name(const std::string& name) {
  if (name.empty() || name.size() > 100)
    throw Error(ErrorKind::kInvalidArgument, "cache name must be 1..100 characters, got '" + name + "'");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    if (!ok)
      throw Error(ErrorKind::kInvalidArgument,
                  "cache name '" + name + "' may only hold letters, digits, '-', '_' and '.'");
  }
}

std::string Segment::path(const std::string& name) {
  return std::string(kShmDir) + "/" + kPrefix + name;
}

Segment Segment::create(const std::string& name, size_t size, const std::function<void(int fd)>& before_reserve) {
  validate_name(name);
  struct statvfs vfs;
  if (::statvfs(kShmDir, &vfs) == 0) {
    size_t avail = static_cast<size_t>(vfs.f_bavail) * vfs.f_frsize;
    if (size > avail)
      throw Error(ErrorKind::kCapacity, "cache '" + name + "' needs " + human(size) + " of shared memory but " +
                                            kShmDir + " has only " + human(avail) + " free");
  }
  Fd f;
  f.fd = ::shm_open(shm_name(name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (f.fd < 0) {
    int err = errno;
    uid_t uid;
    if (err == EEXIST && owned_by_another(path(name), &uid))
      throw Error(ErrorKind::kExists, "cache '" + name + "' already exists (" + path(name) + ") and belongs to " +
                                          user_name(uid) + ", not to this user: use another cache name",
                  err);
    if (err == EEXIST)
      throw Error(ErrorKind::kExists, "cache '" + name + "' already exists (" + path(name) +
                                          "); attach to it, or remove it with `shadecache rm " + name + "`",
                  err);
    throw_errno("shm_open(" + path(name) + ")", err);
  }
  // From here on a failure must remove the half-made segment.
  try {
    if (::ftruncate(f.fd, static_cast<off_t>(size)) != 0) throw_errno("ftruncate(" + path(name) + ")", errno);
    if (before_reserve) before_reserve(f.fd);
    int rc = ::posix_fallocate(f.fd, 0, static_cast<off_t>(size));
    if (rc == ENOSPC || rc == ENOMEM)
      throw Error(ErrorKind::kCapacity, "cache '" + name + "': " + kShmDir + " ran out of space reserving " +
                                            human(size) + " (posix_fallocate: " + std::strerror(rc) + ")",
                  rc);
    if (rc != 0 && rc != EOPNOTSUPP) throw_errno("posix_fallocate(" + path(name) + ")", rc);
    return map(f.fd, size, name);
  } catch (...) {
    ::shm_unlink(shm_name(name).c_str());
    throw;
  }
}

Segment Segment::attach(const std::string& name) {
  validate_name(name);
  Fd f;
  f.fd = ::shm_open(shm_name(name).c_str(), O_RDWR, 0);
  if (f.fd < 0) {
    int err = errno;
    if (err == ENOENT)
      throw Error(ErrorKind::kNotFound, "no cache named '" + name + "' on this node (" + path(name) +
                                            " does not exist); `shadecache ls` lists them",
                  err);
    throw_open_failed("shm_open", path(name), what(name), advice(name), err);
  }
  // Another user may have made the segment first under this predictable name (to feed us their
  // bytes, or to read ours): only this user's own, closed to everyone else, is ever mapped.
  check_own_file(f.fd, path(name), what(name), advice(name));
  struct stat st;
  // shm_open and ftruncate are two calls: a creator between them shows size 0 for a moment.
  for (int i = 0;; ++i) {
    if (::fstat(f.fd, &st) != 0) throw_errno("fstat(" + path(name) + ")", errno);
    if (st.st_size > 0 || i == 200) break;
    ::usleep(10000);
  }
  if (st.st_size <= 0)
    throw Error(ErrorKind::kLayout, "cache '" + name + "' is empty: its creator died while creating it; "
                                    "remove it with `shadecache rm " + name + "`");
  return map(f.fd, static_cast<size_t>(st.st_size), name);
}

Segment Segment::map(int fd, size_t size, const std::string& name) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_errno("mmap(" + path(name) + ")", errno);
  Segment s;
  s.base_ = static_cast<char*>(p);
  s.size_ = size;
  return s;
}

bool Segment::unlink(const std::string& name) {
  validate_name(name);
  // In the sticky /dev/shm nobody else can replace a segment of ours between the look and the
  // unlink; root could remove anyone's, and must not.
  uid_t uid;
  if (owned_by_another(path(name), &uid))
    throw Error(ErrorKind::kOs, what(name) + " (" + path(name) + ") belongs to " + user_name(uid) +
                                    ", not to this user: refused, only its owner removes it",
                EACCES);
  if (::shm_unlink(shm_name(name).c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  throw_errno("shm_unlink(" + path(name) + ")", errno);
}

std::vector<std::string> Segment::list() {
  std::vector<std::string> out;
  DIR* d = ::opendir(kShmDir);
  if (!d) return out;
  size_t plen = std::strlen(kPrefix);
  while (dirent* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, kPrefix, plen) == 0 && e->d_name[plen] != '\0') out.emplace_back(e->d_name + plen);
  }
  ::closedir(d);
  return out;
}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    unmap();
    base_ = o.base_;
    size_ = o.size_;
    o.base_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void Segment::unmap() {
  if (base_) ::munmap(base_, size_);
  base_ = nullptr;
  size_ = 0;
}

}  // namespace shadecache
