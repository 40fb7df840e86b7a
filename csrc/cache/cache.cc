#include "cache/cache.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cmath>
#include <limits>
#include <cstdio>
#include <thread>

#include "cache/robust_mutex.h"
#include "common/crc32c.h"

namespace shadecache {
namespace {

constexpr uint64_t kMinPageSize = 64 * 1024;

uint64_t next_pow2(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

uint64_t page_size_for(uint64_t max_item_bytes) {
  uint64_t ps = next_pow2(max_item_bytes + sizeof(SlotHeader));
  return ps < kMinPageSize ? kMinPageSize : ps;
}

struct Layout {
  uint64_t page_size, num_pages, off_index, off_heap_pos, off_scores, off_ticks, off_heap, off_pages,
      off_classes, off_pins, off_data, total;
};

Layout compute_layout(const CacheOptions& o) {
  Layout l{};
  l.page_size = page_size_for(o.max_item_bytes);
  l.num_pages = o.capacity_bytes / l.page_size;
  uint64_t n = o.num_samples;
  uint64_t off = align_up(sizeof(Header), kAlign);
  auto take = [&](uint64_t bytes) {
    uint64_t at = off;
    off = align_up(off + bytes, kAlign);
    return at;
  };
  l.off_index = take(n * sizeof(std::atomic<uint32_t>));
  l.off_heap_pos = take(n * sizeof(uint32_t));
  l.off_scores = take(n * sizeof(std::atomic<float>));
  bool ticked = policy_by_id(static_cast<uint32_t>(o.policy))->uses_ticks();
  l.off_ticks = take(ticked ? n * sizeof(std::atomic<uint64_t>) : 0);
  l.off_heap = take(n * sizeof(HeapNode));
  l.off_pages = take(l.num_pages * sizeof(PageMeta));
  l.off_classes = take(kMaxClasses * sizeof(ClassMeta));
  l.off_pins = take(kPinOwners * sizeof(PinOwner));
  l.off_data = align_up(off, 4096);
  l.total = l.off_data + l.num_pages * l.page_size;
  return l;
}

void validate(const CacheOptions& o) {
  if (o.num_samples == 0 || o.num_samples >= kNoId)
    throw Error(ErrorKind::kInvalidArgument,
                "num_samples must be in [1, " + std::to_string(kNoId - 1) + "], got " + std::to_string(o.num_samples));
  if (o.max_item_bytes == 0 || o.max_item_bytes > (uint64_t{1} << 30))
    throw Error(ErrorKind::kInvalidArgument, "max_item_bytes must be in [1, 1 GiB], got " + std::to_string(o.max_item_bytes));
  uint64_t ps = page_size_for(o.max_item_bytes);
  if (o.capacity_bytes < ps)
    throw Error(ErrorKind::kInvalidArgument,
                "capacity_bytes=" + std::to_string(o.capacity_bytes) + " is smaller than one slab page (" +
                    std::to_string(ps) + " bytes for max_item_bytes=" + std::to_string(o.max_item_bytes) +
                    "); raise capacity_bytes or lower max_item_bytes");
  if (o.capacity_bytes > kMaxDataBytes)
    throw Error(ErrorKind::kInvalidArgument, "capacity_bytes may be at most 256 GiB");
  if (!policy_by_id(static_cast<uint32_t>(o.policy)))
    throw Error(ErrorKind::kInvalidArgument, "unknown policy number " + std::to_string(static_cast<uint32_t>(o.policy)));
}

}  // namespace

std::atomic<uint64_t> g_fork_generation{0};

namespace {
struct ForkWatch {
  ForkWatch() {
    pthread_atfork(nullptr, nullptr, [] { g_fork_generation.fetch_add(1, std::memory_order_relaxed); });
  }
} g_fork_watch;
}  // namespace

void Cache::pick_stripe() {
  stripe_ = &hdr_->reader_stats[static_cast<uint32_t>(::getpid()) % kReaderStripes];
  stripe_gen_ = g_fork_generation.load(std::memory_order_relaxed);
}

// ---- construction --------------------------------------------------------------------------

uint64_t Cache::segment_bytes(const CacheOptions& opts) {
  validate(opts);
  return compute_layout(opts).total;
}

std::unique_ptr<Cache> Cache::create(const std::string& name, const CacheOptions& opts) {
  validate(opts);
  Layout l = compute_layout(opts);
  // The creator's identity goes in first (pwrite: an error, not a SIGBUS, on a full tmpfs), so that
  // an attacher arriving during the reservation sees who is still building the segment.
  struct {
    int64_t pid;
    uint64_t start_time;
  } creator{::getpid(), process_start_time(::getpid())};
  static_assert(offsetof(Header, creator_start_time) == offsetof(Header, creator_pid) + 8, "creator fields adjacent");
  Segment seg = Segment::create(name, l.total, [&](int fd) {
    if (::pwrite(fd, &creator, sizeof creator, offsetof(Header, creator_pid)) != sizeof creator)
      throw_errno("pwrite(" + Segment::path(name) + ")", errno);
    if (long ms = g_create_delay_ms.load()) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  });
  // The segment is zero-filled (tmpfs): index empty, heap_pos "absent", scores 0, ticks 0.
  auto* h = new (seg.base()) Header();
  h->layout_version = kLayoutVersion;
  h->header_size = sizeof(Header);
  h->slot_header_size = sizeof(SlotHeader);
  h->page_meta_size = sizeof(PageMeta);
  h->class_meta_size = sizeof(ClassMeta);
  h->heap_node_size = sizeof(HeapNode);
  h->policy = static_cast<uint32_t>(opts.policy);
  h->num_samples = opts.num_samples;
  h->page_size = l.page_size;
  h->max_item_bytes = opts.max_item_bytes;
  h->num_pages = l.num_pages;
  h->capacity_bytes = l.num_pages * l.page_size;
  h->total_size = l.total;
  h->off_index = l.off_index;
  h->off_heap_pos = l.off_heap_pos;
  h->off_scores = l.off_scores;
  h->off_ticks = l.off_ticks;
  h->off_heap = l.off_heap;
  h->off_pages = l.off_pages;
  h->off_classes = l.off_classes;
  h->off_pins = l.off_pins;
  h->off_data = l.off_data;
  h->creator_pid = creator.pid;
  h->creator_start_time = creator.start_time;
  h->created_unix_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  std::snprintf(h->name, sizeof h->name, "%s", name.c_str());
  robust_mutex_init(&h->mutex);
  h->num_classes = Slab::build_classes(reinterpret_cast<ClassMeta*>(seg.base() + l.off_classes), l.page_size);
  std::unique_ptr<Cache> c(new Cache());
  c->bind(std::move(seg), name);
  c->slab_.init();
  // Publish: an attacher that sees the magic (acquire) sees every field above.
  h->magic.store(kMagic, std::memory_order_release);
  return c;
}

std::unique_ptr<Cache> Cache::attach(const std::string& name) {
  Segment seg = Segment::attach(name);
  if (seg.size() < sizeof(Header))
    throw Error(ErrorKind::kLayout, "'" + Segment::path(name) + "' is too small to be a shadecache segment");
  auto* h = reinterpret_cast<Header*>(seg.base());
  // The creator publishes the magic last. Reserving a large segment takes seconds: wait as long as
  // the creator (whose pid it writes before reserving) lives; a segment naming no creator for 2 s,
  // or one whose creator is gone, was abandoned.
  uint64_t magic = h->magic.load(std::memory_order_acquire);
  for (int unnamed_ms = 0; magic == 0; unnamed_ms += 10) {
    int64_t pid = __atomic_load_n(&h->creator_pid, __ATOMIC_RELAXED);
    uint64_t start = __atomic_load_n(&h->creator_start_time, __ATOMIC_RELAXED);
    if ((pid && process_gone(pid, start)) || (!pid && unnamed_ms >= 2000))
      throw Error(ErrorKind::kLayout, "cache '" + name + "' was never finished: its creator (pid " + std::to_string(pid) +
                                          ") died while creating it; remove it with `shadecache rm " + name + "`");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    magic = h->magic.load(std::memory_order_acquire);
  }
  if (magic != kMagic)
    throw Error(ErrorKind::kLayout, "'" + Segment::path(name) + "' is not a shadecache segment (bad magic)");
  if (h->layout_version != kLayoutVersion || h->header_size != sizeof(Header) ||
      h->slot_header_size != sizeof(SlotHeader) || h->page_meta_size != sizeof(PageMeta) ||
      h->class_meta_size != sizeof(ClassMeta) || h->heap_node_size != sizeof(HeapNode))
    throw Error(ErrorKind::kLayout, "cache '" + name + "' has layout version " + std::to_string(h->layout_version) +
                                        " but this shadecache reads version " + std::to_string(kLayoutVersion) +
                                        "; recreate the cache with this version");
  if (h->page_size < kMinPageSize || (h->page_size & (h->page_size - 1)))
    throw Error(ErrorKind::kLayout, "cache '" + name + "' has a page size of " + std::to_string(h->page_size) +
                                        " bytes, not a power of two: the header is corrupt");
  if (!policy_by_id(h->policy))
    throw Error(ErrorKind::kLayout, "cache '" + name + "' names policy number " + std::to_string(h->policy) +
                                        ", which this shadecache does not know");
  if (h->total_size != seg.size())
    throw Error(ErrorKind::kLayout, "cache '" + name + "' is " + std::to_string(seg.size()) + " bytes but its header says " +
                                        std::to_string(h->total_size));
  std::unique_ptr<Cache> c(new Cache());
  c->bind(std::move(seg), name);
  return c;
}

bool Cache::read_creator(const std::string& name, int64_t* pid, uint64_t* start_time) {
  Segment seg = Segment::attach(name);
  if (seg.size() < sizeof(Header)) return false;
  auto* h = reinterpret_cast<Header*>(seg.base());
  *pid = h->creator_pid;
  *start_time = h->creator_start_time;
  return true;
}

void Cache::bind(Segment seg, const std::string& name) {
  seg_ = std::move(seg);
  name_ = name;
  char* b = seg_.base();
  hdr_ = reinterpret_cast<Header*>(b);
  n_ = hdr_->num_samples;
  index_ = reinterpret_cast<std::atomic<uint32_t>*>(b + hdr_->off_index);
  heap_pos_ = reinterpret_cast<uint32_t*>(b + hdr_->off_heap_pos);
  scores_ = reinterpret_cast<std::atomic<float>*>(b + hdr_->off_scores);
  ticks_ = reinterpret_cast<std::atomic<uint64_t>*>(b + hdr_->off_ticks);
  pages_ = reinterpret_cast<PageMeta*>(b + hdr_->off_pages);
  data_ = b + hdr_->off_data;
  page_size_ = hdr_->page_size;
  page_shift_ = static_cast<uint32_t>(__builtin_ctzll(page_size_));  // a power of two (checked on attach)
  data_bytes_ = hdr_->num_pages * page_size_;
  slab_ = Slab(data_, pages_, reinterpret_cast<ClassMeta*>(b + hdr_->off_classes), &hdr_->free_page_head,
               hdr_->num_pages, page_size_, hdr_->num_classes);
  heap_ = IndexedHeap(reinterpret_cast<HeapNode*>(b + hdr_->off_heap), heap_pos_, &hdr_->heap_size);
  pins_.bind(reinterpret_cast<PinOwner*>(b + hdr_->off_pins), hdr_->pin_active);
  policy_ = policy_by_id(hdr_->policy);  // checked by create and attach
  pstate_ = PolicyState{scores_, policy_->uses_ticks() ? ticks_ : nullptr, &hdr_->clock};
  stamp_hits_ = policy_->stamps_hits();
}

WriteLock::WriteLock(Cache* c, Mode mode) : c_(c) {
  c->check_open();
  auto repair = [c] { c->do_repair(); };
  bool repaired = false;
  if (mode == kTry) {
    owns_ = robust_mutex_try_lock(&c->hdr_->mutex, repair, &repaired);
  } else {
    repaired = robust_mutex_lock(&c->hdr_->mutex, repair);
    owns_ = true;
  }
  if (repaired) c->hdr_->stats.recoveries.fetch_add(1, std::memory_order_relaxed);
}

WriteLock::~WriteLock() {
  if (owns_) robust_mutex_unlock(&c_->hdr_->mutex);
}

// ---- readers --------------------------------------------------------------------------------

bool Cache::contains(uint64_t id) {
  check_open();
  check_id(id);
  return idx_get(id, std::memory_order_acquire) != 0;
}

bool Cache::pin(uint64_t id, Pinned* out) {
  uint32_t token = 0;
  for (int attempt = 0; attempt < kMaxReadAttempts; ++attempt) {
    if (attempt) stripe().read_retries.fetch_add(1, std::memory_order_relaxed);
    SlotAt at;
    Probe p = probe(id, &at);
    if (p == Probe::kMiss) break;
    if (p == Probe::kRetry) continue;
    // Record the pin, then check that the slot is still this value (seq_cst both: see pins.h).
    uint32_t code = slot_code(at.off);
    if (token) pins_.set(token, code); else token = pins_.claim(code, name_);
    if (idx_get(id, std::memory_order_seq_cst) != at.v || at.slot->seq.load(std::memory_order_seq_cst) != at.seq ||
        at.page->gen.load(std::memory_order_seq_cst) != at.gen)
      continue;
    users_.fetch_add(1, std::memory_order_relaxed);  // the view keeps the mapping (see close())
    stripe().hits.fetch_add(1, std::memory_order_relaxed);
    note_hit(id);
    *out = Pinned{slab_.value(at.off), at.len, token, at.seq, at.gen};
    return true;
  }
  if (token) pins_.release(token);
  stripe().misses.fetch_add(1, std::memory_order_relaxed);
  return false;
}

bool Cache::repin(uint64_t id, Pinned* p) {
  uint64_t off = static_cast<uint64_t>(p->data - data_) - sizeof(SlotHeader);
  uint32_t token = pins_.claim(slot_code(off), name_);
  const SlotHeader* s = slab_.slot(off);
  // seq_cst loads after the seq_cst entry store (pins.h): a writer either sees our pin or we see
  // its odd seq / new generation.
  if (s->seq.load(std::memory_order_seq_cst) != p->seq ||
      pages_[slab_.page_of(off)].gen.load(std::memory_order_seq_cst) != p->gen ||
      __atomic_load_n(&s->id, __ATOMIC_RELAXED) != id) {
    pins_.release(token);
    return false;
  }
  p->token = token;
  return true;
}

uint32_t Cache::stale_pin_for_tests(uint64_t id) {
  check_open();
  check_id(id);
  uint64_t v = idx_get(id, std::memory_order_acquire);
  return v ? pins_.claim(slot_code(v - 1), name_) : 0;
}

void Cache::unpin(uint32_t token, int64_t pinned_by) {
  if (pinned_by == ::getpid()) pins_.release(token);
  end_use();
}

void Cache::begin_use() {
  users_.fetch_add(1, std::memory_order_seq_cst);
  if (closed_.load(std::memory_order_seq_cst)) {
    end_use();
    throw Error(ErrorKind::kClosed, "cache '" + name_ + "' is closed");
  }
}

void Cache::end_use() {
  if (users_.fetch_sub(1, std::memory_order_seq_cst) == 1) {
    // The last user: decide under the same mutex as close() whether the mapping goes now.
    std::lock_guard<std::mutex> g(unmap_mu_);
    if (closed() && users_.load(std::memory_order_seq_cst) == 0) seg_.unmap();
  }
}

void Cache::close() {
  std::lock_guard<std::mutex> g(unmap_mu_);
  closed_.store(true, std::memory_order_seq_cst);
  if (users_.load(std::memory_order_seq_cst) == 0) seg_.unmap();
}

void Cache::cached_mask(uint8_t* out) {
  check_open();
  for (uint64_t i = 0; i < n_; ++i) out[i] = idx_get(i, std::memory_order_relaxed) != 0;
}

void Cache::scores_snapshot(float* out) {
  check_open();
  for (uint64_t i = 0; i < n_; ++i) out[i] = scores_[i].load(std::memory_order_relaxed);
}

CacheStats Cache::stats() {
  Use use(*this);
  const Stats& s = hdr_->stats;
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  CacheStats out{};
  for (const ReaderStats& rs : hdr_->reader_stats) {
    out.hits += r(rs.hits);
    out.misses += r(rs.misses);
    out.read_retries += r(rs.read_retries);
  }
  out.inserts = r(s.inserts);
  out.updates = r(s.updates);
  out.evictions = r(s.evictions);
  out.rejected = r(s.rejected);
  out.page_moves = r(s.page_moves);
  out.recoveries = r(s.recoveries);
  out.score_updates = r(s.score_updates);
  {
    // items/bytes_used are writer state; reading them under the lock gives a consistent pair.
    WriteLock lock(this);
    out.items = hdr_->items;
    out.bytes_used = hdr_->bytes_used;
    out.zombies = hdr_->zombies;
    uint64_t free_pages = 0;
    for (uint64_t p = 0; p < hdr_->num_pages; ++p) free_pages += pages_[p].cls == kFreePage;
    out.free_pages = free_pages;
  }
  out.pinned = pins_.count_live();
  out.capacity_bytes = hdr_->capacity_bytes;
  out.num_samples = n_;
  out.page_size = page_size_;
  out.num_pages = hdr_->num_pages;
  out.segment_bytes = hdr_->total_size;
  out.max_item_bytes = hdr_->max_item_bytes;
  out.creator_pid = hdr_->creator_pid;
  out.creator_start_time = hdr_->creator_start_time;
  out.policy = hdr_->policy;
  return out;
}

// ---- writers --------------------------------------------------------------------------------

PutItem Cache::make_item(uint64_t id, const char* data, uint64_t len) {
  check_open();
  check_id(id);
  int cls = slab_.class_for(len);
  if (cls < 0 || len > hdr_->max_item_bytes)
    throw Error(ErrorKind::kTooLarge, "value for sample id " + std::to_string(id) + " is " + std::to_string(len) +
                                          " bytes; cache '" + name_ + "' holds values of at most " +
                                          std::to_string(hdr_->max_item_bytes) +
                                          " bytes (create it with a larger max_item_bytes)");
  return PutItem{static_cast<uint32_t>(id), data, static_cast<uint32_t>(len), crc32c(data, len),
                 cls};
}

void Cache::put_many(std::vector<PutItem>& items, const float* scores, uint8_t* admitted) {
  Use use(*this);  // every call below may run without the GIL: close() must wait for it
  if (scores)
    for (size_t i = 0; i < items.size(); ++i) check_score(items[i].id, scores[i]);
  WriteLock lock(this);
  do_reclaim_zombies();
  for (size_t i = 0; i < items.size(); ++i) {
    if (scores) do_set_score(items[i].id, scores[i]);
    admitted[i] = do_put(items[i]);
  }
}

int Cache::try_put(const PutItem& it, const float* score) {
  if (score) check_score(it.id, *score);
  WriteLock lock(this, WriteLock::kTry);
  if (!lock.owns()) return -1;
  do_reclaim_zombies();
  if (score) do_set_score(it.id, *score);
  return do_put(it) ? 1 : 0;
}

bool Cache::put(const PutItem& it, const float* score) {
  Use use(*this);
  if (score) check_score(it.id, *score);
  WriteLock lock(this);
  do_reclaim_zombies();
  if (score) do_set_score(it.id, *score);
  return do_put(it);
}

bool Cache::remove(uint64_t id) {
  Use use(*this);
  check_id(id);
  WriteLock lock(this);
  do_reclaim_zombies();
  uint64_t v = idx_get(id, std::memory_order_relaxed);
  if (v == 0) return false;
  do_evict(static_cast<uint32_t>(id));
  slab_.do_release_if_empty(slab_.page_of(v - 1));
  return true;
}

void Cache::update_scores(const int64_t* ids, const float* scores, size_t n) {
  Use use(*this);
  // Validate the whole batch before changing anything: a bad id or score loses nothing.
  for (size_t i = 0; i < n; ++i) {
    check_id_signed(ids[i]);
    check_score(ids[i], scores[i]);
  }
  // Scattered ids over large arrays: every access is a cache miss. Issue them all at once before
  // taking the lock (memory-level parallelism), then run a few ids ahead for the heap nodes.
  for (size_t i = 0; i < n; ++i) {
    __builtin_prefetch(&scores_[ids[i]], 1);
    __builtin_prefetch(&heap_pos_[ids[i]], 0);
    __builtin_prefetch(&index_[ids[i]], 0);
  }
  constexpr size_t kAhead = 6;
  WriteLock lock(this);
  for (size_t i = 0; i < n && i < kAhead; ++i) heap_.prefetch(static_cast<uint32_t>(ids[i]));
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) heap_.prefetch(static_cast<uint32_t>(ids[i + kAhead]));
    if (i == n / 2) crash_point(CrashPoint::kScoresMid);
    do_set_score(static_cast<uint32_t>(ids[i]), scores[i]);
  }
  hdr_->stats.score_updates.fetch_add(n, std::memory_order_relaxed);
}

void Cache::do_set_score(uint32_t id, float score) {
  scores_[id].store(score, std::memory_order_relaxed);
  if (policy_->keyed_by_score() && heap_.contains(id)) do_rekey(id, score);
}

// Seqlock write of one slot: odd seq, fence, body, even seq with release (readers: see read()).
bool Cache::write_slot(SlotHeader* s, const PutItem& it, bool check_pins) {
  uint64_t seq = s->seq.load(std::memory_order_relaxed);
  s->seq.store(seq + 1, std::memory_order_relaxed);
  uint64_t off = reinterpret_cast<char*>(s) - data_;
  if (check_pins && do_slot_pinned(off)) {
    // A view holds the current bytes: leave them. The new seq (even, changed) only sends readers
    // that raced this round again.
    s->seq.store(seq + 2, std::memory_order_release);
    return false;
  }
  std::atomic_thread_fence(std::memory_order_release);
  s->id = it.id;
  s->len = it.len;
  s->crc = it.crc;
  size_t half = it.len / 2;
  std::memcpy(slab_.value(off), it.data, half);
  crash_point(CrashPoint::kPutMidWrite);
  std::memcpy(slab_.value(off) + half, it.data + half, it.len - half);
  s->seq.store(seq + 2, std::memory_order_release);
  return true;
}

bool Cache::do_put(const PutItem& it) {
  uint64_t cur = idx_get(it.id, std::memory_order_relaxed);
  if (cur) {
    uint64_t off = cur - 1;
    SlotHeader* s = slab_.slot(off);
    uint32_t old_len = s->len;
    if (pages_[slab_.page_of(off)].cls == static_cast<uint32_t>(it.cls) && write_slot(s, it, true)) {
      // Same size class, no view on it: rewritten in place; readers racing it retry on the seqlock.
      hdr_->bytes_used += static_cast<uint64_t>(it.len) - old_len;
      if (policy_->rekey_on_rewrite()) {
        double key = policy_->insert_key(pstate_, it.id);
        do_rekey(it.id, key);
        policy_->on_insert(pstate_, it.id, key);
      }
      hdr_->stats.updates.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    // Another class, or a view pins the old copy: the new value goes to a new slot below, and the
    // old copy is dropped only once that slot is won (a refused update keeps the old value).
  }
  double key = policy_->insert_key(pstate_, it.id);
  uint64_t u = do_alloc_slot(static_cast<uint32_t>(it.cls), key);
  if (u == 0) {
    hdr_->stats.rejected.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  uint64_t off = u - 1;
  crash_point(CrashPoint::kPutAfterAlloc);
  write_slot(slab_.slot(off), it);
  crash_point(CrashPoint::kPutAfterWrite);
  // The old copy (unless the allocation evicted it as a victim) goes now: freed, or a zombie while
  // a view pins it. A crash between this and the publish below loses the id (a miss), never bytes.
  if (uint64_t old = idx_get(it.id, std::memory_order_relaxed)) {
    do_evict(it.id);
    slab_.do_release_if_empty(slab_.page_of(old - 1));
    hdr_->stats.updates.fetch_add(1, std::memory_order_relaxed);
  }
  idx_set(it.id, off + 1, std::memory_order_release);  // publish
  crash_point(CrashPoint::kPutAfterPublish);
  policy_->on_insert(pstate_, it.id, key);
  heap_.push(it.id, key);
  do_add_key(slab_.page_of(off), 0, key);
  slab_.do_count_live(off, +1);
  ++hdr_->items;
  hdr_->bytes_used += it.len;
  hdr_->stats.inserts.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Finds a free slot of class `cls` for a value whose priority will be `key`, evicting if needed.
// Returns the slot offset + 1, or 0 when the policy refuses (static full, or importance admission
// fails because `key` does not beat the lowest cached priority).
uint64_t Cache::do_alloc_slot(uint32_t cls, double key) {
  // A full cache may refuse the value (importance: unless it beats the lowest cached key). A
  // cache is full when no page is free and its free slots are under 1/8 of the capacity: the few
  // slots a page move frees beyond the one it needed must not let low-key values in through the
  // side door (with a mix of sizes, nearly every admission would otherwise take such a slot).
  // Empty pages are free pages (Slab::do_release_if_empty), so they count as room.
  if (hdr_->free_page_head == 0 && !heap_.empty() && !policy_->admits(key, heap_.top().key) &&
      slab_.free_slot_bytes() < hdr_->capacity_bytes / 8)
    return 0;
  if (uint64_t u = slab_.do_take_slot(cls)) return u;
  if (!policy_->evicts()) return 0;
  // Values that views pin are set aside (they cannot be evicted now) and go back at the end,
  // whatever happens (an exception here would otherwise leave them out of the heap). A page's
  // key sum still counts them (aside_ tells do_add_key their keys while they are out).
  struct PutBack {
    IndexedHeap& heap;
    std::vector<HeapNode>& nodes;
    ~PutBack() {
      for (const HeapNode& n : nodes) heap.push(n.id, n.key);
      nodes.clear();
    }
  } put_back{heap_, aside_};
  bool reaped = false;
  uint64_t got = 0;
  while (!heap_.empty()) {
    HeapNode top = heap_.top();
    double now = policy_->current_key(pstate_, top.id, top.key);
    if (now != top.key) {  // readers moved it since (lru hit stamps): apply, look again
      do_rekey(top.id, now);
      continue;
    }
    if (!policy_->admits(key, top.key)) break;
    uint64_t voff = idx_get(top.id, std::memory_order_relaxed) - 1;
    if (pins_.any() && pins_.pinned(slot_code(voff))) {
      // A hint (the value is still published): views of dead processes are dropped once, then
      // a value still pinned is passed over. do_evict decides for real.
      if (!reaped) {
        reaped = true;
        do_reap_dead_pins();
        continue;
      }
      aside_.push_back(top);  // first: if it throws, the node is still in the heap
      heap_.remove(top.id);
      continue;
    }
    uint64_t vpage = slab_.page_of(voff);
    if (pages_[vpage].cls == cls) {
      bool freed = do_evict(top.id);
      hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
      if (freed) {
        got = slab_.do_pop_free_slot(cls);  // the slot just freed (the page stays: we fill it)
        break;
      }
      continue;  // a view pinned it at the last moment: it is a zombie now; take the next
    }
    // The lowest-priority value sits in another size class: memory must move to ours, a page at a
    // time. This is how memory follows the size mix (a cache full of 3 KB values can take 100 KB
    // ones). Move the page of another class whose values matter least on average (lowest mean
    // key), not merely the victim's page: that one holds a random sample of its class, and moving
    // it would evict values of every priority.
    uint64_t page = do_pick_page_to_move(cls, aside_);
    if (page == kNoPage) break;
    if (do_move_page(page, cls)) {
      got = slab_.do_pop_free_slot(cls);
      break;
    }
    // A view pins a value of that page: it now holds a zombie and is not picked again.
  }
  return got;
}

// Changes the eviction key of cached `id`, keeping its page's key_sum in step.
void Cache::do_rekey(uint32_t id, double key) {
  uint64_t off = idx_get(id, std::memory_order_relaxed) - 1;
  double old = heap_.key_of(id);
  heap_.update(id, key);
  do_add_key(slab_.page_of(off), old, key);
}

// key_sum of page p: minus `removed`, plus `added`; the heap already holds the new state. A
// running sum loses its small terms when a huge key passes through it (1e30 in, then out, leaves
// 0 for fifty keys of 1); then the page's sum is taken again from its live values (O(slots)).
void Cache::do_add_key(uint64_t p, double removed, double added) {
  PageMeta& pm = pages_[p];
  pm.key_sum = pm.key_sum - removed + added;
  if (!(std::fabs(removed) + std::fabs(added) > 1e9 * std::fabs(pm.key_sum))) return;
  const ClassMeta& cm = slab_.cls(pm.cls);
  double sum = 0;
  for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
    uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * cm.slot_size;
    const SlotHeader* s = slab_.slot(off);
    if (s->id >= n_ || s->zombie || idx_get(s->id, std::memory_order_relaxed) != off + 1) continue;
    if (heap_.contains(s->id)) {
      sum += heap_.key_of(s->id);
    } else {  // set aside by do_alloc_slot while a view pins it: still cached, still counted
      for (const HeapNode& a : aside_)
        if (a.id == s->id) sum += a.key;
    }
  }
  pm.key_sum = sum;
}

// The page, outside class `cls`, with the lowest mean key (an empty page first), among pages that
// hold no zombie, no pinned value and none of the values `aside` (taken out of the heap, pinned,
// by the caller: they must still be cached when it puts them back). O(pages): runs once per page move, i.e. at most once per
// slots-per-page allocations of the class.
uint64_t Cache::do_pick_page_to_move(uint32_t cls, const std::vector<HeapNode>& aside) {
  std::vector<uint8_t> blocked;
  if (pins_.any()) do_reap_dead_pins();  // pins of the dead must not block pages forever
  if (hdr_->zombies || pins_.any() || !aside.empty()) {
    blocked.assign(hdr_->num_pages, 0);
    for (const HeapNode& n : aside) blocked[slab_.page_of(idx_get(n.id, std::memory_order_relaxed) - 1)] = 1;
    for (uint64_t u = hdr_->zombie_head; u; u = slab_.slot((u - 1) * kAlign)->next_free)
      blocked[slab_.page_of((u - 1) * kAlign)] = 1;
    std::vector<uint32_t> codes;
    pins_.snapshot(&codes);
    for (uint32_t c : codes)
      if ((c - 1) * kAlign < data_bytes_) blocked[slab_.page_of(uint64_t{c - 1} * kAlign)] = 1;
  }
  uint64_t best = kNoPage;
  double best_mean = 0;
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.cls == cls || pm.cls >= slab_.num_classes() || (!blocked.empty() && blocked[p])) continue;
    double mean = pm.live ? pm.key_sum / pm.live : -std::numeric_limits<double>::infinity();
    if (best == kNoPage || mean < best_mean) {
      best = p;
      best_mean = mean;
    }
  }
  return best;
}

bool Cache::do_evict(uint32_t id) {
  uint64_t off = idx_get(id, std::memory_order_relaxed) - 1;
  SlotHeader* s = slab_.slot(off);
  idx_set(id, 0, std::memory_order_release);  // new readers miss from here on
  crash_point(CrashPoint::kEvictAfterUnpublish);
  PageMeta& pm = pages_[slab_.page_of(off)];
  bool freed = !do_slot_pinned(off);
  if (freed) {
    uint64_t seq = s->seq.load(std::memory_order_relaxed);
    s->seq.store(seq + 1, std::memory_order_relaxed);  // readers mid-copy see the change and retry
    std::atomic_thread_fence(std::memory_order_release);
    s->id = kNoId;
    s->seq.store(seq + 2, std::memory_order_release);
    slab_.do_push_free_slot(pm.cls, off);
  } else {
    do_push_zombie(off);  // bytes untouched: a view reads them
  }
  crash_point(CrashPoint::kEvictAfterFree);
  if (heap_.contains(id)) {
    double key = heap_.key_of(id);
    heap_.remove(id);
    do_add_key(slab_.page_of(off), key, 0);
  }
  slab_.do_count_live(off, -1);
  if (pm.live == 0) pm.key_sum = 0;  // drop the rounding residue of the additions
  --hdr_->items;
  hdr_->bytes_used -= s->len;
  return freed;
}

bool Cache::do_move_page(uint64_t p, uint32_t cls) {
  PageMeta& pm = pages_[p];
  uint32_t old = pm.cls;
  const ClassMeta& ocm = slab_.cls(old);
  uint64_t base = p * page_size_;
  // Pass 1: evict every value on the page onto its class's free list. A value a view pins turns
  // into a zombie instead, and a page holding a zombie cannot move.
  bool blocked = false;
  for (uint32_t i = 0; i < ocm.slots_per_page; ++i) {
    SlotHeader* s = slab_.slot(base + static_cast<uint64_t>(i) * ocm.slot_size);
    if (s->zombie) {
      blocked = true;
    } else if (s->id != kNoId) {
      blocked |= !do_evict(s->id);
      hdr_->stats.evictions.fetch_add(1, std::memory_order_relaxed);
    }
    if (i == ocm.slots_per_page / 2) crash_point(CrashPoint::kMovePageMid);
  }
  if (blocked) return false;
  // Pass 2: every slot is free and unpublished (no view can pin it any more): take them off the
  // free list and recut the page.
  for (uint32_t i = 0; i < ocm.slots_per_page; ++i)
    slab_.do_unlink_free_slot(old, base + static_cast<uint64_t>(i) * ocm.slot_size);
  --slab_.cls(old).pages;
  slab_.do_cut_page(p, cls);
  hdr_->stats.page_moves.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// ---- pins and zombies -------------------------------------------------------------------------

bool Cache::do_slot_pinned(uint64_t off) {
  // Orders the caller's unpublish / odd seq before the pin table loads (see pins.h).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return pins_.any() && pins_.pinned(slot_code(off));
}

void Cache::do_push_zombie(uint64_t off) {
  SlotHeader* s = slab_.slot(off);
  s->zombie = 1;
  s->next_free = static_cast<uint32_t>(hdr_->zombie_head);
  hdr_->zombie_head = slot_code(off);
  ++hdr_->zombies;
  slab_.do_count_zombie(off, +1);
}

void Cache::do_reclaim_zombies() {
  if (hdr_->zombies == 0) return;
  std::vector<uint32_t> codes;
  pins_.snapshot(&codes);
  bool still_pinned = false;
  // prev: the zombie before `u` that stays listed (nullptr: `u` is the head).
  uint64_t u = hdr_->zombie_head;
  SlotHeader* prev = nullptr;
  while (u) {
    uint64_t off = (u - 1) * kAlign;
    SlotHeader* s = slab_.slot(off);
    uint64_t next = s->next_free;
    if (std::binary_search(codes.begin(), codes.end(), static_cast<uint32_t>(u))) {
      still_pinned = true;
      prev = s;
    } else {
      // Unreachable (unpublished) and no view left: free it. A crash between the unlink and the
      // push leaves it on neither list; repair rebuilds both from the slot headers.
      if (prev) prev->next_free = static_cast<uint32_t>(next); else hdr_->zombie_head = next;
      --hdr_->zombies;
      uint64_t seq = s->seq.load(std::memory_order_relaxed);
      s->seq.store(seq + 1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
      s->id = kNoId;
      s->zombie = 0;
      s->seq.store(seq + 2, std::memory_order_release);
      slab_.do_push_free_slot(pages_[slab_.page_of(off)].cls, off);
      slab_.do_count_zombie(off, -1);
      slab_.do_release_if_empty(slab_.page_of(off));
    }
    u = next;
  }
  if (still_pinned) do_reap_dead_pins();  // the next call frees what dead processes pinned
}

void Cache::do_reap_dead_pins() {
  // Each check reads /proc for every record in use: throttled, as pins of the dead only cost memory.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  if (last_reap_ns_ && now - last_reap_ns_ < 100000000ull) return;
  last_reap_ns_ = now;
  pins_.reap_dead();
}

// ---- repair -----------------------------------------------------------------------------------

// Runs when a writer died holding the mutex. The ground truth is the index plus the slot headers
// (each changed by single aligned stores in an order that keeps them meaningful): a slot is live
// iff its seq is even, it names an id, and index[id] points at it. Everything else (free lists,
// page and class counts, the heap, items, bytes_used) is derived again from that truth. Idempotent:
// a repairer killed half way leaves EOWNERDEAD for the next locker, which starts over.
void Cache::do_repair() {
  // The dead writer may have unpublished a slot without reaching its own fence before the pin
  // check (pins.h): this one orders its stores before the table loads below.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  pins_.reap_dead();
  std::vector<uint32_t> pinned;  // one snapshot: scanning the table per slot would be O(slots x pins)
  pins_.snapshot(&pinned);
  hdr_->zombie_head = 0;
  hdr_->zombies = 0;
  heap_.clear();
  std::memset(heap_pos_, 0, n_ * sizeof(uint32_t));
  uint64_t page_count = hdr_->num_pages;
  // Pages: classes keep their pages; a page caught mid-move becomes free (none of its slots can be
  // live: the mover unpublished them all before cutting it).
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    ClassMeta& cm = slab_.cls(c);
    cm.free_head = cm.free_slots = cm.pages = cm.items = 0;
  }
  hdr_->free_page_head = 0;
  hdr_->items = 0;
  hdr_->bytes_used = 0;
  for (uint64_t p = page_count; p-- > 0;) {
    PageMeta& pm = pages_[p];
    uint64_t g = pm.gen.load(std::memory_order_relaxed);
    if (g & 1) {
      pm.gen.store(g + 1, std::memory_order_release);
      pm.cls = kFreePage;
    }
    if (pm.cls >= slab_.num_classes()) {
      slab_.do_push_free_page(p);
      continue;
    }
    ClassMeta& cm = slab_.cls(pm.cls);
    ++cm.pages;
    pm.live = 0;
    pm.zombies = 0;
    pm.key_sum = 0;
    for (uint32_t i = cm.slots_per_page; i-- > 0;) {
      uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * cm.slot_size;
      SlotHeader* s = slab_.slot(off);
      uint64_t seq = s->seq.load(std::memory_order_relaxed);
      bool live = !(seq & 1) && s->id < n_ && idx_get(s->id, std::memory_order_relaxed) == off + 1 &&
                  s->len <= cm.slot_size - sizeof(SlotHeader);
      if (live) {
        s->zombie = 0;
        double key = policy_->repair_key(pstate_, s->id);
        heap_.append(s->id, key);
        pm.key_sum += key;
        slab_.do_count_live(off, +1);
        ++hdr_->items;
        hdr_->bytes_used += s->len;
      } else {
        // Not live. Its id goes first, while a torn slot's seq is still odd: the index may still
        // name it (cleared below, after every page), and a reader must never find an even seq
        // with a matching id on bytes that a dead writer left half written.
        __atomic_store_n(&s->id, kNoId, __ATOMIC_RELAXED);
        std::atomic_thread_fence(std::memory_order_release);
        if (seq & 1) s->seq.store(seq + 1, std::memory_order_release);
        if (std::binary_search(pinned.begin(), pinned.end(), slot_code(off))) {
          // A view may be reading it: keep the bytes, as a zombie. (A torn slot is never under a
          // view that was handed out: a writer checks the pins after making seq odd and before
          // writing. Its entry is a reader's that is backing out.)
          do_push_zombie(off);
        } else {
          s->zombie = 0;
          slab_.do_push_free_slot(pm.cls, off);
        }
      }
    }
    slab_.do_release_if_empty(p);  // a page left empty (a dead writer's fresh page) is free
  }
  // Index entries that do not name a live slot (a put that died before its slot was stable, an
  // eviction that died after unpublishing) are cleared.
  for (uint64_t id = 0; id < n_; ++id) {
    uint64_t v = idx_get(id, std::memory_order_relaxed);
    if (v && heap_pos_[id] == 0) idx_set(id, 0, std::memory_order_release);
  }
  heap_.heapify();
}

// ---- check --------------------------------------------------------------------------------------

void Cache::check() {
  Use use(*this);
  std::string fault;
  {
    WriteLock lock(this);
    fault = do_check();
  }
  if (!fault.empty()) throw Error(ErrorKind::kCorruption, "cache '" + name_ + "': " + fault);
}

std::string Cache::do_check() {
  std::string f = heap_.check(n_);
  if (!f.empty()) return f;
  f = slab_.check_free_lists();
  if (!f.empty()) return f;
  uint64_t items = 0, bytes = 0, free_pages = 0, zombies = 0;
  std::vector<uint64_t> class_pages(slab_.num_classes()), class_items(slab_.num_classes()),
      class_zombies(slab_.num_classes());
  for (uint64_t p = 0; p < hdr_->num_pages; ++p) {
    const PageMeta& pm = pages_[p];
    if (pm.gen.load(std::memory_order_relaxed) & 1) return "page " + std::to_string(p) + " is stuck mid-move";
    if (pm.cls == kFreePage) {
      ++free_pages;
      continue;
    }
    if (pm.cls >= slab_.num_classes()) return "page " + std::to_string(p) + " has invalid class " + std::to_string(pm.cls);
    const ClassMeta& cm = slab_.cls(pm.cls);
    ++class_pages[pm.cls];
    uint32_t live = 0, page_zombies = 0;
    double key_sum = 0;
    for (uint32_t i = 0; i < cm.slots_per_page; ++i) {
      uint64_t off = p * page_size_ + static_cast<uint64_t>(i) * cm.slot_size;
      const SlotHeader* s = slab_.slot(off);
      if (s->zombie) {  // kept for a view; its bytes are the view's business
        ++class_zombies[pm.cls];
        ++zombies;
        ++page_zombies;
        continue;
      }
      if (s->id == kNoId) continue;
      std::string where = "slot at offset " + std::to_string(off) + " (id " + std::to_string(s->id) + ")";
      if (s->id >= n_) return where + " names an id out of range";
      if (s->seq.load(std::memory_order_relaxed) & 1) return where + " is stuck mid-write";
      if (idx_get(s->id, std::memory_order_relaxed) != off + 1) return where + " is not the one the index names";
      if (s->len > cm.slot_size - sizeof(SlotHeader)) return where + " claims a length larger than its slot";
      if (crc32c(slab_.value(off), s->len) != s->crc) return where + " fails its checksum";
      if (!heap_.contains(s->id)) return where + " is not in the eviction heap";
      double key = heap_.key_of(s->id);
      std::string bad = policy_->check_key(pstate_, s->id, key);
      if (!bad.empty()) return where + " " + bad;
      ++live;
      key_sum += key;
      bytes += s->len;
    }
    if (live != pm.live) return "page " + std::to_string(p) + " counts " + std::to_string(pm.live) + " live slots, holds " + std::to_string(live);
    if (page_zombies != pm.zombies)
      return "page " + std::to_string(p) + " counts " + std::to_string(pm.zombies) + " zombies, holds " + std::to_string(page_zombies);
    if (live == 0 && page_zombies == 0)
      return "page " + std::to_string(p) + " of class " + std::to_string(pm.cls) + " holds nothing but is not on the free page list";
    if (std::fabs(key_sum - pm.key_sum) > 1e-6 * (std::fabs(key_sum) + live + 1))
      return "page " + std::to_string(p) + " key sum " + std::to_string(pm.key_sum) + " but its values' keys add to " +
             std::to_string(key_sum);
    class_items[pm.cls] += live;
    items += live;
  }
  for (uint32_t c = 0; c < slab_.num_classes(); ++c) {
    const ClassMeta& cm = slab_.cls(c);
    if (cm.pages != class_pages[c] || cm.items != class_items[c])
      return "class " + std::to_string(c) + " counts disagree with its pages";
    if (cm.items + cm.free_slots + class_zombies[c] != cm.pages * cm.slots_per_page)
      return "class " + std::to_string(c) + ": items + free slots + zombies != slots in its pages";
  }
  uint64_t listed = 0;
  for (uint64_t u = hdr_->free_page_head; u && listed <= hdr_->num_pages; u = pages_[u - 1].next_free_page) {
    if (u > hdr_->num_pages || pages_[u - 1].cls != kFreePage) return "free page list names a page in use";
    ++listed;
  }
  uint64_t listed_zombies = 0;
  for (uint64_t u = hdr_->zombie_head; u && listed_zombies <= zombies; u = slab_.slot((u - 1) * kAlign)->next_free) {
    if ((u - 1) * kAlign >= data_bytes_ || !slab_.is_slot_start((u - 1) * kAlign) || !slab_.slot((u - 1) * kAlign)->zombie)
      return "zombie list names slot " + std::to_string(u) + ", which is not a zombie";
    ++listed_zombies;
  }
  if (listed_zombies != zombies || zombies != hdr_->zombies)
    return "zombie list holds " + std::to_string(listed_zombies) + " slots, header counts " +
           std::to_string(hdr_->zombies) + ", pages hold " + std::to_string(zombies);
  if (listed != free_pages) return "free page list holds " + std::to_string(listed) + " pages, " + std::to_string(free_pages) + " are free";
  if (items != hdr_->items || items != heap_.size())
    return "items: header " + std::to_string(hdr_->items) + ", heap " + std::to_string(heap_.size()) + ", slots " + std::to_string(items);
  if (bytes != hdr_->bytes_used) return "bytes_used says " + std::to_string(hdr_->bytes_used) + ", slots hold " + std::to_string(bytes);
  uint64_t indexed = 0;
  for (uint64_t id = 0; id < n_; ++id) indexed += idx_get(id, std::memory_order_relaxed) != 0;
  if (indexed != items) return std::to_string(indexed) + " index entries for " + std::to_string(items) + " live slots";
  return "";
}

}  // namespace shadecache
