// gather_rows / gather_flat: the read half of CachedLoader (shadecache/loader/loader.py).
//
// Both are loops of the engine's lock-free Cache::read (the seqlock protocol of cache.h: copy
// out, then prove no writer raced the copy, retry otherwise), so they take no lock and see what
// get_many would see, value by value. They differ from get_many in where the bytes go: into one
// caller-supplied (B, S) buffer, or one flat buffer this call allocates, never a bytes object per
// sample, so the loop needs no GIL. The GIL is released around it; Cache::Use keeps the mapping
// alive if another thread closes the cache meanwhile (close() then waits for the loop to end).
//
// GIL contract: ids are checked and copied, and the output buffer is borrowed (Py_buffer, so the
// caller's object cannot be resized while it is held), with the GIL held; the loop itself runs
// without it and touches no Python object.
#include "bindings/batch_gather.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/convert.h"
#include "bindings/ids.h"
#include "cache/cache.h"

namespace py = pybind11;

namespace shadecache {
namespace {

// Ids checked against the cache (open, every id in range) before any byte is copied, and copied
// out of the caller's array: it is read with the GIL released, when another thread could change it.
std::vector<uint64_t> checked_ids(Cache& c, py::handle ids) {
  IdArray a = integer_ids(ids);
  c.check_open();
  std::vector<uint64_t> out(a.size());
  const int64_t* p = a.data();
  for (size_t i = 0; i < out.size(); ++i) {
    c.check_id_signed(p[i]);
    out[i] = static_cast<uint64_t>(p[i]);
  }
  return out;
}

// Reads every id in order, with prefetches ahead of the copies (hints only: they change no result).
// A batch of random ids over a working set larger than the CPU caches is bound by two dependent
// DRAM misses per value (the index entry, then the slot), not by the copies, so the misses of
// many ids must be in flight at once. The pipeline has two stages:
// - index entries are requested kIndexAhead ids ahead, i.e. a whole batch of 256 up front;
// - slots (header and value lines, once the index entry names them) are requested `ahead` ids
//   ahead, in steps of `step` ids: values up to kSmallValue bytes in chunks of kSmallChunk, one
//   chunk ahead; larger ones 4 ids ahead, one at a time (their copies are long enough to hide a
//   miss).
// Requesting the whole batch's index entries first, not a few chunks ahead, is what brought small
// values level with np.take by CPU time (3 KB values, whose copies hide more, were level either
// way); slot chunks of 16 ids, not 32, were faster again for small values
// (bench/bench_gather_cpu.py; docs/benchmark_history.md, "CachedLoader vs `np.take`: the batch
// path" and "CachedLoader vs `np.take`: the Python around the call").
// The hits, misses and retries are counted once per call (Cache::count_reads).
constexpr uint32_t kSmallValue = 512;
constexpr size_t kSmallChunk = 16;
constexpr size_t kIndexAhead = 256;

// Labels: when `labels` (one integer per sample id) is given, labels_out[i] = labels[ids[i]] for
// every id, hit or miss, with its line requested in the index stage (a random gather from an
// array of N labels misses the caches as the index does). The labels may be int8/16/32/64: the
// loader passes the narrowest type that holds them, so that the array (1 MiB for a million int8
// labels) stays in the CPU caches while the values stream past, instead of missing per sample.
// block > 0: the ids are consecutive batches of `block` ids, and reading stops at the first batch
// with a miss (returns how many ids were read): after it when it is the first batch, else before
// it (its reads are not counted). A batch with misses is thus always the last one read, and only
// ever read first: its misses are admitted by the caller when that batch is due, after the
// training steps of the batches before it, as a DataLoader reading batch by batch would do.
struct Labels {
  const char* data = nullptr;  // nullptr: no labels
  int width = 8;               // bytes per label: 1, 2, 4 or 8 (signed)
  int64_t operator[](uint64_t id) const {
    switch (width) {
      case 1: return reinterpret_cast<const int8_t*>(data)[id];
      case 2: return reinterpret_cast<const int16_t*>(data)[id];
      case 4: return reinterpret_cast<const int32_t*>(data)[id];
      default: return reinterpret_cast<const int64_t*>(data)[id];
    }
  }
};

template <class ReadOne>
size_t pipelined(Cache& c, const std::vector<uint64_t>& ids, uint32_t len_guess, ReadOne&& read_one,
                 Labels labels = {}, int64_t* labels_out = nullptr, size_t block = 0) {
  const size_t n = ids.size();
  const bool small = len_guess <= kSmallValue;
  const size_t step = small ? kSmallChunk : 1, ahead = small ? kSmallChunk : 4;
  size_t indexed = 0, valued = 0;  // ids whose index entry / slot has been requested
  auto request = [&](size_t& done, size_t end, auto&& prefetch) {
    for (end = std::min(n, end); done < end; ++done) prefetch(ids[done]);
  };
  auto index = [&](uint64_t id) {
    c.prefetch_index(id);
    if (labels.data) __builtin_prefetch(labels.data + id * labels.width);
  };
  auto value = [&](uint64_t id) { c.prefetch_value(id, len_guess); };
  uint64_t hits = 0, retries = 0;
  size_t end = n;                  // block mode: where reading stops
  size_t batch = 0;                 // block mode: where the current batch starts (no division
  uint64_t hits_before = 0;         // per id: it costs as much as a cached copy), its hits before
  for (size_t a = 0; a < end; a += step) {
    request(indexed, a + kIndexAhead, index);
    request(valued, a + step + ahead, value);
    for (size_t i = a; i < std::min(end, a + step); ++i) {
      if (block && i == batch + block) {
        batch = i;
        hits_before = hits;
      }
      if (read_one(i, &retries) >= 0) {
        ++hits;
      } else if (block && end == n) {
        if (batch == 0) {
          end = std::min(n, block);
        } else {
          end = batch;
          hits = hits_before;
        }
      }
      if (labels.data && i < end) labels_out[i] = labels[ids[i]];
    }
  }
  c.count_reads(hits, end - hits, retries);
  return end;
}

// gather_rows(core, ids, out) -> int64 lengths: value i goes to bytes [i*S, i*S + len) of `out`
// (S = len(out) / len(ids)); lengths[i] is its length, -1 on a miss. A value longer than S is not
// written to `out`; its length (> S) is returned for the caller to report.
using Int64Array = py::array_t<int64_t, py::array::c_style>;

// The labels arguments of gather_rows: both or neither; labels one signed integer (int8, int16,
// int32 or int64, native byte order, aligned) per sample of the cache, labels_out one writable
// aligned int64 per id. Exact dtypes, never a silent converting copy.
std::pair<Labels, int64_t*> label_arrays(const Cache& c, py::handle labels, py::handle labels_out, size_t n) {
  if (labels.is_none() && labels_out.is_none()) return {Labels{}, nullptr};
  if (labels.is_none() || labels_out.is_none())
    throw py::value_error("gather_rows: give both labels and labels_out, or neither");
  // The width of a 1-D C-contiguous aligned native-order signed integer array, else 0: the loop
  // reads it as intN_t, so a byte-swapped ('>i4') or misaligned array would be misread.
  auto label_width = [](py::handle h) -> int {
    if (!py::isinstance<py::array>(h)) return 0;
    auto a = py::reinterpret_borrow<py::array>(h);
    if (a.ndim() != 1 || !(a.flags() & py::array::c_style) ||
        !(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
      return 0;
    if (py::isinstance<py::array_t<int8_t>>(h)) return 1;   // array_t: native byte order only
    if (py::isinstance<py::array_t<int16_t>>(h)) return 2;
    if (py::isinstance<py::array_t<int32_t>>(h)) return 4;
    if (py::isinstance<py::array_t<int64_t>>(h)) return 8;
    return 0;
  };
  const int width = label_width(labels);
  if (width == 0)
    throw py::type_error("gather_rows: labels must be a 1-D C-contiguous aligned int8/int16/int32/int64 numpy "
                         "array in native byte order");
  if (!py::isinstance<Int64Array>(labels_out) || py::reinterpret_borrow<py::array>(labels_out).ndim() != 1 ||
      !(py::reinterpret_borrow<py::array>(labels_out).flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_))
    throw py::type_error("gather_rows: labels_out must be a 1-D C-contiguous aligned int64 numpy array");
  auto in = py::reinterpret_borrow<py::array>(labels);
  auto out = py::reinterpret_borrow<Int64Array>(labels_out);
  if (static_cast<uint64_t>(in.size()) != c.num_samples())
    throw py::value_error("gather_rows: labels has " + std::to_string(in.size()) + " entries, the cache " +
                          std::to_string(c.num_samples()) + " samples");
  if (static_cast<size_t>(out.size()) != n)
    throw py::value_error("gather_rows: labels_out has " + std::to_string(out.size()) + " entries for " +
                          std::to_string(n) + " ids");
  if (!out.writeable()) throw py::value_error("gather_rows: labels_out is read-only");
  return {Labels{static_cast<const char*>(in.data()), width}, out.mutable_data()};
}

py::object gather_rows(Cache& c, py::handle ids, py::handle out, py::handle labels, py::handle labels_out,
                       size_t block, bool none_if_all_rows) {
  std::vector<uint64_t> v = checked_ids(c, ids);
  auto [lab, lab_out] = label_arrays(c, labels, labels_out, v.size());
  WritableBuffer view(out, PyBUF_C_CONTIGUOUS,
                      "gather_rows needs a writable C-contiguous buffer (numpy array, bytearray)");
  const size_t n = v.size();
  const uint64_t total = view.size();
  if (n == 0) {
    if (total != 0) throw py::value_error("gather_rows: no ids but a buffer of " + std::to_string(total) + " bytes");
    if (none_if_all_rows) return py::none();
    return py::array_t<int64_t>(0);
  }
  if (total % n != 0)
    throw py::value_error("gather_rows: a buffer of " + std::to_string(total) + " bytes is not " + std::to_string(n) +
                          " equal rows");
  const uint64_t row = total / n;
  char* dst = view.data();
  py::array_t<int64_t> lengths(static_cast<py::ssize_t>(n));
  int64_t* lens = lengths.mutable_data();
  uint32_t guess = static_cast<uint32_t>(std::min<uint64_t>(row, Cache::kPrefetchMaxBytes));
  {
    Cache::Use use(c);
    py::gil_scoped_release nogil;
    std::vector<char> aside;  // an oversize value (or a racing writer's length) lands here
    size_t done = pipelined(c, v, guess, [&](size_t i, uint64_t* retries) {
      char* slot = dst + i * row;
      return lens[i] = c.read_uncounted(v[i], [&](uint32_t len) -> char* {
        if (len <= row) return slot;
        aside.resize(len);
        return aside.data();
      }, retries);
    }, lab, lab_out, block);
    std::fill(lens + done, lens + n, int64_t{-2});
  }
  // The loader's common case, all hits of exactly S bytes, answered here (a pass over n lengths
  // in L1) rather than by numpy comparisons on the caller's side.
  if (none_if_all_rows && std::all_of(lens, lens + n, [row](int64_t l) { return l == static_cast<int64_t>(row); }))
    return py::none();
  return std::move(lengths);
}

// gather_flat(core, ids, len_hint=0) -> (uint8 flat, int64 lengths): the values of the hits, one
// after another in id order (a miss takes no bytes and has length -1). len_hint: the expected
// length of one value, used to size the buffer once and to prefetch.
py::tuple gather_flat(Cache& c, py::handle ids, uint64_t len_hint) {
  std::vector<uint64_t> v = checked_ids(c, ids);
  const size_t n = v.size();
  auto* buf = new std::vector<char>();
  py::capsule owner(buf, [](void* p) { delete static_cast<std::vector<char>*>(p); });
  py::array_t<int64_t> lengths(static_cast<py::ssize_t>(n));
  int64_t* lens = lengths.mutable_data();
  {
    Cache::Use use(c);
    py::gil_scoped_release nogil;
    buf->reserve(n * len_hint);
    uint32_t guess = static_cast<uint32_t>(std::min<uint64_t>(len_hint ? len_hint : 512, Cache::kPrefetchMaxBytes));
    size_t pos = 0;
    pipelined(c, v, guess, [&](size_t i, uint64_t* retries) {
      // alloc may be called again after a raced attempt: every attempt writes at `pos`.
      int64_t len = c.read_uncounted(v[i], [&](uint32_t len) -> char* {
        buf->resize(pos + len);
        return buf->data() + pos;
      }, retries);
      lens[i] = len;
      if (len >= 0) pos += static_cast<size_t>(len);
      buf->resize(pos);  // drops what a raced attempt before a miss left
      return len;
    });
  }
  py::array_t<uint8_t> flat(static_cast<py::ssize_t>(buf->size()), reinterpret_cast<uint8_t*>(buf->data()), owner);
  return py::make_tuple(flat, lengths);
}

}  // namespace

void register_batch_gather(py::module_& m) {
  m.def("gather_rows",
        [](Cache& c, py::handle ids, py::handle out, py::handle labels, py::handle labels_out, size_t block,
           bool none_if_all_rows) { return gather_rows(c, ids, out, labels, labels_out, block, none_if_all_rows); },
        py::arg("core"), py::arg("ids"), py::arg("out"), py::arg("labels") = py::none(),
        py::arg("labels_out") = py::none(), py::arg("block") = 0, py::arg("none_if_all_rows") = false,
        "gather_rows(core, ids, out, labels=None, labels_out=None, block=0, none_if_all_rows=False) -> "
        "int64 lengths (-1: miss). Copies value i into row i of the writable buffer `out` (len(ids) "
        "equal rows), and labels[ids[i]] (labels: int8/16/32/64) into labels_out[i] (int64) when given, "
        "GIL released, no lock. block > 0: the ids are batches of `block`; reading stops at the first "
        "batch with a miss (after it if it is the first batch, else before it), and the ids not read "
        "get length -2 (not counted). none_if_all_rows: None instead of the lengths when every id "
        "was read and is a hit of exactly one row's bytes.");
  m.def("gather_flat",
        [](Cache& c, py::handle ids, uint64_t len_hint) { return gather_flat(c, ids, len_hint); },
        py::arg("core"), py::arg("ids"), py::arg("len_hint") = 0,
        "gather_flat(core, ids, len_hint=0) -> (uint8 flat, int64 lengths): the hits' values back to "
        "back in id order (-1: miss, no bytes), GIL released, no lock.");
}

}  // namespace shadecache
