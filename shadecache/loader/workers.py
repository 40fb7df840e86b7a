"""The batches of ids a CachedLoader hands its process workers (torch's DataLoader workers, when
batches are made per sample in other processes: process_workers=W)."""


class IdBatches:
    """A loader's batches of ids (lists) as a DataLoader batch_sampler: iterated in this process
    only, so resume (skip) and epoch bookkeeping stay the loader's."""

    def __init__(self, batches, n):
        self._batches = batches
        self._n = n

    def __iter__(self):
        for ids in self._batches():
            yield ids.tolist()

    def __len__(self):
        return self._n
