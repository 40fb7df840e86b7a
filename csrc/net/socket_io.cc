#include "net/socket_io.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <climits>

namespace shadecache::net {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

namespace {

// Waits until fd is ready for `events` or the deadline passes.
int wait_ready(int fd, short events, int64_t deadline_ns) {
  for (;;) {
    int64_t left = deadline_ns - now_ns();
    if (left <= 0) return kTimeout;
    pollfd p{fd, events, 0};
    int ms = static_cast<int>(std::min<int64_t>((left + 999999) / 1000000, INT_MAX));
    int r = ::poll(&p, 1, ms);
    if (r > 0) return kOk;  // readable, writable, or an error the next call will report
    if (r < 0 && errno != EINTR) return kFailed;
  }
}

// Drops `k` transferred bytes from the front of iov[*first..n).
void advance(iovec* iov, size_t n, size_t* first, size_t k) {
  while (*first < n && k >= iov[*first].iov_len) {
    k -= iov[*first].iov_len;
    ++*first;
  }
  if (*first < n && k) {
    iov[*first].iov_base = static_cast<char*>(iov[*first].iov_base) + k;
    iov[*first].iov_len -= k;
  }
}

// Bytes still to transfer in iov[first..n).
size_t left_in(const iovec* iov, size_t n, size_t first) {
  size_t k = 0;
  for (size_t i = first; i < n; ++i) k += iov[i].iov_len;
  return k;
}

// Sets SO_RCVLOWAT (clamped to what the kernel takes); false where it refuses it.
bool set_lowat(int fd, size_t bytes) {
  int v = static_cast<int>(std::min<size_t>(bytes, INT_MAX / 2));
  return ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0;
}

// whole: before each wait for more bytes to receive, the low-water mark is set to the bytes still
// missing (recv_all_whole); it is set back to 1 on every way out.
template <class Op>
int transfer(int fd, iovec* iov, size_t n, int64_t deadline_ns, short events, bool is_recv, Op op,
             bool whole = false) {
  bool marked = false;
  struct Reset {
    int fd;
    bool* marked;
    ~Reset() {
      if (*marked) {
        int saved = errno;  // a kFailed result's cause stays the caller's to read
        set_lowat(fd, 1);
        errno = saved;
      }
    }
  } reset{fd, &marked};
  size_t first = 0;
  while (first < n && iov[first].iov_len == 0) ++first;
  while (first < n) {
    msghdr m{};
    m.msg_iov = iov + first;
    m.msg_iovlen = std::min<size_t>(n - first, IOV_MAX);
    ssize_t k = op(fd, &m);
    if (k > 0) {
      advance(iov, n, &first, static_cast<size_t>(k));
      while (first < n && iov[first].iov_len == 0) ++first;
      continue;
    }
    if (k == 0 && is_recv) return kEof;
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (whole) marked = set_lowat(fd, left_in(iov, n, first)) || marked;
      int r = wait_ready(fd, events, deadline_ns);
      if (r != kOk) return r;
      continue;
    }
    return kFailed;
  }
  return kOk;
}

}  // namespace

int send_all(int fd, iovec* iov, size_t n, int64_t deadline_ns) {
  return transfer(fd, iov, n, deadline_ns, POLLOUT, false,
                  [](int f, msghdr* m) { return ::sendmsg(f, m, MSG_NOSIGNAL | MSG_DONTWAIT); });
}

namespace {
int receive(int fd, iovec* iov, size_t n, int64_t deadline_ns, bool whole) {
  return transfer(fd, iov, n, deadline_ns, POLLIN, true,
                  [](int f, msghdr* m) { return ::recvmsg(f, m, MSG_DONTWAIT); }, whole);
}
}  // namespace

int recv_all(int fd, iovec* iov, size_t n, int64_t deadline_ns) { return receive(fd, iov, n, deadline_ns, false); }

int recv_all_whole(int fd, iovec* iov, size_t n, int64_t deadline_ns) { return receive(fd, iov, n, deadline_ns, true); }

int recv_exact(int fd, void* buf, size_t len, int64_t deadline_ns) {
  iovec v{buf, len};
  return recv_all(fd, &v, 1, deadline_ns);
}

int wait_readable(int fd, int64_t deadline_ns) { return wait_ready(fd, POLLIN, deadline_ns); }

int64_t send_some(int fd, const void* buf, size_t len) {
  for (;;) {
    ssize_t k = ::send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) return k;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return kFailed;
  }
}

}  // namespace shadecache::net
