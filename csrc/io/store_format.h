// The on-disk format of a packed sample store (".shc"), version 2. docs/store_format.md describes
// it for readers; this header is the one place the code defines it (the writer and the reader
// both include it).
//
//   offset 0            Header (one 4096-byte block; 128 bytes used, the rest zero)
//   data_offset (4096)  the samples, back to back in placement order, no padding
//   dir_offset          the sample directory, three columns in id order and a trailer:
//                         lengths  num_samples x len_width bytes (1, 2 or 4; unsigned)
//                         crcs     num_samples x 4 bytes (crc32c of each sample)
//                         labels   num_samples x label_width bytes (1, 2, 4 or 8; signed)
//                         trailer  "SHDCDIR\0" + u64 num_samples (16 bytes)
//   meta_offset         optional metadata, UTF-8 JSON (class names, source), may be empty
//   file_bytes          end of file
//
// Dense: a sample takes its own bytes plus len_width + 4 + label_width bytes of directory (256 B
// samples with 10 classes: 263 bytes, 1.03x). Offsets are not stored: the data region holds the
// samples in placement order (placement_order() below), so sample ids[slot]'s offset is
// data_offset plus the lengths of the slots before it. Alignment belongs to the reader: an
// O_DIRECT read is widened to the aligned blocks that cover the samples it wants.
//
// The header is written last, at offset 0 of a temporary file that is then fsync'ed and renamed
// into place, so a pack interrupted at any point leaves a file whose header is all zeros (bad
// magic) under a temporary name, never a store that opens as valid.
// All integers are little-endian (the only byte order this code runs on; checked below).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shadecache {
namespace store {

constexpr char kMagic[8] = {'S', 'H', 'D', 'C', 'P', 'A', 'C', 'K'};
constexpr char kDirMagic[8] = {'S', 'H', 'D', 'C', 'D', 'I', 'R', '\0'};
constexpr uint32_t kVersion = 2;
constexpr uint32_t kAlign = 4096;          // O_DIRECT block granularity (the reader's, not the format's)
constexpr uint32_t kHeaderBytes = 4096;    // the header block; the data region starts after it
constexpr uint64_t kMaxSampleBytes = 0xFFFFFFFFull;  // lengths are at most 32-bit
constexpr uint32_t kCrcBytes = 4;
constexpr uint32_t kTrailerBytes = 16;

// How samples are laid out in the data region.
enum Placement : uint32_t {
  kAsWritten = 0,  // slot s holds sample s
  kShuffled = 1,   // slot s holds sample placement_order(n, placement_seed)[s]
};

// One sample as the reader keeps it in memory (the file stores no offsets; see above).
struct Entry {
  uint64_t offset;  // byte offset of the sample in the file
  uint32_t length;  // sample length in bytes
  uint32_t crc;     // crc32c of the sample's `length` bytes
  int64_t label;    // class label given at pack time
};

struct Header {
  char magic[8];           //   0
  uint32_t version;        //   8  checked before anything else after the magic (every version)
  uint32_t header_bytes;   //  12  == kHeaderBytes
  uint32_t len_width;      //  16  1, 2 or 4: bytes per entry of the lengths column
  uint32_t label_width;    //  20  1, 2, 4 or 8: bytes per entry of the labels column
  uint64_t num_samples;    //  24
  uint64_t data_offset;    //  32  == header_bytes
  uint64_t data_bytes;     //  40  == the sum of all lengths
  uint64_t dir_offset;     //  48  == data_offset + data_bytes
  uint64_t dir_bytes;      //  56  == num_samples * (len_width + 4 + label_width) + kTrailerBytes
  uint32_t dir_crc;        //  64  crc32c of the directory bytes (trailer included)
  uint32_t meta_crc;       //  68  crc32c of the metadata bytes
  uint64_t meta_offset;    //  72  == dir_offset + dir_bytes
  uint64_t meta_bytes;     //  80
  uint64_t file_bytes;     //  88  == meta_offset + meta_bytes; a shorter file is truncated
  uint32_t placement;      //  96  Placement
  uint32_t reserved0;      // 100  zero
  uint64_t placement_seed; // 104  the seed of kShuffled (0 for kAsWritten)
  uint8_t reserved[12];    // 112  zero
  uint32_t header_crc;     // 124  crc32c of bytes [0, 124)
};
static_assert(sizeof(Header) == 128, "Header layout is part of the file format");
static_assert(offsetof(Header, version) == 8, "version must stay at offset 8 in every version");
static_assert(offsetof(Header, placement_seed) == 104, "Header layout is part of the file format");
static_assert(offsetof(Header, header_crc) == 124, "header_crc covers the 124 bytes before it");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the format is little-endian");

inline uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline uint64_t align_down(uint64_t n) { return n / kAlign * kAlign; }

inline uint64_t entry_bytes(const Header& h) { return uint64_t{h.len_width} + kCrcBytes + h.label_width; }

// The ids in placement order: slot s of the data region holds sample result[s]. A Fisher-Yates
// shuffle of 0..n-1 driven by splitmix64 from `seed` (for i = n-1 down to 1: j = the high 64 bits
// of next() * (i + 1); swap slots i and j). Part of the format: the writer and the reader must
// derive the same order from the seed the header records.
std::vector<uint64_t> placement_order(uint64_t n, uint64_t seed);

}  // namespace store
}  // namespace shadecache
