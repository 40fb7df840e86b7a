// The shared-memory layout of one cache segment. Everything in the segment is addressed by offsets
// from the segment base, never by pointers, because every process maps it at its own address.
//
//   fixed part (the same for every cache, on top of capacity_bytes):
//     [Header | classes[C] | pins[kPinOwners]]
//   capacity_bytes (everything else; geometry.cc sizes it to fit):
//     [index[N] | heap_pos[N] | scores[N] | ticks[N] | heap_table[H] | pages[P] | chunk_owner[16 P] | data]
//
// index[id]       u32 atomic: 0 = not cached, else (offset of the value's head slot) >> unit_shift + 1
// heap_pos[id]    u32: 0 = not in the eviction heap, else position + 1 (so a zeroed segment is valid)
// scores[id]      f32 atomic: importance of EVERY sample, cached or not (SHADE's ghost cache)
// ticks[id]       u64 atomic: last access (lru) or insert (fifo) clock value; next known read position + 1
//                 (clairvoyant, 0 = none known); absent for other policies
// heap_table[h]   u32: the data page holding heap nodes [h * npp, (h + 1) * npp) (npp = page_size / 12)
// pages[p]        PageMeta: what page p holds (a class's slots, heap nodes, or nothing) and its generation
// chunk_owner[c]  u32: the id whose value chunk c belongs to, kNoId when free (writer-only)
// classes[c]      ClassMeta: slot size, free list head, counts
// pins[r]         PinOwner: the slots one process pins with zero-copy views (csrc/cache/pins.h)
// data            P pages of page_size bytes. A page is free, holds heap nodes (HeapNode), or is cut
//                 into slots of one class. Class 0 cuts it into 16 chunks of chunk_size bytes, raw
//                 value bytes; every other class into head slots: a SlotHeader, then the value's
//                 chunk numbers (u32 each), then the value's last len % chunk_size bytes.
//
// A value of len bytes is (len / chunk_size) whole chunks, in order, followed by its tail: the
// head slot holds the tail, so a value smaller than a chunk is one slot, contiguous, and a larger
// one never needs memory side by side. docs/shared_memory.md explains the protocols (who writes
// what, under which lock, with which memory ordering). Changing any struct here requires bumping
// kLayoutVersion.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace shadecache {

constexpr uint64_t kMagic = 0x3148434544414853ull;  // "SHADECH1" little-endian
// 2: pin table, zombie list; 3: PageMeta::zombies; 4: size classes fitted and learned; 5: large
// values in runs of whole pages; 6: capacity_bytes is the memory; values are chunk chains with a
// head slot; 16-byte slot headers; heap nodes live in data pages; index units of 2^unit_shift bytes.
constexpr uint32_t kLayoutVersion = 6;
constexpr uint32_t kNoId = 0xFFFFFFFFu;
constexpr uint32_t kFreePage = 0xFFFFFFFFu;  // PageMeta::cls of a page on the free page list
constexpr uint32_t kHeapPage = 0xFFFFFFFEu;  // PageMeta::cls of a page of heap nodes
constexpr uint32_t kChunkClass = 0;          // class 0: whole chunks of values (no slot header)
constexpr uint32_t kPageClass = 1;           // class 1: one head slot the size of the page
constexpr uint32_t kMaxClasses = 64;
constexpr uint32_t kChunksPerPage = 16;      // chunk_size = page_size / 16
constexpr size_t kAlign = 64;                // every array starts on a cache line
constexpr uint32_t kMinUnitShift = 4;        // slots start on 16-byte bounds (more for > 64 GiB)
constexpr uint64_t kMaxDataBytes = uint64_t{256} << 30;

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
  std::atomic<uint32_t> slots[kPinsPerOwner];  // pinned slot: its unit code (index form); 0 = empty
};

// Writer-side counters: updated under the mutex (relaxed atomics so stats() may read them unlocked).
struct alignas(64) Stats {
  std::atomic<uint64_t> inserts;
  std::atomic<uint64_t> updates;      // put of an id that was already cached
  std::atomic<uint64_t> evictions;
  std::atomic<uint64_t> rejected;     // admission refused
  std::atomic<uint64_t> page_moves;   // pages emptied by moving their values, for another use
  std::atomic<uint64_t> recoveries;   // EOWNERDEAD repairs
  std::atomic<uint64_t> score_updates;
  std::atomic<uint64_t> relocations;  // values (or chunks) moved to free a page
};

struct alignas(64) Header {
  // ---- identity: written once by the creator before `magic`, read-only afterwards. The fields up
  // to last_attach_unix_ns keep the offsets of every earlier layout version (static_asserts
  // below): `shadecache gc` of any version reads the creator of any segment at the same place
  // (misreading it would take a live cache for a dead one's), and attach reports the version.
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
  uint64_t capacity_bytes;     // the memory the user gave: the segment less its fixed part
  uint64_t page_size;          // a power of two
  uint64_t max_item_bytes;     // largest value accepted (a user's limit, or what the cache holds)
  uint64_t num_pages;
  uint64_t total_size;         // whole segment
  uint64_t off_index, off_heap_pos, off_scores, off_ticks, off_heap_table, off_pages, off_classes, off_pins,
      off_data;
  int64_t creator_pid;
  uint64_t creator_start_time;  // /proc/<pid>/stat field 22: tells a reused pid from the creator
  uint64_t created_unix_ns;
  char name[128];
  uint64_t data_bytes;          // num_pages * page_size
  uint32_t persist;             // 1: the segment outlives every process (warm restart)
  uint32_t reserved0_;
  char fingerprint[80];         // the data set the values belong to ("" = not named)
  // Time of the latest create or attach (ns since the epoch): `shadecache ls`, and `gc --keep-for`.
  std::atomic<uint64_t> last_attach_unix_ns;
  // (layout version 6 on)
  uint64_t chunk_size;          // page_size / kChunksPerPage
  uint64_t fixed_bytes;         // Header + classes + pins, page-aligned: the part outside capacity_bytes
  uint64_t off_chunk_owner;
  uint64_t heap_table_len;      // entries of heap_table
  uint32_t unit_shift;          // index entries, pins and free-list links count 2^unit_shift bytes
  uint32_t reserved1_;

  // ---- writer state: only read or written with `mutex` held.
  alignas(64) pthread_mutex_t mutex;  // process-shared, robust
  uint64_t heap_size;
  uint64_t heap_pages;      // heap_table[0, heap_pages) name the pages of heap nodes
  uint64_t free_page_head;  // page index + 1 of the first free page, 0 = none
  uint64_t free_pages;      // pages on that list
  uint64_t items;
  uint64_t bytes_used;      // sum of cached value lengths
  // Zombies: head slots whose value was evicted, replaced, removed or moved while a view pinned
  // it. They are neither live nor free; linked through SlotHeader::next_zombie (unit code, 0 =
  // end) and freed by the first writer that finds them unpinned.
  uint64_t zombie_head;
  uint64_t zombies;
  // Bumped whenever a size class is created or recut for another slot size (classes are learned
  // as values arrive): each process keeps a sorted copy of the table and rebuilds it on a change.
  uint64_t class_gen;
  // The clairvoyant policy's blend weight (csrc/cache/policies/clairvoyant.cc): 0 in a zeroed
  // segment, the default.
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

// The header of a head slot; the value's chunk numbers and tail follow it.
// seq is a seqlock: even = stable, odd = being written. A writer bumps it to odd, changes the slot
// (or, for a value in chunks, any of its chunks or chunk numbers), then bumps it to even with
// release. id == kNoId marks a free slot. The last two words are reused by slots that hold no
// live value: a free slot links its class's free list through both; a zombie keeps its length
// and links the zombie list through the last (crc) word, without a seq change.
// (A free chunk of class 0 has no header: chunk_owner says it is free, and its bytes 8..15 hold
// the same two free-list links.)
struct SlotHeader {
  std::atomic<uint32_t> seq;
  uint32_t id;
  union {
    uint32_t len;        // live or zombie: value length
    uint32_t next_free;  // free: next free slot of the class (unit code, 0 = end)
  };
  union {
    uint32_t crc;          // live: crc32c of the value; check() verifies every cached value with it
                           // (a reader takes it with len, before validating: Cache::SlotAt)
    uint32_t prev_free;    // free: previous free slot (unit code, 0 = none)
    uint32_t next_zombie;  // zombie: next zombie (unit code, 0 = end)
  };
};

// gen is a seqlock over the page's layout: odd while the page is recut for another class or
// becomes a heap page. A page of a class holds at least one live value, chunk or zombie at every
// unlock: one that holds none goes back to the free page list at once
// (Slab::do_release_if_empty), for any class or the heap to take.
struct PageMeta {
  std::atomic<uint64_t> gen;
  uint32_t cls;             // size class, kFreePage or kHeapPage
  uint32_t live;            // live slots (head slots or owned chunks) on the page (writer-only)
  uint32_t zombies;         // zombie slots on the page (writer-only)
  uint32_t next_free_page;  // free page list link: page index + 1, 0 = end
};

struct ClassMeta {
  uint32_t slot_size;       // a multiple of 2^unit_shift; 0 = entry unused
  uint32_t slots_per_page;
  uint64_t free_head;       // first free slot, as SlotHeader::next_free; 0 = none
  uint64_t free_slots;
  uint64_t pages;
  uint64_t items;           // live slots
  uint64_t fitted;          // 1: fitted to the sizes given at create; kept for the cache's life
  uint64_t reserved[2];
};

// A node of the eviction heap: 12 bytes, so that a small value's share of the heap stays small
// (nodes live in data pages, npp = page_size / 12 of them per page; the key is read unaligned).
#pragma pack(push, 4)
struct HeapNode {
  double key;   // eviction priority: the smallest is evicted first
  uint32_t id;
};
#pragma pack(pop)

static_assert(offsetof(Header, layout_version) == 8 && offsetof(Header, page_size) == 56 &&
                  offsetof(Header, creator_pid) == 160 && offsetof(Header, creator_start_time) == 168 &&
                  offsetof(Header, persist) == 320 && offsetof(Header, last_attach_unix_ns) == 408,
              "the identity fields keep their offsets across layout versions");
static_assert(sizeof(SlotHeader) == 16, "SlotHeader layout changed: bump kLayoutVersion");
static_assert(sizeof(PageMeta) == 24, "PageMeta layout changed: bump kLayoutVersion");
static_assert(sizeof(ClassMeta) == 64, "ClassMeta layout changed: bump kLayoutVersion");
static_assert(sizeof(HeapNode) == 12, "HeapNode layout changed: bump kLayoutVersion");
static_assert(sizeof(PinOwner) == 64 + 4 * kPinsPerOwner, "PinOwner layout changed: bump kLayoutVersion");
static_assert(kPinOwners == 2 * 64, "Header::pin_active has one bit per pin record");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "64-bit atomics must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "32-bit atomics must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<float>) == 4 && std::atomic<float>::is_always_lock_free,
              "float atomics must be lock-free to live in shared memory");

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace shadecache
