#include "io/packed_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common/crc32c.h"
#include "common/error.h"

namespace shadecache {
namespace {

// Synchronous read used only at open; false at end of file.
bool pread_exact(int fd, void* buf, size_t n, uint64_t off, const std::string& path) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("read " + path, errno);
    }
    if (r == 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return true;
}

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof(b), "0x%08x", v);
  return b;
}

}  // namespace

PackedReader::PackedReader(const std::string& path, BackendKind kind, bool direct,
                           unsigned queue_depth, bool verify)
    : path_(path), direct_(direct), verify_(verify), slot_(kind, queue_depth) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("PackedStore: open " + path, errno);
  try {
    load(fd);
    if (direct_) {
      direct_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (direct_fd_ < 0) {
        int err = errno;
        if (err == EINVAL)
          throw Error(ErrorKind::kInvalidArgument,
                      "PackedStore: the file system of " + path +
                          " does not support O_DIRECT (open with direct=False)",
                      err);
        throw_errno("PackedStore: open(O_DIRECT) " + path, err);
      }
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  fd_ = fd;
}

PackedReader::~PackedReader() { close(); }

void PackedReader::close() {
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
  fd_ = direct_fd_ = -1;
}

void PackedReader::check_open() const {
  if (fd_ < 0) throw Error(ErrorKind::kClosed, "PackedStore " + path_ + " is closed");
}

void PackedReader::format_error(const std::string& why) const {
  throw Error(ErrorKind::kFormat, path_ + ": " + why);
}

void PackedReader::load(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_errno("PackedStore: fstat " + path_, errno);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  store::Header& h = header_;
  if (size < sizeof(h) || !pread_exact(fd, &h, sizeof(h), 0, path_))
    format_error("not a shadecache store: " + std::to_string(size) +
                 " bytes, shorter than the header");
  if (std::memcmp(h.magic, store::kMagic, sizeof(h.magic)) != 0)
    format_error("not a shadecache store (bad magic; an interrupted pack leaves a zero header)");
  if (h.version != store::kVersion)
    format_error("format version " + std::to_string(h.version) + ", but this shadecache reads " +
                 "version " + std::to_string(store::kVersion) + " (repack the data set)");
  uint32_t hcrc = crc32c(&h, offsetof(store::Header, header_crc));
  if (hcrc != h.header_crc)
    format_error("header damaged: checksum " + hex32(hcrc) + " != stored " + hex32(h.header_crc));
  if (h.header_bytes != store::kHeaderBytes || h.align != store::kAlign ||
      h.entry_bytes != sizeof(store::Entry))
    format_error("header has unsupported geometry (header_bytes " +
                 std::to_string(h.header_bytes) + ", align " + std::to_string(h.align) +
                 ", entry_bytes " + std::to_string(h.entry_bytes) + ")");
  // Overflow-checked: a hostile header (its checksum is easy to recompute) must not make these
  // sums wrap, and nothing is allocated before the sizes are known to fit the real file.
  uint64_t dir_bytes = 0, meta_offset = 0, file_bytes = 0;
  if (h.dir_offset % store::kAlign != 0 || h.dir_offset < store::kHeaderBytes ||
      __builtin_mul_overflow(h.num_samples, sizeof(store::Entry), &dir_bytes) || h.dir_bytes != dir_bytes ||
      __builtin_add_overflow(h.dir_offset, h.dir_bytes, &meta_offset) || h.meta_offset != meta_offset ||
      __builtin_add_overflow(h.meta_offset, h.meta_bytes, &file_bytes) || h.file_bytes != file_bytes)
    format_error("header fields are inconsistent (directory at " + std::to_string(h.dir_offset) +
                 ", " + std::to_string(h.dir_bytes) + " bytes for " +
                 std::to_string(h.num_samples) + " samples)");
  if (size < h.file_bytes)
    format_error("truncated: the file has " + std::to_string(size) + " bytes, the header says " +
                 std::to_string(h.file_bytes) + " (the sample directory at offset " +
                 std::to_string(h.dir_offset) + " is " +
                 (size <= h.dir_offset ? "missing)" : "cut short)"));
  dir_.resize(h.num_samples);
  if (!pread_exact(fd, dir_.data(), h.dir_bytes, h.dir_offset, path_))
    format_error("truncated while reading the sample directory");
  uint32_t dcrc = crc32c(dir_.data(), h.dir_bytes);
  if (dcrc != h.dir_crc)
    format_error("sample directory damaged: checksum " + hex32(dcrc) + " != stored " +
                 hex32(h.dir_crc));
  // Even with a matching checksum, never trust offsets that would read outside the data region
  // (written so that nothing can wrap: offset and length are each at most dir_offset).
  uint64_t min_off = store::kHeaderBytes;
  for (size_t i = 0; i < dir_.size(); ++i) {
    const store::Entry& e = dir_[i];
    if (e.offset % store::kAlign != 0 || e.offset < min_off || e.offset > h.dir_offset ||
        e.length > h.dir_offset - e.offset || store::align_up(e.offset + e.length) > h.dir_offset)
      format_error("sample directory entry " + std::to_string(i) + " is invalid (offset " +
                   std::to_string(e.offset) + ", length " + std::to_string(e.length) + ")");
    min_off = e.offset + store::align_up(e.length);
  }
  meta_.resize(h.meta_bytes);
  if (!pread_exact(fd, meta_.data(), h.meta_bytes, h.meta_offset, path_))
    format_error("truncated while reading the metadata");
  uint32_t mcrc = crc32c(meta_.data(), meta_.size());
  if (mcrc != h.meta_crc)
    format_error("metadata damaged: checksum " + hex32(mcrc) + " != stored " + hex32(h.meta_crc));
}

const store::Entry& PackedReader::entry(int64_t id) const {
  if (id < 0 || static_cast<uint64_t>(id) >= dir_.size())
    throw Error(ErrorKind::kOutOfRange, "sample id " + std::to_string(id) + " out of range [0, " +
                                            std::to_string(dir_.size()) + ") of " + path_);
  return dir_[static_cast<size_t>(id)];
}

void PackedReader::read_into(const int64_t* ids, size_t n, char* const* dests) {
  check_open();
  std::vector<RangeRead> ops;
  std::vector<size_t> pos;  // ops[j] is batch position pos[j]
  ops.reserve(n);
  pos.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const store::Entry& e = dir_[static_cast<size_t>(ids[k])];
    if (e.length == 0) continue;  // nothing to read; crc32c of no bytes is 0 by construction
    ops.push_back(RangeRead{e.offset, e.length, dests[k]});
    pos.push_back(k);
  }
  std::mutex mu;
  size_t bad = SIZE_MAX;  // lowest failing batch position
  uint32_t bad_crc = 0;
  RangeDone done = [&](size_t j) {
    if (!verify_) return;
    const RangeRead& op = ops[j];
    uint32_t c = crc32c(op.dest, op.len);
    if (c != dir_[static_cast<size_t>(ids[pos[j]])].crc) {
      std::lock_guard<std::mutex> lk(mu);
      if (pos[j] < bad) {
        bad = pos[j];
        bad_crc = c;
      }
    }
  };
  int fd = direct_ ? direct_fd_ : fd_;
  slot_.with([&](IoBackend& b) { b.read_ranges(fd, direct_, ops.data(), ops.size(), done); });
  if (bad != SIZE_MAX) {
    int64_t id = ids[bad];
    const store::Entry& e = dir_[static_cast<size_t>(id)];
    throw CorruptSample(path_ + ": sample " + std::to_string(id) + " at file offset " +
                            std::to_string(e.offset) + " (" + std::to_string(e.length) +
                            " bytes) is corrupt: checksum " + hex32(bad_crc) + " != stored " +
                            hex32(e.crc),
                        static_cast<unsigned long long>(id), e.offset);
  }
}

std::vector<int64_t> PackedReader::find_corrupt(int64_t first, int64_t count) {
  check_open();
  if (count <= 0) return {};
  entry(first);
  entry(first + count - 1);
  std::vector<int64_t> ids(static_cast<size_t>(count));
  size_t total = 0;
  for (int64_t k = 0; k < count; ++k) {
    ids[static_cast<size_t>(k)] = first + k;
    total += dir_[static_cast<size_t>(first + k)].length;
  }
  std::unique_ptr<char[]> buf(new char[std::max<size_t>(total, 1)]);
  std::vector<char*> dests(ids.size());
  std::vector<RangeRead> ops;
  std::vector<int64_t> op_id;  // ops[j] reads sample op_id[j] (0-byte samples have no op)
  size_t at = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const store::Entry& e = dir_[static_cast<size_t>(ids[k])];
    dests[k] = buf.get() + at;
    at += e.length;
    if (e.length > 0) {
      ops.push_back(RangeRead{e.offset, e.length, dests[k]});
      op_id.push_back(ids[k]);
    }
  }
  std::mutex mu;
  std::vector<int64_t> bad;
  RangeDone done = [&](size_t j) {
    const RangeRead& op = ops[j];
    if (crc32c(op.dest, op.len) != dir_[static_cast<size_t>(op_id[j])].crc) {
      std::lock_guard<std::mutex> lk(mu);
      bad.push_back(op_id[j]);
    }
  };
  int fd = direct_ ? direct_fd_ : fd_;
  slot_.with([&](IoBackend& b) { b.read_ranges(fd, direct_, ops.data(), ops.size(), done); });
  std::sort(bad.begin(), bad.end());
  return bad;
}

}  // namespace shadecache
