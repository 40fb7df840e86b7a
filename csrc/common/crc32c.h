// CRC-32C (Castagnoli). Used for the checksum of every cached value and every stored sample.
// SSE4.2 crc32 instruction where the CPU has it (checked once at run time; from 192 bytes, with
// PCLMULQDQ, three interleaved chains joined by a carry-less multiply), table-driven otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shadecache {
// crc32c(data, n, seed): pass a previous result as seed to continue a running checksum.
uint32_t crc32c(const void* data, size_t n, uint32_t seed = 0);
// The same value from a single chain: the reference the interleaved path is tested against.
uint32_t crc32c_serial(const void* data, size_t n, uint32_t seed = 0);
}  // namespace shadecache
