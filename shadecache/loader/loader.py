"""CachedLoader: batches assembled in the training process, straight out of the shared-memory cache.

A DataLoader with worker processes pays, for every sample, a pickle in the worker, a pipe and an
unpickle in the training process: with small samples that hand-over, not the cache, is the limit.
The cache is shared memory that any process reads without a lock, so the training process can
assemble a cached batch itself:

    loader = sc.CachedLoader(ds, batch_size=256, sampler=sampler, num_workers=2)
    for x, y, idx in loader:      # x: (B, S) uint8 tensor, y: labels, idx: sample ids
        ...

How one batch is made (on one of `num_workers` threads of this process, `prefetch_batches` ahead;
num_workers=0 makes it in the iterating thread):
  1. the sampler's next B ids (the sampler is iterated in the iterating thread only);
  2. hits: one native call (Cache.gather_rows / gather_flat) copies every cached value into the
     batch's buffer with the GIL released: a (B, S) tensor when every sample of the store has the
     same size S, else one flat tensor plus offsets (RaggedBatch). No Python object per sample;
  3. misses: the node's miss path, node.misses.fetch (the tiers below the cache, one batch each,
     then admission into the cache, exactly as a DataLoader worker does), copied into their rows;
  4. labels gathered from the store's label array (fixed sizes: in the same native call);
     `batch_transform(x)` (vectorized, on the whole batch) if given.
Fixed-size raw batches of a sampler that cannot follow the training steps (see _group_batches) are
gathered several per native call (up to 8192 samples / 2 MiB) and handed out as views of one
tensor; the call stops at the first batch with a miss, so that batch's misses are admitted when it
is due, as batch by batch. Their buffers are reused once no batch made in them is alive anywhere
in the process (batches.py's BufferPool): a batch the caller keeps is never overwritten, and nothing has to be
copied or released by the caller.
When the data set has its own `decode` or `transform`, or `collate` is given, a batch is instead
`collate(dataset.__getitems__(ids))` (torch's default_collate when collate is None): the same
items a DataLoader would build, made on the loader's threads (a transform that releases the GIL
runs in parallel there; a Python-heavy one is bound by the GIL).

Batches are the ones DataLoader(dataset, batch_size, sampler, drop_last) yields, in the same order,
with the same bytes, labels and ids. Errors raised while making a batch (a transform's, a corrupt
sample's) are raised by the iterator when that batch is due, as the original exception object.
Threads are named "shadecache-loader-*" and stop when the iteration ends, breaks, raises, or its
iterator is garbage collected.
"""
import itertools
import math
import operator
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from ..ids import holds_bool
from .batches import BufferPool, RaggedBatch, narrow_labels
from .dataset import CachedDataset
from .threads import AssemblyThreads
from .workers import IdBatches

_warned_pin = False
_GROUP_SAMPLES = 8192        # see CachedLoader._group_batches
_GROUP_BYTES = 2 << 20       # 3 KB: 2 batches of 256 per call (4 MiB groups measured slower:
#                              docs/benchmark_history.md, "CachedLoader vs `np.take`: the Python
#                              around the call")
_POOL_BYTES = 32 << 20       # output buffers a loader keeps for reuse (BufferPool), at most
_STATELESS_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)
_SEQUENCES = (list, tuple, range, np.ndarray, torch.Tensor)   # see _as_id_array


def _check_count(name, value, minimum):
    """`value` as an int (a numpy integer too, as Cache.create takes them); TypeError for a bool,
    a float or anything else, ValueError below `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _can_pin() -> bool:
    """True when pinned host memory exists here (a CUDA device); else warns once and says False."""
    global _warned_pin
    if torch.cuda.is_available():
        return True
    if not _warned_pin:
        _warned_pin = True
        warnings.warn("CachedLoader: pin_memory=True but no CUDA device is available; batches are "
                      "assembled in ordinary (pageable) memory", RuntimeWarning, stacklevel=3)
    return False


class CachedLoader:
    """An iterable of (x, y, idx) batches of a CachedDataset, assembled in this process.

    dataset           a sc.CachedDataset (its cache, store, decode, transform and counters are used)
    batch_size        samples per batch
    sampler           any torch Sampler (ShadeSampler, DistributedSampler, ...); None: a
                      SequentialSampler, or a RandomSampler(generator=generator) when shuffle=True
    num_workers       assembly threads in this process (0: in the iterating thread)
    collate           None: x is a (B, S) uint8 tensor (fixed-size samples) or a RaggedBatch, or
                      default_collate of the items when the data set decodes or transforms; a
                      callable: collate(list of (sample, target, index)), as DataLoader's collate_fn
    batch_transform   x -> x on the whole batch tensor, run on the assembly thread (vectorized
                      torch ops release the GIL, so batches transform in parallel)
    pin_memory        assemble into pinned memory (with a CUDA device; on a machine without one the
                      option is accepted, warned about once, and batches stay in pageable memory)
    prefetch_batches  batches in flight ahead of the one the caller holds (at least num_workers
                      calls; a call gathers a whole group of batches when they are grouped)
    drop_last         drop the last incomplete batch
    process_workers   > 0: batches made per sample (the data set's decode/transform, or collate)
                      are made in that many worker processes (a Python-heavy transform is bound by
                      the GIL on threads); only the collated batch comes back, through shared
                      memory. Ignored for raw batches (nothing per sample runs). Errors, shutdown
                      and multiprocessing_context are those of torch's DataLoader workers.

    len(loader) is the number of batches per epoch. set_epoch(e) calls the sampler's. For resume:
    state_dict() / load_state_dict(); a sampler with its own state_dict (ShadeSampler) resumes
    itself, for any other the loader skips the batches already delivered in this epoch (the
    sampler must produce the same order again: same seed, same epoch).
    """

    def __init__(self, dataset, batch_size: int = 1, sampler=None, shuffle: bool = False,
                 num_workers: int = 2, collate=None, batch_transform=None, pin_memory: bool = False,
                 prefetch_batches: int = 2, drop_last: bool = False, generator=None,
                 process_workers: int = 0, multiprocessing_context=None):
        if not isinstance(dataset, CachedDataset):
            raise TypeError(f"CachedLoader needs a shadecache.CachedDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.batch_size = _check_count("batch_size", batch_size, 1)
        self.num_workers = _check_count("num_workers", num_workers, 0)
        self.prefetch_batches = _check_count("prefetch_batches", prefetch_batches, 1)
        self.process_workers = _check_count("process_workers", process_workers, 0)
        self.multiprocessing_context = multiprocessing_context
        if sampler is not None and shuffle:
            raise ValueError("CachedLoader: give a sampler or shuffle=True, not both")
        if sampler is None:
            sampler = (RandomSampler(dataset, generator=generator) if shuffle
                       else SequentialSampler(dataset))
        self.sampler = sampler
        for name, fn in (("collate", collate), ("batch_transform", batch_transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        self.collate = collate
        self.batch_transform = batch_transform
        self.pin_memory = bool(pin_memory)
        self.drop_last = bool(drop_last)
        # Raw batches (bytes straight into a tensor) when nothing per sample has to run.
        self._raw = collate is None and dataset.raw
        self._row_bytes = self._fixed_size(dataset.store)
        self._len_hint = self._row_bytes or 0
        self._labels = self._labels_of = None
        self._refresh_labels()
        self._buffers = self._new_buffers()
        self._delivered = 0   # batches of the current epoch handed to the caller
        self._skip = 0        # batches to skip at the start of the next iteration (resume)

    def _refresh_labels(self) -> None:
        """The store's label array, narrowed (narrow_labels), for gather_rows to gather with the bytes;
        None when the store has no such array. Done again at every iteration, as the DataLoader
        reads the labels afresh: a store whose labels change between epochs (in place, or a new
        array) gets the new ones. Only the same read-only array (a PackedStore's, fixed for the
        store's life) keeps its narrowed copy without another pass over it."""
        labels = getattr(self.dataset.store, "labels", None)
        if not (isinstance(labels, np.ndarray) and labels.shape == (len(self.dataset),)
                and labels.dtype.kind in "iu"):
            self._labels = self._labels_of = None
        elif labels is not self._labels_of or labels.flags.writeable:
            self._labels, self._labels_of = narrow_labels(labels), labels

    @staticmethod
    def _fixed_size(store):
        """S when every sample of the store has S bytes (S > 0), else None (variable sizes)."""
        lengths = getattr(store, "lengths", None)
        if not isinstance(lengths, np.ndarray) or lengths.size == 0:
            return None
        lo, hi = int(lengths.min()), int(lengths.max())
        return lo if lo == hi and lo > 0 else None

    # ---- DataLoader habits -------------------------------------------------------------------
    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        state = {"batches_delivered": self._delivered}
        if hasattr(self.sampler, "state_dict"):
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "sampler" in state:
            if not hasattr(self.sampler, "load_state_dict"):
                raise ValueError("CachedLoader state holds a sampler state, but this loader's "
                                 f"sampler ({type(self.sampler).__name__}) cannot load one")
            self.sampler.load_state_dict(state["sampler"])
            self._skip = 0   # the sampler resumes itself
        else:
            self._skip = _check_count("batches_delivered", state["batches_delivered"], 0)
        self._delivered = int(state["batches_delivered"])

    # ---- iteration ---------------------------------------------------------------------------
    def _id_groups(self, k: int = 1):
        """The sampler's ids in groups of k batches (int64 arrays of up to k * batch_size ids,
        consecutive batches of batch_size; only the epoch's last batch can be short, and it ends
        the last group), after skipping a resumed epoch's batches."""
        skip, self._skip = self._skip, 0
        if not skip:
            self._delivered = 0
        b = self.batch_size
        g = k * b
        order = _as_id_array(self.sampler)
        if order is not None:    # a plain sequence of ids: sliced, not iterated id by id
            start = min(skip * b, order.size)
            end = start + (order.size - start) // b * b if self.drop_last else order.size
            for a in range(start, end, g):
                yield order[a:min(a + g, end)]
            return
        it = iter(self.sampler)
        if skip:
            for _ in itertools.islice(it, skip * b):
                pass
        while True:
            # operator.index refuses a float (np.fromiter alone would truncate 1.7 to sample 1),
            # at no cost measurable here; a bool still reads as 0 or 1 (a per-id Python check
            # would cost a quarter of a small-sample group's assembly)
            try:
                ids = np.fromiter(map(operator.index, itertools.islice(it, g)), dtype=np.int64)
            except TypeError as exc:
                raise TypeError(f"sample ids must be integers: the sampler gave another ({exc})") from None
            if self.drop_last:
                ids = ids[:ids.size // b * b]
            if ids.size == 0:
                return
            yield ids
            if ids.size < g:
                return

    def __iter__(self):
        if self.process_workers and not self._raw:
            yield from self._iter_processes()
            return
        self._refresh_labels()
        k = self._group_batches()
        if self._buffers.rows != k * self.batch_size:   # the sampler was replaced since
            self._buffers = self._new_buffers()
        groups = self._id_groups(k)
        if self.num_workers == 0:
            for group in groups:
                yield from self._hand_out(*self._make_group(group))
            self._delivered = 0
            return
        pool = AssemblyThreads(self._make_group, self.num_workers)
        try:
            submitted = taken = 0
            for group in itertools.islice(groups, self._groups_ahead()):
                pool.submit(submitted, group)
                submitted += 1
            while taken < submitted:
                ok, value = pool.take(taken)
                taken += 1
                nxt = next(groups, None)   # keep the pipeline full before handing batches out
                if nxt is not None:
                    pool.submit(submitted, nxt)
                    submitted += 1
                if not ok:
                    raise value
                yield from self._hand_out(*value)
            self._delivered = 0
        finally:
            pool.stop()

    def _hand_out(self, made, exc):
        """Yields a group's batches, counting each as delivered (state_dict resumes after the
        last one handed out), then raises the error that cut the group short, if any."""
        for batch in made:
            self._delivered += 1
            yield batch
        if exc is not None:
            raise exc

    def _iter_processes(self):
        """Batches made per sample (decode, transform, collate) in `process_workers` worker
        processes: torch's DataLoader workers over this loader's batches of ids. A worker makes
        the whole batch (ds.__getitems__ then collate) and only the collated tensors cross to this
        process, as shared-memory storage (torch.multiprocessing), not a pickle per sample; errors
        and shutdown are the DataLoader's own (its workers end when the iteration ends, breaks,
        raises or is garbage collected)."""
        from torch.utils.data import DataLoader
        dl = DataLoader(self.dataset, batch_sampler=IdBatches(self._id_groups, len(self)),
                        num_workers=self.process_workers,
                        collate_fn=self.collate or default_collate,
                        pin_memory=self.pin_memory and _can_pin(),
                        prefetch_factor=max(1, math.ceil(self.prefetch_batches / self.process_workers)),
                        multiprocessing_context=self.multiprocessing_context)
        it = iter(dl)
        try:
            for batch in it:
                self._delivered += 1
                yield batch
            self._delivered = 0
        finally:
            it._shutdown_workers()   # now, not whenever a traceback lets go of the iterator
            del it

    def _group_batches(self) -> int:
        """Batches assembled by one native call. Fixed-size raw batches of small samples are
        gathered several at a time (up to _GROUP_SAMPLES samples, _GROUP_BYTES bytes) and handed out
        as views, so that the per-call costs (sampler slice, tensor, label gather, counters) are
        paid once per group: a batch of small samples takes less time to copy than those costs
        (docs/benchmark_history.md, "CachedLoader vs `np.take`: the batch path")."""
        if not self._raw or self._row_bytes is None:
            return 1
        # Only samplers whose order cannot depend on the training steps are read ahead on the
        # iterating thread (num_workers=0 otherwise stays in step with a DataLoader's, batch by
        # batch: a ShadeSampler's order and the cache's scores follow the losses reported).
        if not isinstance(self.sampler, _STATELESS_SAMPLERS + _SEQUENCES):
            return 1
        per_batch = self.batch_size * self._row_bytes
        return max(1, min(_GROUP_SAMPLES // self.batch_size, _GROUP_BYTES // per_batch))

    def _new_buffers(self) -> BufferPool:
        """Output buffers of fixed-size raw batches, one group each, reused once no batch made in
        them is alive: enough for the groups in flight, the group being handed out, and the
        caller's batch of the one before it, within _POOL_BYTES (large batches are allocated per
        call, as before: their page faults weigh less against their copy, and a pool of them
        would hold hundreds of MiB after the epoch)."""
        rows = self._group_batches() * self.batch_size
        keep = (self._groups_ahead() if self.num_workers else 1) + 2
        return BufferPool(rows, self._row_bytes or 0,
                        min(keep, _POOL_BYTES // max(1, rows * (self._row_bytes or 0))))

    def _groups_ahead(self) -> int:
        """Groups in flight on the threads (num_workers > 0): prefetch_batches, at least one per thread."""
        return max(math.ceil(self.prefetch_batches / self._group_batches()), self.num_workers)

    # ---- one group of batches ------------------------------------------------------------------
    def _make_group(self, ids: np.ndarray):
        """(batches made, None) or (the batches before the failing one, its exception): a batch
        that raises ends the group there, so the batches before it are still delivered."""
        made = []
        try:
            if not self._raw or self._row_bytes is None:    # one batch per group
                made.append(self._make(ids))
                return made, None
            b = self.batch_size
            while ids.size:
                # One gather for the group; it stops after the first batch with a miss (that
                # batch's misses are admitted before the next batch is looked up, as batch by
                # batch), and the batches not read are gathered again by the next turn.
                x, y, idx = self._assemble(ids, block=b)
                n = idx.numel()
                ids = ids[n:]
                if n == b:
                    parts = ((x, y, idx),)
                elif n % b == 0:   # a whole group: one C++ call per tensor makes its batches' views
                    k = n // b
                    parts = zip(x.view(k, b, -1).unbind(0), y.view(k, b).unbind(0),
                                idx.view(k, b).unbind(0))
                else:              # only the epoch's last batch can be short: the group's last
                    parts = zip(x.split(b), y.split(b), idx.split(b))
                if self.batch_transform is None:
                    made.extend(parts)
                else:
                    for xb, yb, ib in parts:
                        made.append((self.batch_transform(xb), yb, ib))
        except Exception as exc:   # re-raised by the iterating thread after `made`
            return made, exc
        return made, None

    # ---- one batch ---------------------------------------------------------------------------
    def _make(self, ids: np.ndarray):
        ds = self.dataset
        if not self._raw:
            items = ds.__getitems__(ids)
            batch = (self.collate or default_collate)(items)
            return self._pin(batch) if self.pin_memory else batch
        x, y, idx = self._assemble(ids)
        if self.batch_transform is not None:
            x = self.batch_transform(x)
        return x, y, idx

    def _assemble(self, ids: np.ndarray, block: int = 0):
        """(x, y, idx) of raw bytes (no transform) for the ids of one batch, or of a group of
        batches of `block` ids (fixed sizes only): then only the batches up to the first one with
        a miss, and idx says which."""
        ds = self.dataset
        pin = self.pin_memory and _can_pin()
        if self._row_bytes is not None:
            x, y, ids = self._rows(ids, pin, block)
        else:
            x = self._ragged(ids)
            if pin:
                x = x.pin_memory()
            y = ds.labels_of(ids)
        y = torch.from_numpy(y)
        idx = torch.from_numpy(ids)
        if pin:
            y, idx = y.pin_memory(), idx.pin_memory()
        return x, y, idx

    def _rows(self, ids, pin, block=0):
        """(x, labels, ids): x a (B, S) uint8 tensor, hits copied by one native call (which also
        gathers the labels when the store has a label array), misses from the node's miss path. With
        block > 0 (batches of `block` ids), only the batches up to the first with a miss: ids is
        the prefix of the given ids they hold."""
        ds = self.dataset
        s = self._row_bytes
        if pin:
            x = torch.empty((ids.size, s), dtype=torch.uint8, pin_memory=True)
            out = x.numpy()
        else:
            out = self._buffers.take(ids.size)
            x = torch.from_numpy(out)
        labels = self._labels   # once: another iteration of this loader may refresh it meanwhile
        if ds.cache is not None:
            y = np.empty(ids.size, dtype=np.int64) if labels is not None else None
            lens = ds.cache.gather_rows(ids, out, labels, y, block, True)  # checks ids
            if lens is None:    # every id read, every one a hit of S bytes: the common case
                if y is None:
                    y = ds.labels_of(ids)
                ds.node.misses.count_batch(ids, ids.size, _all_hit)
                return x, y, ids
            if lens[-1] == -2:    # block: the batches after the first miss unread
                done = int(np.argmax(lens == -2))
                ids, lens, x, out = ids[:done], lens[:done], x[:done], out[:done]
                y = None if y is None else y[:done]
        else:
            lens = np.full(ds.check_ids(ids).size, -1, dtype=np.int64)
        if labels is None or ds.cache is None:
            y = ds.labels_of(ids)
        missed = wait_ns = 0
        if np.count_nonzero(lens != s):
            bad = np.flatnonzero((lens >= 0) & (lens != s))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"sample id {int(ids[i])} is cached with {int(lens[i])} bytes, but "
                                 f"every sample of the store has {s}")
            pos = np.flatnonzero(lens < 0)
            missed = pos.size
            got, wait_ns = _fetch_missed(ds, ids[pos].tolist())
            for p, i in zip(pos.tolist(), ids[pos].tolist()):
                out[p] = np.frombuffer(got[i], dtype=np.uint8)
        ds.node.misses.count_batch(ids, ids.size - missed, lambda: lens >= 0, wait_ns)
        return x, y, ids

    def _ragged(self, ids):
        """A RaggedBatch: hits copied back to back by one native call, misses spliced in."""
        ds = self.dataset
        if ds.cache is not None:
            flat, lens = ds.cache.gather_flat(ids, self._len_hint)   # checks every id
        else:
            flat = np.empty(0, dtype=np.uint8)
            lens = np.full(ds.check_ids(ids).size, -1, dtype=np.int64)
        missed = np.flatnonzero(lens < 0)
        hit = lens >= 0            # before the misses' lengths are filled in below
        wait_ns = 0
        if missed.size:
            got, wait_ns = _fetch_missed(ds, ids[missed].tolist())
            hit_ends = np.cumsum(np.maximum(lens, 0))
            pieces = []
            for pos, (i, n) in enumerate(zip(ids.tolist(), lens.tolist())):
                if n < 0:
                    pieces.append(np.frombuffer(got[i], dtype=np.uint8))
                    lens[pos] = len(got[i])
                else:
                    pieces.append(flat[hit_ends[pos] - n:hit_ends[pos]])
            flat = np.concatenate(pieces) if pieces else flat
        offsets = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if ds.cache is not None and lens.size:
            self._len_hint = int(offsets[-1]) // lens.size   # sizes the next batch's buffer once
        ds.node.misses.count_batch(ids, ids.size - missed.size, lambda: hit, wait_ns)
        return RaggedBatch(torch.from_numpy(flat), torch.from_numpy(offsets))

    def _pin(self, batch):
        if not _can_pin():
            return batch
        from torch.utils.data._utils.pin_memory import pin_memory
        return pin_memory(batch)


def _as_id_array(sampler):
    """The sampler's order as an int64 array when it is a plain sequence of ids (list, tuple,
    range, numpy array, tensor: iterating it gives exactly these ids, and it has no state to
    advance), else None (the sampler is iterated id by id, as a DataLoader does)."""
    if isinstance(sampler, torch.Tensor) and sampler.dim() == 1 and not sampler.is_floating_point():
        if sampler.dtype == torch.bool:
            raise TypeError("sample ids must be integers, got a bool tensor as the sampler")
        return np.ascontiguousarray(sampler.cpu().numpy(), dtype=np.int64)
    if isinstance(sampler, np.ndarray) and sampler.ndim == 1 and sampler.dtype.kind in "iu":
        return np.ascontiguousarray(sampler, dtype=np.int64)
    if isinstance(sampler, range):
        return np.arange(sampler.start, sampler.stop, sampler.step, dtype=np.int64)
    if isinstance(sampler, (list, tuple)):
        try:
            a = np.array(sampler)
        except (ValueError, TypeError):
            return None
        if a.ndim == 1 and a.dtype.kind in "iu":
            if holds_bool(sampler):   # numpy reads [1, True] as [1, 1]; a bool is no id
                raise TypeError(f"sample ids must be integers, got a bool in the sampler {type(sampler).__name__}")
            return a.astype(np.int64, copy=False)
    return None


def _all_hit():
    """The hit mask of a batch whose ids all hit (MissPath.count_batch asks for it only when
    a prefetch flag is set): True broadcasts over the ids."""
    return True


def _fetch_missed(ds, missed: list):
    """({id: bytes}, ns waited) for the missed ids of a batch (an id may repeat): one call of the
    data set's miss path (tiers, store, admission into the cache), as a DataLoader worker makes it."""
    uniq = list(dict.fromkeys(missed))
    t0 = time.perf_counter_ns()
    values = ds.node.misses.fetch(uniq)
    return dict(zip(uniq, values)), time.perf_counter_ns() - t0
