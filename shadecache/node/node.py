"""sc.Node: what one node has, composed once, and every reader of the node built from it.

    node = sc.Node(store, cache, ssd=sc.SSDTier("/local/nvme/sc", capacity_bytes=200 << 30),
                   cluster="torch")                    # every part optional but the store
    ds = node.dataset()                                # items (bytes, label, id) through the node
    sampler = node.sampler(batch_size=B, seed=0)       # ShadeSampler over the node's read plan
    loader = node.loader(batch_size=B, sampler=sampler, num_workers=2)   # or a stock DataLoader

The node is the one place where the tiers below its cache are given, in one order: the peer node
that is home to a sample (cluster), the local SSD tier (ssd), the store. Every process of the node
reads through that one composition: the training process and its DataLoader workers (the node
travels with the data set), the prefetcher and the peer server (started by the node, from it), so
they cannot disagree whatever order the parts were made in (node.tiers() says what a process
reads through). With it the node fixes, once:

  - the read plan (read_plan.py): samples or whole extents, chosen from the store's device or
    given; the sampler draws its order under it, the chain reads by it;
  - the admission rule (admission.py): what enters the cache, asked by every path;
  - the order board (lookahead/board.py): where the samplers of the node publish their orders and
    the prefetcher reads ahead; one per cache, made by the first node of the cache on this
    machine and joined by the others;
  - the job (lookahead/jobs.py, docs/jobs.md): the training run this node reads for. Several jobs
    may share one cache: each registers on its board with its own orders, counters and scores,
    the cache evicts by their merged scores (score_merge), one prefetcher reads ahead for all;
  - reading ahead: with read_ahead=True (the default) the node's prefetcher starts when a sampler
    first publishes an order (one process of the node starts it, whichever rank claims the board
    first); it is the node's, not its starter's: it stops when the node that started it closes
    or its process exits while no other job trains on the node, else when the last job leaves.
    It reads through the composition of the node that started it (its tiers, admission and
    options): every node of one cache should be composed alike.

A node is picklable: a DataLoader worker (fork or spawn) gets the same composition and attaches the
cache, the board and the tiers by name in its own process.
"""
from __future__ import annotations

import atexit
import sys
import warnings
import weakref

import numpy as np

from ..read_plan import choose as choose_plan
from ..store.protocol import check_store
from ..tiers import TierChain
from ..admission import Admission
from ..lookahead.jobs import job_name
from ..lookahead.job_scores import check_rule
from ..lookahead.prefetcher import release_handed
from .miss_path import MissPath

CLUSTER_FROM_TORCH = "torch"


class Node:
    """One node's data path (see the module docstring).

    store        where every sample is (shadecache/store/protocol.py: sc.PackedStore, ...); None
                 only for a node that serves what its cache holds (node.serve())
    cache        the node's sc.Cache (num_samples == len(store)), or None: every read goes below
    ssd          an sc.SSDTier: read after the home peer, before the store; keeps what the cache
                 refuses; bound to the store's data set
    cluster      the job's nodes: "torch" (membership from torch.distributed; local rank 0 starts
                 the node's peer server, from this node), or an sc.Cluster of explicit addresses
                 (start the peer server with node.serve()); peer_options go to Cluster.from_torch
    keep_remote  also keep samples whose home is another node in this node's cache and SSD tier
    read_plan    "auto" (chosen from the store's device, printed, remembered on the node),
                 "samples", "extents" or a ReadPlan. The extent plan reads each miss with its
                 whole extent, which pays where the order asks for an extent's samples together:
                 the node's sampler (node.sampler(), or a ShadeSampler of its data set) arranges
                 its order so; with a sampler of your own, give read_plan="samples"
    admission    an sc.Admission (default: the engine's policy alone)
    read_ahead   True: an order board for the cache (made or attached) and the node's prefetcher
                 once a sampler publishes; False: no prefetcher of this node (a board made by
                 another node is attached, so its prefetcher's hand-over is followed)
    streams      ranks on this node publishing orders (default $LOCAL_WORLD_SIZE, else 1)
    prefetch     options of the prefetcher (lookahead/prefetcher.py: DEFAULTS)
    job          the training job's name: every rank and process of one job gives the same
                 (default: $SHADECACHE_JOB, else torchrun's run id, else the launching
                 process's: its process group's; lookahead/jobs.py)
    score_merge  how the cache's scores merge the live jobs' own (lookahead/job_scores.py:
                 "uses", the default, "max", "sum", or "last": no merge); the first job's board
                 decides, a node that asks for another is refused
    """

    def __init__(self, store, cache=None, ssd=None, cluster=None, keep_remote: bool = False,
                 read_plan="auto", admission=None, read_ahead: bool = True, streams=None,
                 prefetch=None, peer_options=None, job=None, score_merge=None):
        if store is None and cache is None:
            raise ValueError("a node needs a store, or (to serve what it holds) a cache")
        if store is not None:
            check_store(store)
        if store is not None and cache is not None and cache.num_samples != len(store):
            raise ValueError(f"cache {cache.name!r} holds {cache.num_samples} sample ids but the "
                             f"store has {len(store)} samples")
        if admission is not None and not isinstance(admission, Admission):
            raise TypeError(f"admission must be an sc.Admission, got {type(admission).__name__}")
        if ssd is not None and store is not None:   # the tier holds this store's samples only
            ssd.bind_store(store)
            keep = getattr(store, "keep_directory", None)   # an object store's directory: on the SSD
            if callable(keep):
                keep(ssd.path)
        self.store, self.cache, self.ssd = store, cache, ssd
        self.keep_remote = bool(keep_remote)
        self.admission = admission if admission is not None else Admission()
        self.read_plan = choose_plan(store, read_plan if store is not None else "samples")
        _check_plan(self.read_plan, store)
        if read_plan == "auto" and store is not None:
            print(f"shadecache: {self.read_plan.describe()}", file=sys.stderr)
        self.read_ahead = bool(read_ahead) and cache is not None
        from ..lookahead.prefetcher import check_options
        check_options(dict(prefetch or {}))   # refused now, not at the first publish
        self.prefetch_options = dict(prefetch or {})
        self._prefetcher = None
        self.job = job_name(job)
        if score_merge is not None:
            check_rule(score_merge)
        self._boards = _board_link(cache, streams, self.read_ahead, self.job, score_merge)
        if self._boards is not None:
            # a node dropped without close() leaves its job too, when it is collected (a
            # temporary node must not keep the job alive for the rest of the process)
            # (not at exit: _stop_prefetchers closes the live nodes, the board last)
            weakref.finalize(self, self._boards.close).atexit = False
        self._notes = {}      # epoch -> a sampler's counts (note_epoch), without a board
        self.cluster = None
        self.misses = MissPath.counted(self._chain(peer=False), self._boards)
        self.cluster = self._join(cluster, peer_options or {})
        self._owns_cluster = cluster == CLUSTER_FROM_TORCH   # its server was started by this node
        if self.cluster is not None:
            self.misses.chain = self._chain(peer=True)
        _LIVE.add(self)

    # ---- composition --------------------------------------------------------------------------
    def _join(self, cluster, options: dict):
        """The node's Cluster: made from torch.distributed (this node's server started from this
        node), or the one given, bound to the store's data set."""
        if cluster is None:
            return None
        from ..peer.cluster import Cluster
        if cluster == CLUSTER_FROM_TORCH:
            if self.cache is None:
                raise ValueError("cluster='torch' needs the node's cache: its peer server serves it")
            return Cluster.from_torch(self, **options)
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be 'torch' or an sc.Cluster, got {type(cluster).__name__}")
        if options:
            raise ValueError("peer_options are for cluster='torch'; a Cluster given was made with its own")
        if getattr(cluster, "server", None) is not None:
            raise ValueError("this Cluster started a peer server of its own, which may read through other "
                             "tiers than this node's: compose the node with cluster='torch' (it starts the "
                             "server from the node), or start the server with node.serve()")
        cluster.bind(self.store)   # the peers must serve this store's samples (checked at each handshake)
        return cluster

    def _chain(self, peer: bool) -> TierChain:
        """The node's tier chain: the home peer (unless peer=False: the peer server answers for
        the ids it is home to), the SSD tier, the store."""
        home = None
        if peer and self.cluster is not None:
            from ..peer.tier import HomePeerTier
            home = HomePeerTier(self.cluster)
        return TierChain.for_node(self.store, self.cache, peer=home, ssd=self.ssd,
                                  keep_remote=self.keep_remote, plan=self.read_plan,
                                  admission=self.admission)

    @property
    def board(self):
        """The cache's order board (lookahead/board.py), or None while it has none."""
        return None if self._boards is None else self._boards.get()

    @property
    def chain(self) -> TierChain:
        return self.misses.chain

    def server_misses(self) -> MissPath:
        """The miss path of the node's peer server: the node's chain less the home peer (it
        answers for the ids it is home to), no shared counters (it publishes its own)."""
        return MissPath(self._chain(peer=False))

    def tiers(self) -> list:
        """[(name, what)] of the tiers this process reads a miss through, in order."""
        return self.chain.describe()

    def pickled_for_process(self) -> bytes:
        """This node pickled for a process it starts (the prefetcher, the peer server: over a
        pipe), the cluster's secret included (peer/cluster.py carrying_secret)."""
        import pickle

        from ..peer.cluster import carrying_secret
        with carrying_secret():
            return pickle.dumps(self.for_process())

    def for_process(self) -> "Node":
        """A copy for a process the node starts (prefetcher, peer server): no shared counters
        (they travel only to processes a DataLoader starts; those processes publish their own)."""
        clone = object.__new__(Node)
        clone.__dict__.update(self.__getstate__())
        if self._boards is not None:    # it serves the node's jobs, it is none of them
            clone._boards = self._boards.observer()
        clone.misses = MissPath(self.misses.chain, clone._boards)
        return clone

    # ---- what is built from the node ----------------------------------------------------------
    def dataset(self, decode=None, transform=None):
        """A CachedDataset over the node: items (decode(bytes) -> transform, label, id)."""
        from ..loader.dataset import CachedDataset
        if self.store is None:
            raise ValueError("a node without a store has no data set (it only serves its cache)")
        return CachedDataset(self, decode=decode, transform=transform)

    def sampler(self, dataset=None, **options):
        """A ShadeSampler over the node's data set (or `dataset`, one of this node's), under its
        read plan and board; options: ShadeSampler's."""
        from ..sampling.sampler import ShadeSampler
        return ShadeSampler(self.dataset() if dataset is None else dataset, **options)

    def loader(self, batch_size: int, sampler=None, dataset=None, **options):
        """A CachedLoader over the node's data set (or `dataset`); options: CachedLoader's."""
        from ..loader.loader import CachedLoader
        return CachedLoader(self.dataset() if dataset is None else dataset, batch_size=batch_size,
                            sampler=sampler, **options)

    def prefetcher(self, **options):
        """The node's Prefetcher, not started (lookahead/prefetcher.py; options: its DEFAULTS)."""
        from ..lookahead.prefetcher import Prefetcher
        return Prefetcher(self, **{**self.prefetch_options, **options})

    def serve(self, host: str = "127.0.0.1", port: int = 0, secret=None):
        """Starts the node's peer server (another process), reading through the node's SSD tier
        and store; returns its handle (.address, .close())."""
        from ..peer.launch import serve
        if self.cache is None:
            raise ValueError("a node without a cache has nothing to serve")
        return serve(self, host=host, port=port, secret=secret)

    def start_reading_ahead(self) -> None:
        """Starts the node's prefetcher when this node reads ahead and none runs (the samplers
        call it when they publish an order). One process of the node starts it (an exclusive
        claim on the board: board.control.starting), whichever rank gets there first; one that cannot
        start (a class of the node's parts that the prefetcher's interpreter cannot import: one
        defined in the training script) warns, and training goes on without reading ahead."""
        if not self.read_ahead or (self._prefetcher is not None and self._prefetcher.alive()):
            return
        board = self.board
        if board is None or board.control.prefetcher_alive():
            return
        with board.control.starting() as mine:
            if not mine or board.control.prefetcher_alive():
                return
            try:
                self._prefetcher = self.prefetcher().start()
            except RuntimeError as e:
                self.read_ahead = False          # not tried again at every publish
                warnings.warn(f"shadecache: the node's prefetcher did not start ({e}); training "
                              "goes on without reading ahead. Its process unpickles the node: "
                              "define the store and the admission rule in an importable module, "
                              "or compose the node with read_ahead=False", RuntimeWarning,
                              stacklevel=3)
                return
        _STARTED.append(self._prefetcher)

    @property
    def started_prefetcher(self):
        """The Prefetcher this node started (start_reading_ahead), or None."""
        return self._prefetcher

    @property
    def prefetching(self) -> bool:
        """Whether the node's prefetcher runs (whoever started it)."""
        return self.board is not None and self.board.control.prefetcher_alive()

    # ---- counters and lifetime ----------------------------------------------------------------
    def stats(self) -> dict:
        """Counts over every process that read through this node (MissPath.stats), with the
        board's per-epoch rows, or the samplers' counts noted in this process without one."""
        return self.misses.stats(self._notes)

    def note_epoch(self, epoch: int, **counts) -> None:
        """Adds a sampler's per-epoch counts (accuracy_repeats, stall_deferrals, stall_repeats)
        to this process's record, which stats()["per_epoch"] shows when there is no board (the
        board's rows hold them, node-wide, when there is one)."""
        row = self._notes.setdefault(int(epoch), {})
        for k, v in counts.items():
            row[k] = row.get(k, 0) + int(v)

    def close(self) -> None:
        """Leaves the node's job on the cache's board (when this process joined it through this
        node: the job ends with the last node of it in this process, and the last of its
        processes; a driver that runs jobs one after another in one process is not taken for
        several jobs sharing the cache); then stops the prefetcher this node started, unless a
        job still lives on the board (it serves them, and exits after the last:
        Prefetcher.release); stops the cluster (with its peer server) it made from
        torch.distributed. The parts given to it stay their owners'."""
        p, self._prefetcher = self._prefetcher, None
        try:
            if self._boards is not None:
                self._boards.let_go()
            if p is not None:
                if p in _STARTED:
                    _STARTED.remove(p)
                p.release()
            release_handed()
        finally:
            try:
                if self._owns_cluster and self.cluster is not None:
                    self.cluster.close()
            finally:
                if self._boards is not None:
                    self._boards.close()
                _LIVE.discard(self)

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_prefetcher"] = None     # the process that started it stops or releases it
        state["_owns_cluster"] = False  # ... and the cluster it made
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={what}" for name, what in self.tiers())
        return f"<shadecache.Node {parts}; {self.read_plan.describe()}>"


_LIVE = weakref.WeakSet()   # nodes of this process: closed at its exit
_STARTED = []               # the prefetchers nodes of this process started: released at its exit,
#                             also those of a node dropped without close()


@atexit.register
def _stop_prefetchers() -> None:
    """At this process's exit: every live node closed (each lets go of its job, then releases
    the prefetcher it started), then the prefetchers left over, then those handed to other jobs
    that no job needs any more. One that fails does not keep the others open."""
    for node in list(_LIVE):
        try:
            node.close()
        except Exception as e:   # at exit nothing is left to raise to: said, and the rest closed
            print(f"shadecache: closing {node!r} at exit: {e!r}", file=sys.stderr)
    while _STARTED:
        _STARTED.pop().release()
    release_handed()


def _check_plan(plan, store) -> None:
    """ValueError when an extent plan was made for another store (its layout must be of this
    store's samples, in this store's disk order)."""
    if not plan.extents:
        return
    disk_order = getattr(store, "disk_order", None)   # a store wrapped in one of yours may lack it
    same = len(plan.layout) == len(store)
    if same and callable(disk_order):
        same = np.array_equal(plan.layout.by_extent, np.asarray(disk_order(), dtype=np.int64))
    if not same:
        raise ValueError(f"the read plan was made for another store ({len(plan.layout)} samples in "
                         f"another disk order); this one has {len(store)}: make it with "
                         "sc.ReadPlan.of_extents(store, ...) of this store")


def _board_link(cache, streams, create: bool, job: str, score_merge):
    """The link of `job` to the cache's order board (None without a cache); with `create` the
    board is made now when there is none, or made anew in place of a killed job's, and the job
    registered on it (streams: the ranks of this job on this node; its files removed when its
    last process, and the last job, leave), else only looked for when used (and joined then)."""
    if cache is None:
        return None
    from ..lookahead.board import BoardLink, local_ranks
    streams = local_ranks() if streams is None else streams
    link = BoardLink(cache.name, job, cache.num_samples, streams, score_merge=score_merge,
                     counted=True)   # Node.close() closes it: the node's join ends there
    if create:
        link.create(cache.num_samples, streams)
    return link
