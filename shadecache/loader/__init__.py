"""The torch face: a Dataset over the cache, and a loader that assembles batches in-process.

  dataset.py  CachedDataset: a map-style Dataset; a batch of ids through the cache and the tiers
  loader.py   CachedLoader: batches assembled in the training process (RaggedBatch for
              variable-size samples)
"""
