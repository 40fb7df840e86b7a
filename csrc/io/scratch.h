// A growing buffer of one thread for reads of extents that are copied out to their samples'
// destinations (io/extent_read.cc, io/tier_reader.cc): kept between batches, freed when a batch
// made it larger than 64 MiB, so that one huge batch does not pin its memory for good.
#pragma once

#include <cstddef>
#include <memory>

namespace shadecache {

class ScratchBuffer {
 public:
  // At least `want` bytes, valid until the next get() or trim() of this buffer.
  char* get(size_t want) {
    if (want > n_) {
      p_.reset(new char[want]);
      n_ = want;
    }
    return p_.get();
  }
  // Called after a batch: frees the buffer when it grew past 64 MiB.
  void trim() {
    if (n_ > (size_t{64} << 20)) {
      p_.reset();
      n_ = 0;
    }
  }

 private:
  std::unique_ptr<char[]> p_;
  size_t n_ = 0;
};

}  // namespace shadecache
