"""Which samples to read, and in what order.

  importance.py  SHADE's per-sample importance: rank weights of a minibatch's losses, the score
                 table (ImportanceTable)
  sampler.py     ShadeSampler: importance sampling with cache-aware ordering (a torch Sampler)
"""
