// Errors raised by the engine. One type carries a kind; csrc/bindings/errors.cc is the one place
// that maps each kind to a Python exception. Syscalls go through throw_errno() so that every
// failure names the call, the object and the errno.
#pragma once

#include <stdexcept>
#include <string>

namespace shadecache {

enum class ErrorKind {
  kInvalidArgument,  // wrong value from the caller             -> ValueError
  kOutOfRange,       // sample id outside [0, num_samples)        -> IndexError
  kTooLarge,         // value larger than the cache can ever hold -> ValueError (sc.ValueTooLargeError)
  kCapacity,         // not enough shared memory / disk space     -> sc.CapacityError
  kExists,           // name already taken                        -> FileExistsError
  kNotFound,         // no such cache / file                      -> FileNotFoundError
  kClosed,           // used after close()                        -> sc.ClosedError
  kLayout,           // segment of another layout version         -> sc.LayoutVersionError
  kCorruption,       // an invariant does not hold                -> sc.CorruptionError
  kFormat,           // a store file is malformed                 -> sc.StoreFormatError
  kCorruptSample,    // a sample's checksum does not match        -> sc.CorruptSampleError
  kOs,               // any other errno                           -> OSError(errno)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what, int err = 0)
      : std::runtime_error(what), kind_(kind), errno_(err) {}
  ErrorKind kind() const { return kind_; }
  int err() const { return errno_; }

 private:
  ErrorKind kind_;
  int errno_;
};

// A checksum mismatch in a store: carries the id and file offset so Python can expose them.
class CorruptSample : public Error {
 public:
  CorruptSample(const std::string& what, unsigned long long id, unsigned long long offset)
      : Error(ErrorKind::kCorruptSample, what), id_(id), offset_(offset) {}
  unsigned long long id() const { return id_; }
  unsigned long long offset() const { return offset_; }

 private:
  unsigned long long id_, offset_;
};

// Throws an Error for `err` with "<what>: <strerror>"; ENOENT, EEXIST and ENOSPC get their kinds.
[[noreturn]] void throw_errno(const std::string& what, int err);

}  // namespace shadecache
