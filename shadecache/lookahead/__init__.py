"""Reading the future: the published sample order and what uses it.

  board.py       OrderBoard: each rank's upcoming order in the node's shared memory, the
                 sampler's publishing hooks, next uses for the clairvoyant policy, belady_hits
  prefetcher.py  Prefetcher: the node's process that reads the upcoming misses ahead of the loader
"""
