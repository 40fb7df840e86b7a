"""Reading the future: the published sample order and what uses it.

  board.py       OrderBoard: each rank's upcoming order in the node's shared memory (layout,
                 seqlock, next uses, the prefetcher's flags and counters)
  publish.py     the sampler's side: find a cache's board, publish an epoch's order, move the
                 cursor, feed next uses to the clairvoyant policy
  belady.py      belady_hits: the offline bound on a known sequence of reads
  prefetcher.py  Prefetcher: the node's process that reads the upcoming misses ahead of the loader
"""
