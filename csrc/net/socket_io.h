// Blocking-with-deadline I/O on a socket that may be non-blocking (Python sockets with a timeout
// are O_NONBLOCK underneath): every call loops over partial transfers, waits in poll() on
// EAGAIN, and gives up at `deadline_ns` (CLOCK_MONOTONIC, the clock of Python's time.monotonic).
//
// Contract: no Python, no allocation; callers release the GIL around these calls. Results are
// kOk or a negative code, never an exception: the peer layer maps them to its own errors.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

namespace shadecache::net {

enum IoResult : int { kOk = 0, kTimeout = -1, kEof = -2, kFailed = -3 };

int64_t now_ns();
// Sends every byte of iov[0..n) in order (sendmsg, MSG_NOSIGNAL; at most IOV_MAX buffers per
// call). The array is modified as it goes. On kFailed, errno holds the cause.
int send_all(int fd, iovec* iov, size_t n, int64_t deadline_ns);
// Fills every buffer of iov[0..n) in order (recvmsg). kEof when the peer closed first.
int recv_all(int fd, iovec* iov, size_t n, int64_t deadline_ns);
int recv_exact(int fd, void* buf, size_t len, int64_t deadline_ns);
// recv_all that sleeps until every byte still missing has arrived (or the deadline passes),
// not until the first segment does: before each wait it sets the socket's SO_RCVLOWAT to the
// bytes still missing, so the kernel wakes the caller once instead of once per segment; the mark
// is set back to 1 before it returns. (On loopback the sender's path delivers into this socket,
// and each wake-up while this end is reading contends for the socket's lock: a 768 KB reply in
// 3 KB values spent more CPU there than in its cipher.) The socket's other readers see a mark of
// 1 as before. Where the kernel refuses the option it waits as recv_all does.
int recv_all_whole(int fd, iovec* iov, size_t n, int64_t deadline_ns);
// Waits until fd is readable (or has an error or EOF to report) or the deadline passes.
int wait_readable(int fd, int64_t deadline_ns);
// One non-blocking send of up to len bytes: the count the kernel took (0 when its buffer is full),
// or kFailed (errno holds the cause). Never waits.
int64_t send_some(int fd, const void* buf, size_t len);

}  // namespace shadecache::net
