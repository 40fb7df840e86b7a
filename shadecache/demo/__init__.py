"""The data and the training harness behind `shadecache demo` and the training benchmarks.

  synthetic.py   a small, real, seeded image data set made locally (noisy oriented gratings)
  experiment.py  one training run through the cache, store, sampler and DataLoader, and its table
"""
