"""The sampler's side of the order board: each process publishes its sampler's order on its
stream, moves the cursor as the loader takes ids, and feeds the next uses to the clairvoyant
policy.

ShadeSampler calls publish_ahead (set_epoch, end_epoch) and published_iter (__iter__), and, for
its stall budget, rewrite_published (entries it moved while the epoch runs); readers count their
reads in the epoch of reader_stream. The sampler's board is the node's (sampler.board, given
explicitly: sc.Node makes or attaches it); a sampler without one publishes nothing. What is kept
here is per process (the dicts below are keyed by pid): a forked DataLoader worker never
publishes for its parent.
"""
import os
import weakref

import numpy as np

from .board import OrderBoard

_MY_STREAM: dict = {}  # (pid, board path) -> the stream this process's sampler publishes


def board_of(sampler):
    """The sampler's board (its node's, or the one it was given) while it is current, else None:
    a board its creator unlinked (and maybe made anew) is never published into again."""
    board = getattr(sampler, "board", None)
    if board is None or board.closed or not board.is_current():
        return None
    return board


def reader_stream(board: OrderBoard) -> int:
    """The stream whose epoch this process's reads count in: the one its sampler publishes, else
    the one LOCAL_RANK names (a DataLoader worker of that rank), else stream 0."""
    s = _MY_STREAM.get((os.getpid(), board.path))
    return stream_of(0, board.streams) if s is None else s


def stream_of(rank: int, streams: int) -> int:
    local = os.environ.get("LOCAL_RANK")
    r = int(local) if local is not None and local.isdigit() else int(rank)
    return r % streams


# (pid, board path, stream) -> (board file, epoch, weak reference to the order array, seq after
# the publish) of what this process published last: __iter__ takes that order as it is only when
# the board, the order (the very array: a weak reference keeps nothing alive, and a freed array
# never matches) and the stream's seq (nobody published since) are all still the same
_PUBLISHED: dict = {}


def _up_already(board, s, sampler, order) -> bool:
    got = _PUBLISHED.get((os.getpid(), board.path, s))
    return (got is not None and got[0] == board.identity and got[1] == sampler.epoch
            and got[2]() is order and got[3] == board.orders.stream_state(s)["seq"])


def _publish(sampler, board, s, order):
    """Publishes `order` as the sampler's order of its current epoch on its stream, followed,
    where the board has room and the sampler knows it already (ShadeSampler.next_epoch_order), by
    the next epoch's order: positions go on growing across the boundary, so the prefetcher's window
    and the next uses cross it. Gives every published id its first position (the clairvoyant
    policy's input) on stream `s` (the sampler's: stream_of its rank). Returns how many entries of
    `order` were published."""
    _MY_STREAM[(os.getpid(), board.path)] = s
    node = getattr(sampler, "node", None)
    if node is not None:   # the node reads ahead once an order is up (Node.start_reading_ahead)
        node.start_reading_ahead()
    full = order
    ahead = getattr(sampler, "next_epoch_order", None)
    if ahead is not None and order.size < board.capacity:
        nxt = ahead()
        if nxt is not None and nxt.size:
            full = np.concatenate([order, nxt[:board.capacity - order.size]])
    # What the stream showed until now: ids that drop out of it (a head that was not the epoch
    # that came: set_epoch jumped, a checkpoint was loaded, another rank's share) must get their
    # next use again too, or the policy keeps the stale, sooner one and never evicts them.
    before = board.orders.published(s)
    m = min(board.orders.publish(s, sampler.epoch, full, epoch_length=order.size), order.size)
    changed = np.unique(np.concatenate([full[:board.capacity], before]))
    _push_next_use(sampler.cache, board, changed)
    if sampler.cache is not None:   # what this job still reads changed: the merge ("uses")
        board.merge.uses(sampler.cache, changed)
    for k in [k for k, v in _PUBLISHED.items() if v[2]() is None]:
        del _PUBLISHED[k]         # orders freed since: their entries can never match again
    _PUBLISHED[(os.getpid(), board.path, s)] = (board.identity, sampler.epoch, weakref.ref(order),
                                               board.orders.stream_state(s)["seq"])
    return m


def publish_ahead(sampler, draw=None) -> bool:
    """ShadeSampler.set_epoch's and end_epoch's hook: draws the current epoch's order and
    publishes it now, before the loader asks for its first batch, so that the prefetcher starts
    reading the epoch's first misses while the training loop is elsewhere (evaluation, a
    checkpoint, the epoch's last step). Does nothing without a board or when this very order is
    already up. __iter__ then takes the published order as it is (published_iter). draw(): the
    sampler's order, drawn only when there is a board (default sampler.order)."""
    board = board_of(sampler)
    if board is None:
        return False
    order = (sampler.order if draw is None else draw)()
    s = stream_of(getattr(sampler, "rank", 0), board.streams)
    if _up_already(board, s, sampler, order):
        return False
    _publish(sampler, board, s, order)
    return True


def published_iter(sampler, order: np.ndarray, start: int, plan=None):
    """ShadeSampler.__iter__'s hook: publishes the epoch's order when the sampler's cache has a
    board (unless publish_ahead already put this very order up and nothing of it was taken), and
    returns the iterator of order[start:] that moves the board's cursor as the DataLoader takes
    ids (and the next uses of the ids taken, for the clairvoyant policy). plan(k): called before
    the ids of each batch (positions k.. up to the next multiple of the batch size) are read from
    `order`; it may rewrite order[k:] in place (and show it on the board: rewrite_published)."""
    board = board_of(sampler)
    step = max(1, int(getattr(sampler, "batch_size", 64)))
    if board is None:
        if plan is None:
            return iter(order[start:].tolist())
        return _planned(order, start, step, plan)
    s = stream_of(getattr(sampler, "rank", 0), board.streams)
    if start == 0 and _up_already(board, s, sampler, order) and board.orders.stream_state(s)["cursor"] == 0:
        _MY_STREAM[(os.getpid(), board.path)] = s
        m = min(order.size, board.capacity)
    else:
        m = _publish(sampler, board, s, order)
    return _tracked(board, s, order, start, m, sampler.cache, step, plan)


def rewrite_published(sampler, order: np.ndarray, positions: np.ndarray, lo: int) -> None:
    """The sampler changed entries `positions` (all >= lo, not taken by the loader yet) of its
    epoch's `order` while the epoch runs (the stall budget): its stream on the cache's board shows
    the new ids there, and the next uses of the ids that left or entered go to the clairvoyant
    policy. Nothing without a board."""
    board = board_of(sampler)
    if board is None or not len(positions):
        return
    touched = board.orders.rewrite(stream_of(getattr(sampler, "rank", 0), board.streams), positions,
                            order[positions], lo=lo)
    _push_next_use(sampler.cache, board, touched)
    if sampler.cache is not None:   # a repeat in place of a miss changes what the job still reads
        board.merge.uses(sampler.cache, touched)


def _batches(order, start, step, plan):
    """(k, ids of the batch from position k) for each batch of order[start:], the ids read after
    plan(k) ran."""
    k = start
    while k < order.size:
        end = min((k // step + 1) * step, order.size)
        if plan is not None:
            plan(k)
        yield k, order[k:end].tolist()
        k = end


def _planned(order, start, step, plan):
    for _, ids in _batches(order, start, step, plan):
        yield from ids


def _next_use_setter(cache):
    """cache.set_next_use when the cache's policy keys on next use (clairvoyant), else None."""
    if cache is None or not getattr(cache, "keys_on_next_use", False):
        return None
    return getattr(cache, "set_next_use", None)


def _push_next_use(cache, board, ids):
    setter = _next_use_setter(cache)   # the clairvoyant policy's input
    if setter is not None and ids.size:
        setter(ids, board.orders.next_use(ids))


def _tracked(board, s, order, start, m, cache, step, plan=None):
    setter = _next_use_setter(cache)
    if start:
        board.orders.consumed(s, 0, min(start, m))
    done = used = min(start, m)   # entries [0, done) taken by the loader; [0, used) consumed
    board.orders.set_cursor(s, done)

    def consume(upto):
        nonlocal used
        if upto > used:
            taken = board.orders.consumed(s, used, upto)
            if setter is not None:
                _push_next_use(cache, board, taken)
            if cache is not None:
                board.merge.uses(cache, taken)
            used = upto

    k = start
    for _, ids in _batches(order, start, step, plan):
        for i in ids:
            k += 1
            # At every batch boundary the cursor moves past the batch just taken, and the next use
            # of its ids moves to the read after it (their read is now; what matters for keeping
            # them is the next one). With a prefetcher running, that move waits one batch: the
            # loader is still reading the batch it just took, and a sample whose next use looked
            # "none" would be the first that the prefetcher's room-making and the clairvoyant
            # policy evict, under the very read that needs it. (Without one, the immediate move
            # lets the policy refuse a demand miss that is not read again: Belady's bypass.)
            if k - done >= step and done < m:
                last = min(k, m)
                board.orders.set_cursor(s, last)
                consume(done if board.control.prefetcher_pid else last)
                done = last
            yield i
    consume(m)
    board.orders.set_cursor(s, m)
