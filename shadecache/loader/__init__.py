"""The torch face: a Dataset over the cache, and a loader that assembles batches in-process.

  dataset.py   CachedDataset: a map-style Dataset; a batch of ids through the cache and the tiers
  counters.py  the data set's counters, added to by every process that reads it
  loader.py    CachedLoader: the epoch's batches of ids and their assembly in the training process
  batches.py   what it hands out and where it writes: RaggedBatch, the reused output buffers
  threads.py   its assembly threads
  workers.py   the id batches it gives torch's worker processes (process_workers=)
"""
