"""A training job for tests/cache/test_cache_warm_restart.py, run as its own process:

    python warm_job.py STORE CACHE_NAME OUT_JSON EPOCHS [--wait]

Opens (creates or attaches) the persisted cache of STORE with `sc.Cache.for_store(..., persist=True)`,
sets every sample's importance (a fixed function of the id, as a trained model's losses would),
trains EPOCHS epochs of a tiny model through CachedDataset in a DataLoader, and writes the hit ratio
of each epoch to OUT_JSON. With --wait it then prints READY and sleeps until it is killed.
"""
import json
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import shadecache as sc


def main():
    store_path, name, out, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = sc.PackedStore(store_path)
    n = len(store)
    cap = sc.Cache.capacity_for(n // 2, store.lengths)
    cache = sc.Cache.for_store(name, store, cap, persist=True, policy="importance")
    ids = np.arange(n, dtype=np.int64)
    scores = ((ids * 7919) % 1000 / 1000.0).astype(np.float32)
    ds = sc.CachedDataset(store, cache, decode=lambda b: torch.tensor(float(b[0])))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = {"warm_items": cache.stats()["items"], "scores_before": cache.scores().tolist(), "hit_ratio": []}
    cache.update_scores(ids, scores)
    for _ in range(epochs):
        before = cache.stats()
        for x, _y, _idx in DataLoader(ds, batch_size=32, shuffle=False, num_workers=0):
            loss = model(x[:, None]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = cache.stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        report["hit_ratio"].append(hits / (hits + misses))
    with open(out, "w") as f:
        json.dump(report, f)
    if "--wait" in sys.argv:
        print("READY", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
