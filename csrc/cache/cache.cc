#include "cache/cache.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <thread>

#include "cache/robust_mutex.h"
#include "common/crc32c.h"

namespace shadecache {

std::atomic<uint64_t> g_fork_generation{0};

namespace {
struct ForkWatch {
  ForkWatch() {
    pthread_atfork(nullptr, nullptr, [] { g_fork_generation.fetch_add(1, std::memory_order_relaxed); });
  }
} g_fork_watch;
}  // namespace

uint64_t unix_now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

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
  h->capacity_bytes = opts.capacity_bytes;
  h->page_size = l.page_size;
  h->chunk_size = l.chunk_size;
  h->unit_shift = l.unit_shift;
  h->max_item_bytes = opts.item_limit ? std::min(opts.item_limit, l.max_value) : l.max_value;
  h->num_pages = l.num_pages;
  h->data_bytes = l.num_pages * l.page_size;
  h->persist = opts.persist ? 1 : 0;
  std::snprintf(h->fingerprint, sizeof h->fingerprint, "%s", opts.fingerprint.c_str());
  h->total_size = l.total;
  h->fixed_bytes = l.fixed;
  h->off_index = l.off_index;
  h->off_heap_pos = l.off_heap_pos;
  h->off_scores = l.off_scores;
  h->off_ticks = l.off_ticks;
  h->off_heap_table = l.off_heap_table;
  h->heap_table_len = l.heap_table_len;
  h->off_pages = l.off_pages;
  h->off_chunk_owner = l.off_chunk_owner;
  h->off_classes = l.off_classes;
  h->off_pins = l.off_pins;
  h->off_data = l.off_data;
  h->creator_pid = creator.pid;
  h->creator_start_time = creator.start_time;
  h->created_unix_ns = unix_now_ns();
  h->last_attach_unix_ns.store(h->created_unix_ns, std::memory_order_relaxed);
  std::snprintf(h->name, sizeof h->name, "%s", name.c_str());
  robust_mutex_init(&h->mutex);
  h->num_classes = Slab::init_classes(reinterpret_cast<ClassMeta*>(seg.base() + l.off_classes), l.page_size, l.classes);
  std::unique_ptr<Cache> c(new Cache());
  c->bind(std::move(seg), name);
  c->slab_.init();
  // Publish: an attacher that sees the magic (acquire) sees every field above.
  h->magic.store(kMagic, std::memory_order_release);
  return c;
}

std::unique_ptr<Cache> Cache::attach(const std::string& name, bool touch) {
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
  if (h->page_size < kMinPageSize || (h->page_size & (h->page_size - 1)) ||
      h->chunk_size != h->page_size / kChunksPerPage || h->unit_shift < kMinUnitShift || h->unit_shift > 16)
    throw Error(ErrorKind::kLayout, "cache '" + name + "' has a page size of " + std::to_string(h->page_size) +
                                        " bytes, not a power of two (or chunks and units that do not match it): "
                                        "the header is corrupt");
  if (!policy_by_id(h->policy))
    throw Error(ErrorKind::kLayout, "cache '" + name + "' names policy number " + std::to_string(h->policy) +
                                        ", which this shadecache does not know");
  if (h->total_size != seg.size())
    throw Error(ErrorKind::kLayout, "cache '" + name + "' is " + std::to_string(seg.size()) + " bytes but its header says " +
                                        std::to_string(h->total_size));
  std::unique_ptr<Cache> c(new Cache());
  c->bind(std::move(seg), name);
  if (touch) h->last_attach_unix_ns.store(unix_now_ns(), std::memory_order_relaxed);  // a hint for ls/gc
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
  heap_table_ = reinterpret_cast<uint32_t*>(b + hdr_->off_heap_table);
  pages_ = reinterpret_cast<PageMeta*>(b + hdr_->off_pages);
  data_ = b + hdr_->off_data;
  page_size_ = hdr_->page_size;
  page_shift_ = static_cast<uint32_t>(__builtin_ctzll(page_size_));  // a power of two (checked on attach)
  chunk_shift_ = static_cast<uint32_t>(__builtin_ctzll(hdr_->chunk_size));
  unit_shift_ = hdr_->unit_shift;
  data_bytes_ = hdr_->num_pages * page_size_;
  num_chunks_ = hdr_->num_pages * kChunksPerPage;
  max_len_ = hdr_->max_item_bytes;
  slab_ = Slab(data_, pages_, reinterpret_cast<ClassMeta*>(b + hdr_->off_classes),
               reinterpret_cast<uint32_t*>(b + hdr_->off_chunk_owner), &hdr_->free_page_head, &hdr_->free_pages,
               &hdr_->class_gen, hdr_->num_pages, page_size_, hdr_->chunk_size, unit_shift_, hdr_->num_classes);
  heap_ = IndexedHeap(data_, heap_table_, heap_pos_, &hdr_->heap_size, page_size_);
  pins_.bind(reinterpret_cast<PinOwner*>(b + hdr_->off_pins), hdr_->pin_active);
  policy_ = policy_by_id(hdr_->policy);  // checked by create and attach
  pstate_ = PolicyState{scores_, policy_->uses_ticks() ? ticks_ : nullptr, &hdr_->clock, &hdr_->policy_weight};
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

bool Cache::pin(uint64_t id, Pinned* out, int64_t self) {
  uint32_t token = 0;
  for (int attempt = 0; attempt < kMaxReadAttempts; ++attempt) {
    if (attempt) stripe().read_retries.fetch_add(1, std::memory_order_relaxed);
    SlotAt at;
    Probe p = probe(id, &at);
    if (p == Probe::kMiss) break;
    if (p == Probe::kRetry) continue;
    if (at.len >> chunk_shift_) {  // in chunks: not contiguous, so the view is a copy
      if (token) pins_.release(token);
      return pin_copy(id, out);
    }
    // Record the pin, then check that the slot is still this value (seq_cst both: see pins.h).
    uint32_t code = slot_code(at.off);
    if (token) pins_.set(token, code); else token = pins_.claim(code, name_, self);
    if (!still_at(id, at)) continue;
    users_.fetch_add(1, std::memory_order_relaxed);  // the view keeps the mapping (see close())
    stripe().hits.fetch_add(1, std::memory_order_relaxed);
    note_hit(id);
    // The slot is pinned and its seq checked: its bytes and length hold still until unpin; the
    // crc is the one probe() read before the check (a zombie's header reuses that word).
    *out = Pinned{slab_.value(at.off), at.len, token, at.seq, at.gen, at.crc};
    return true;
  }
  if (token) pins_.release(token);
  stripe().misses.fetch_add(1, std::memory_order_relaxed);
  return false;
}

bool Cache::peek_length(uint64_t id, uint32_t* len) const {
  SlotAt at;
  for (int attempt = 0; attempt < kMaxReadAttempts; ++attempt) {
    Probe p = probe(id, &at);
    if (p == Probe::kMiss) return false;
    if (p == Probe::kFound) {
      *len = at.len;
      return true;
    }
  }
  return false;
}

bool Cache::pin_again(uint64_t id, Pinned* out, int64_t self) {
  try {
    return pin(id, out, self);
  } catch (const Error&) {  // no entry left for it (other threads' pins): a miss, not a lost batch
    return false;
  }
}

size_t Cache::pin_many(const uint64_t* ids, size_t n, Pinned* out, bool* found, int64_t self) {
  if (!self) self = ::getpid();
  // 1. Where each value lies now. A value in chunks gets its copy (pin_copy), a miss nothing.
  std::vector<SlotAt> at;
  std::vector<uint32_t> codes, tokens;
  std::vector<size_t> which;  // codes[j] is the slot of ids[which[j]]
  at.reserve(n);
  codes.reserve(n);
  which.reserve(n);
  uint64_t misses = 0, retries = 0, copies = 0;
  for (size_t k = 0; k < n; ++k) {
    found[k] = false;
    SlotAt a;
    Probe p = Probe::kRetry;
    for (int attempt = 0; attempt < kMaxReadAttempts && p == Probe::kRetry; ++attempt) {
      retries += attempt > 0;
      p = probe(ids[k], &a);
    }
    if (p == Probe::kRetry) {  // a writer kept moving it: the single path retries on its own
      found[k] = pin_again(ids[k], &out[k], self);
      copies += found[k];
      continue;
    }
    if (p == Probe::kMiss) {
      ++misses;
      continue;
    }
    if (a.len >> chunk_shift_) {  // in chunks: a copy (counted by pin_copy)
      found[k] = pin_copy(ids[k], &out[k]);
      copies += found[k];
      continue;
    }
    at.push_back(a);
    codes.push_back(slot_code(a.off));
    which.push_back(k);
  }
  // 2. Their entries, in one pass (seq_cst stores: see pins.h), then 3. each slot checked after
  // its entry, as pin() checks it; one that changed meanwhile goes through pin() again.
  tokens.resize(codes.size());
  try {
    pins_.claim_many(codes.data(), codes.size(), tokens.data(), name_, self);
  } catch (const Error&) {
    // kCapacity: claim_many took back its own entries; the copies and single pins of step 1 go
    // too, so that the batch holds nothing (each is a view: unpin ends its use of the mapping).
    for (size_t k = 0; k < n; ++k) {
      if (found[k]) unpin(out[k].token, self, self);
      found[k] = false;
    }
    throw;
  }
  uint64_t hits = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    size_t k = which[j];
    const SlotAt& a = at[j];
    if (!still_at(ids[k], a)) {
      pins_.release(tokens[j]);
      found[k] = pin_again(ids[k], &out[k], self);  // counts itself
      copies += found[k];
      continue;
    }
    note_hit(ids[k]);
    out[k] = Pinned{slab_.value(a.off), a.len, tokens[j], a.seq, a.gen, a.crc};
    found[k] = true;
    ++hits;
  }
  if (hits) users_.fetch_add(hits, std::memory_order_relaxed);  // the views keep the mapping, as pin's
  count_reads(hits, misses, retries);
  return hits + copies;
}

void Cache::unpin_many(const uint32_t* tokens, size_t n, int64_t pinned_by, int64_t self) {
  if (!n) return;
  if (pinned_by == (self ? self : ::getpid())) {
    bool copies = false;
    for (size_t k = 0; k < n; ++k) {
      if (tokens[k] & kCopyToken) copies = true; else pins_.release(tokens[k]);
    }
    if (copies) {  // one lock for the message's copies (every value of 100 KB is one)
      std::lock_guard<std::mutex> g(copies_mu_);
      for (size_t k = 0; k < n; ++k)
        if (tokens[k] & kCopyToken) copies_.erase(tokens[k]);
    }
  }
  end_use(n);
}

bool Cache::pin_copy(uint64_t id, Pinned* out) {
  std::unique_ptr<char[]> buf;
  uint64_t cap = 0, retries = 0;
  uint32_t crc = 0;
  int64_t len = -1;
  for (int attempt = 0; attempt < kMaxReadAttempts && len < 0; ++attempt) {
    if (attempt) ++retries;
    SlotAt at;
    Probe p = probe(id, &at);
    if (p == Probe::kMiss) break;
    if (p == Probe::kRetry) continue;
    if (at.len > cap || !buf) {
      buf.reset(new char[std::max<uint64_t>(at.len, 1)]);
      cap = at.len;
    }
    crc = at.crc;
    if (!copy_value(at, buf.get())) continue;
    std::atomic_thread_fence(std::memory_order_acquire);  // as in read_uncounted
    if (at.slot->seq.load(std::memory_order_relaxed) != at.seq || at.page->gen.load(std::memory_order_relaxed) != at.gen)
      continue;
    len = at.len;
  }
  count_reads(len >= 0, len < 0, retries);
  if (len < 0) return false;
  note_hit(id);
  const char* data = buf.get();
  uint32_t token;
  {
    std::lock_guard<std::mutex> g(copies_mu_);
    do next_copy_ = (next_copy_ + 1) & ~kCopyToken;
    while (next_copy_ == 0 || copies_.count(kCopyToken | next_copy_));
    token = kCopyToken | next_copy_;
    copies_[token] = std::move(buf);
  }
  users_.fetch_add(1, std::memory_order_relaxed);  // as a pin: unpin ends it
  *out = Pinned{data, static_cast<uint32_t>(len), token, 0, kCopyGen, crc};
  return true;
}

bool Cache::repin(uint64_t id, Pinned* p) {
  if (p->gen == kCopyGen) {
    // The copy is this child's own memory since the fork; it still sits under the parent's token.
    std::lock_guard<std::mutex> g(copies_mu_);
    for (const auto& [token, buf] : copies_)
      if (buf.get() == p->data) {
        p->token = token;
        return true;
      }
    return false;
  }
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

void Cache::unpin(uint32_t token, int64_t pinned_by, int64_t self) { unpin_many(&token, 1, pinned_by, self); }

void Cache::begin_use() {
  users_.fetch_add(1, std::memory_order_seq_cst);
  if (closed_.load(std::memory_order_seq_cst)) {
    end_use();
    throw Error(ErrorKind::kClosed, "cache '" + name_ + "' is closed");
  }
}

void Cache::end_use(uint64_t uses) {
  if (users_.fetch_sub(uses, std::memory_order_seq_cst) == uses) {
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
  out.relocations = r(s.relocations);
  out.recoveries = r(s.recoveries);
  out.score_updates = r(s.score_updates);
  {
    // items/bytes_used are writer state; reading them under the lock gives a consistent pair.
    WriteLock lock(this);
    out.items = hdr_->items;
    out.bytes_used = hdr_->bytes_used;
    out.zombies = hdr_->zombies;
    out.free_pages = hdr_->free_pages;
    out.heap_pages = hdr_->heap_pages;
  }
  out.pinned = pins_.count_live();
  out.capacity_bytes = hdr_->capacity_bytes;
  out.data_bytes = hdr_->data_bytes;
  out.num_samples = n_;
  out.page_size = page_size_;
  out.chunk_size = hdr_->chunk_size;
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
  if (len > hdr_->capacity_bytes)
    throw Error(ErrorKind::kTooLarge, "value for sample id " + std::to_string(id) + " is " + std::to_string(len) +
                                          " bytes, more than the capacity of cache '" + name_ + "' (" +
                                          std::to_string(hdr_->capacity_bytes) + " bytes)");
  if (len > hdr_->max_item_bytes)
    throw Error(ErrorKind::kTooLarge, "value for sample id " + std::to_string(id) + " is " + std::to_string(len) +
                                          " bytes; cache '" + name_ + "' holds values of at most " +
                                          std::to_string(hdr_->max_item_bytes) +
                                          " bytes (its max_item_bytes, or what its memory holds)");
  return PutItem{static_cast<uint32_t>(id), data, static_cast<uint32_t>(len), crc32c(data, len)};
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
  do_heap_trim();
}

int Cache::try_put(const PutItem& it, const float* score) {
  if (score) check_score(it.id, *score);
  WriteLock lock(this, WriteLock::kTry);
  if (!lock.owns()) return -1;
  do_reclaim_zombies();
  if (score) do_set_score(it.id, *score);
  bool in = do_put(it);
  do_heap_trim();
  return in ? 1 : 0;
}

bool Cache::put(const PutItem& it, const float* score) {
  Use use(*this);
  if (score) check_score(it.id, *score);
  WriteLock lock(this);
  do_reclaim_zombies();
  if (score) do_set_score(it.id, *score);
  bool in = do_put(it);
  do_heap_trim();
  return in;
}

bool Cache::remove(uint64_t id) {
  Use use(*this);
  check_id(id);
  WriteLock lock(this);
  do_reclaim_zombies();
  if (idx_get(id, std::memory_order_relaxed) == 0) return false;
  do_evict(static_cast<uint32_t>(id));
  do_heap_trim();
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
  if (policy_->keyed_by_score() && heap_.contains(id)) do_rekey(id, policy_->insert_key(pstate_, id));
}

// Seqlock write of a value: odd seq, fence, chunk numbers, header, chunks and tail, even seq with
// release (readers: see read_uncounted). A value in chunks is written under its head's odd seq
// too, so that a rewrite in place never shows a reader a mix of old and new chunks.
bool Cache::write_value(uint64_t off, const PutItem& it, const uint32_t* chunks, bool check_pins) {
  SlotHeader* s = slab_.slot(off);
  uint32_t seq = s->seq.load(std::memory_order_relaxed);
  s->seq.store(seq + 1, std::memory_order_relaxed);
  if (check_pins && do_slot_pinned(off)) {
    // A view holds the current bytes: leave them. The new seq (even, changed) only sends readers
    // that raced this round again.
    s->seq.store(seq + 2, std::memory_order_release);
    return false;
  }
  std::atomic_thread_fence(std::memory_order_release);
  const uint64_t k = it.len >> chunk_shift_, chunk = uint64_t{1} << chunk_shift_;
  uint32_t* refs = slab_.refs(off);
  if (chunks)
    for (uint64_t i = 0; i < k; ++i) __atomic_store_n(&refs[i], chunks[i], __ATOMIC_RELAXED);
  s->id = it.id;
  s->len = it.len;
  s->crc = it.crc;
  for (uint64_t i = 0; i < k; ++i) {
    std::memcpy(slab_.at(static_cast<uint64_t>(refs[i]) << chunk_shift_), it.data + (i << chunk_shift_), chunk);
    if (i == k / 2) crash_point(CrashPoint::kPutMidWrite);
  }
  char* tail = slab_.value(off) + 4 * k;
  uint64_t tail_len = it.len & (chunk - 1), half = k ? 0 : tail_len / 2;
  std::memcpy(tail, it.data + (k << chunk_shift_), half);
  if (!k) crash_point(CrashPoint::kPutMidWrite);
  std::memcpy(tail + half, it.data + (k << chunk_shift_) + half, tail_len - half);
  s->seq.store(seq + 2, std::memory_order_release);
  return true;
}

bool Cache::do_put(const PutItem& it) {
  const uint64_t k = it.len >> chunk_shift_;
  const uint32_t cls = slab_.do_class_for(slab_.head_need(it.len));
  if (uint64_t cur = idx_get(it.id, std::memory_order_relaxed)) {
    uint64_t off = cur - 1;
    uint32_t old_len = slab_.slot(off)->len;
    // Same head class and as many chunks: rewritten in place (readers racing it retry on the
    // seqlock) unless a view pins it (values in chunks are never pinned: their views are copies).
    if (pages_[slab_.page_of(off)].cls == cls && (old_len >> chunk_shift_) == k && write_value(off, it, nullptr, k == 0)) {
      hdr_->bytes_used = hdr_->bytes_used - old_len + it.len;
      if (policy_->rekey_on_rewrite()) {
        double key = policy_->insert_key(pstate_, it.id);
        do_rekey(it.id, key);
        policy_->on_insert(pstate_, it.id, key);
      }
      hdr_->stats.updates.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    // Another shape, or a view pins the old copy: the new value goes to a new slot below, and the
    // old copy is dropped only once that slot is won (a refused update keeps the old value).
  }
  double key = policy_->insert_key(pstate_, it.id);
  uint64_t off;
  if (!do_alloc(cls, k, it.id, key, &off, &chunk_buf_)) {
    hdr_->stats.rejected.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  crash_point(CrashPoint::kPutAfterAlloc);
  write_value(off, it, chunk_buf_.data());
  crash_point(CrashPoint::kPutAfterWrite);
  // The old copy (unless the allocation evicted it as a victim) goes now: freed, or a zombie while
  // a view pins it. A crash between this and the publish below loses the id (a miss), never bytes.
  if (idx_get(it.id, std::memory_order_relaxed)) {
    do_evict(it.id);
    hdr_->stats.updates.fetch_add(1, std::memory_order_relaxed);
  }
  idx_set(it.id, off + 1, std::memory_order_release);  // publish
  crash_point(CrashPoint::kPutAfterPublish);
  policy_->on_insert(pstate_, it.id, key);
  heap_.push(it.id, key);
  ++hdr_->items;
  hdr_->bytes_used += it.len;
  hdr_->stats.inserts.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace shadecache
