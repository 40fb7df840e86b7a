// The shared-memory layout of one cache segment. Everything in the segment is addressed by offsets
// from the segment base, never by pointers, because every process maps it at its own address.
//
//   [Header | index[N] | heap_pos[N] | scores[N] | ticks[N] | heap[N] | pages[P] | classes[C] |
//    pins[kPinOwners] | data]
//
// index[id]     u32 atomic: 0 = not cached, else (offset of the slot in the data area) / 64 + 1
// heap_pos[id]  u32: 0 = not in the eviction heap, else position + 1 (so a zeroed segment is valid)
// scores[id]    f32 atomic: importance of EVERY sample, cached or not (SHADE's ghost cache)
// ticks[id]     u64 atomic: last access (lru) or insert (fifo) clock value; next known read position + 1
//               (clairvoyant, 0 = none known); 0 entries for other policies
// heap[k]       HeapNode{key, id}: indexed min-heap over the eviction priority (csrc/cache/heap.h)
// pages[p]      PageMeta: the size class a slab page belongs to and its generation (seqlock)
// classes[c]    ClassMeta: slot size, free list head, counts
// pins[r]       PinOwner: the slots one process pins with zero-copy views (csrc/cache/pins.h)
// data          P pages of page_size bytes; a page is cut into slots of its class's slot_size;
//               each slot is a SlotHeader followed by the value bytes.
//
// docs/shared_memory.md explains the protocols (who writes what, under which lock, with which
// memory ordering). Changing any struct here requires bumping kLayoutVersion.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace shadecache {

constexpr uint64_t kMagic = 0x3148434544414853ull;  // "SHADECH1" little-endian
// 2: pin table, zombie list; 3: PageMeta::zombies; 4: size classes fitted and learned (ClassMeta
// slot_size 0 = unused entry), capacity_bytes a budget of value bytes, data_bytes, persistence;
// 5: large values in runs of whole pages (PageMeta::cls kRunHead / kRunTail), max_item_bytes a limit.
constexpr uint32_t kLayoutVersion = 5;
constexpr uint32_t kNoId = 0xFFFFFFFFu;
constexpr uint32_t kFreePage = 0xFFFFFFFFu;
// A value larger than a slab page lives in a run of contiguous whole pages: the first page's
// PageMeta::cls is kRunHead (its slot header at the page start, the value running on through the
// next pages), the others' kRunTail. See PageMeta for the run length and the links.
constexpr uint32_t kRunHead = 0xFFFFFFFEu;
constexpr uint32_t kRunTail = 0xFFFFFFFDu;
constexpr uint32_t kMaxClasses = 64;
constexpr size_t kAlign = 64;  // cache line: every array and every slot starts on one
constexpr uint64_t kMaxDataBytes = (uint64_t{1} << 32) * kAlign;  // see SlotHeader::next_free

enum class Policy : uint32_t { kImportance = 0, kLru = 1, kFifo = 2, kStatic = 3, kClairvoyant = 4 };

// Reader counters, striped: each process counts in the stripe of its pid, on its own cache line,
// so that readers in many processes do not bounce one line between cores on every get. stats()
// adds the stripes. Relaxed atomics: counters, nobody orders other memory by them.
constexpr uint32_t kReaderStripes = 64;
struct alignas(64) ReaderStats {
  std::atomic<uint64_t> hits;
  std::atomic<uint64_t> misses;
  std::atomic<uint64_t> read_retries;  // a reader raced a writer and read again
  std::atomic<uint64_t> pad_[5];
};

// Zero-copy views: processes that may hold views at once, and views one process may hold.
constexpr uint32_t kPinOwners = 128;
constexpr uint32_t kPinsPerOwner = 512;
struct alignas(64) PinOwner {
  std::atomic<int64_t> pid;          // 0 = free; claimed by CAS 0 -> pid, freed by a writer's reap
  std::atomic<uint64_t> start_time;  // of pid (0 while being claimed): tells a reused pid apart
  std::atomic<uint32_t> hwm;         // entries [0, hwm) may be non-zero; raised before an entry is set
  uint32_t reserved_[11];
  std::atomic<uint32_t> slots[kPinsPerOwner];  // pinned slot: offset / kAlign + 1; 0 = empty
};

// Writer-side counters: updated under the mutex (relaxed atomics so stats() may read them unlocked).
struct alignas(64) Stats {
  std::atomic<uint64_t> inserts;
  std::atomic<uint64_t> updates;     // put of an id that was already cached
  std::atomic<uint64_t> evictions;
  std::atomic<uint64_t> rejected;    // admission refused
  std::atomic<uint64_t> page_moves;  // slab pages moved from one size class to another
  std::atomic<uint64_t> recoveries;  // EOWNERDEAD repairs
  std::atomic<uint64_t> score_updates;
  std::atomic<uint64_t> pad2_;
};

struct alignas(64) Header {
  // ---- identity: written once by the creator before `magic`, read-only afterwards.
  std::atomic<uint64_t> magic;  // stored last with release: a reader that sees it sees the rest
  uint32_t layout_version;
  uint32_t header_size;        // sizeof(Header), and the struct sizes below, checked at attach
  uint32_t slot_header_size;
  uint32_t page_meta_size;
  uint32_t class_meta_size;
  uint32_t heap_node_size;
  uint32_t policy;
  uint32_t num_classes;
  uint64_t num_samples;
  uint64_t capacity_bytes;     // budget of value bytes: bytes_used never exceeds it
  uint64_t page_size;
  uint64_t max_item_bytes;     // largest value accepted (a user's limit, or what the data area holds)
  uint64_t num_pages;
  uint64_t total_size;         // whole segment
  uint64_t off_index, off_heap_pos, off_scores, off_ticks, off_heap, off_pages, off_classes, off_pins, off_data;
  int64_t creator_pid;
  uint64_t creator_start_time;  // /proc/<pid>/stat field 22: tells a reused pid from the creator
  uint64_t created_unix_ns;
  char name[128];
  uint64_t data_bytes;          // size of the data area = num_pages * page_size (>= capacity_bytes
                                // when sized from the sample sizes: slot headers come on top)
  uint32_t persist;             // 1: the segment outlives every process (warm restart)
  uint32_t reserved0_;
  char fingerprint[80];         // the data set the values belong to ("" = not named)
  // Time of the latest create or attach (ns since the epoch): `shadecache ls`, and `gc --keep-for`.
  std::atomic<uint64_t> last_attach_unix_ns;

  // ---- writer state: only read or written with `mutex` held.
  alignas(64) pthread_mutex_t mutex;  // process-shared, robust
  uint64_t heap_size;
  uint64_t free_page_head;  // page index + 1 of the first free page, 0 = none
  uint64_t items;
  uint64_t bytes_used;      // sum of cached value lengths
  // Zombies: slots whose value was evicted, replaced or removed while a view pinned it. They are
  // neither live nor free; linked through SlotHeader::next_free (offset / kAlign + 1, 0 = end) and
  // freed by the first writer that finds them unpinned.
  uint64_t zombie_head;
  uint64_t zombies;
  // Bumped whenever a size class is created or recut for another slot size (classes are learned
  // as values arrive): each process keeps a sorted copy of the table and rebuilds it on a change.
  uint64_t class_gen;
  // The clairvoyant policy's blend weight (csrc/cache/policies/clairvoyant.cc): 0 in a zeroed
  // segment, the default. It sits in the padding before pin_active, so no offset or size moves.
  double policy_weight;

  // ---- pin records in use: bit r of word r / 64 is set while PinOwner r is claimed. Set by the
  // claiming process (seq_cst), cleared by a writer's reap; lets writers skip the table when no
  // process holds views.
  alignas(64) std::atomic<uint64_t> pin_active[2];

  // ---- clock for lru/fifo ticks: writers advance it on every insert; lru readers stamp hits with
  // its current value (relaxed loads; see Cache::read).
  alignas(64) std::atomic<uint64_t> clock;

  alignas(64) Stats stats;
  ReaderStats reader_stats[kReaderStripes];
};

// A slot: the header of one cached value; the value bytes follow it.
// seq is a seqlock: even = stable, odd = being written. A writer bumps it to odd, changes the slot,
// then bumps it to even with release. id == kNoId marks a free slot.
struct SlotHeader {
  std::atomic<uint64_t> seq;
  uint32_t id;
  uint32_t len;
  uint32_t crc;             // crc32c of the value: check() verifies every cached value with it
  uint32_t zombie;          // 1 while on the zombie list (Header::zombie_head); writer-only
  // Free list links (doubly linked, so a page leaving its class unlinks its free slots in O(1)
  // each), in units of kAlign bytes of the data area, + 1; 0 = none. Hence a data area of at most
  // 2^32 * 64 B = 256 GiB.
  uint32_t next_free;
  uint32_t prev_free;
};

// gen is a seqlock over the page's layout: odd while the page is being moved to another class, or
// taken into a run. A page of a class (or a run) holds at least one live value or zombie at every
// unlock: one that holds neither goes back to the free page list at once
// (Slab::do_release_if_empty), for any class or run to take.
// Runs (large values): the head page (cls kRunHead) holds one slot at its start, counted in its
// live / zombies / key_sum like any page, and next_free_page = the run's length in pages; each
// tail page (cls kRunTail) has next_free_page = head page index + 1. Both are written under the
// mutex before the run's slot is written, and readers read the length only as a bound (relaxed).
struct PageMeta {
  std::atomic<uint64_t> gen;
  uint32_t cls;             // size class, or kFreePage
  uint32_t live;            // live slots on the page (writer-only)
  uint32_t zombies;         // zombie slots on the page (writer-only)
  uint32_t next_free_page;  // free page list link: page index + 1, 0 = end (runs: see above)
  double key_sum;           // sum of the eviction keys of the page's live values (writer-only):
                            // picks the page to move when memory must change size class
};

struct ClassMeta {
  uint32_t slot_size;       // header + largest value, a multiple of kAlign; 0 = entry unused
  uint32_t slots_per_page;
  uint64_t free_head;       // first free slot, as SlotHeader::next_free; 0 = none
  uint64_t free_slots;
  uint64_t pages;
  uint64_t items;
  uint64_t fitted;          // 1: fitted to the sizes given at create; kept for the cache's life
  uint64_t reserved[2];
};

struct HeapNode {
  double key;   // eviction priority: the smallest is evicted first
  uint32_t id;
  uint32_t reserved;
};

static_assert(sizeof(SlotHeader) == 32, "SlotHeader layout changed: bump kLayoutVersion");
static_assert(sizeof(PageMeta) == 32, "PageMeta layout changed: bump kLayoutVersion");
static_assert(sizeof(ClassMeta) == 64, "ClassMeta layout changed: bump kLayoutVersion");
static_assert(sizeof(PinOwner) == 64 + 4 * kPinsPerOwner, "PinOwner layout changed: bump kLayoutVersion");
static_assert(kPinOwners == 2 * 64, "Header::pin_active has one bit per pin record");
static_assert(sizeof(HeapNode) == 16, "HeapNode layout changed: bump kLayoutVersion");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "64-bit atomics must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "32-bit atomics must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<float>) == 4 && std::atomic<float>::is_always_lock_free,
              "float atomics must be lock-free to live in shared memory");

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace shadecache
