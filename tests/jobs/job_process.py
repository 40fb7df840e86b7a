"""One training job in a process of its own, for tests/jobs: a node of job argv's "job" over a
CountingStore and the cache the test made, ShadeSampler (stall_budget 0: exact permutations), a
CachedLoader, a small model; prints one JSON line per epoch (the ids in the order trained, hits)
and "ready"/"done" lines; with "start_file", it starts its epochs once that file exists. With "hold": after its first epoch it prints "holding" and waits to be
killed, a pinned view of a cached sample in hand."""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import shadecache as sc
from counting_store import CountingStore


def main(cfg: dict) -> int:
    torch.set_num_threads(1)
    store = CountingStore(cfg["path"], cfg["count_file"], cfg.get("delay_s", 0.0))
    cache = sc.Cache.attach(cfg["cache"])
    node = sc.Node(store, cache, job=cfg["job"], read_plan="samples",
                   score_merge=cfg.get("rule"), prefetch=dict(lookahead_samples=cfg.get("lookahead", 256)))
    sampler = node.sampler(batch_size=cfg["batch"], seed=cfg["seed"], stall_budget=0.0)
    loader = sc.CachedLoader(node.dataset(), batch_size=cfg["batch"], sampler=sampler, num_workers=1,
                             batch_transform=lambda x: x[:, :16].float() / 255.0)
    torch.manual_seed(cfg["seed"])
    model = torch.nn.Linear(16, 10)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05))
    print(json.dumps({"ready": True, "slot": node.board.slot}), flush=True)
    while cfg.get("start_file") and not os.path.exists(cfg["start_file"]):
        time.sleep(0.01)          # the jobs of a test start together
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        ids, hits0 = [], node.stats()["hits"]
        for x, y, idx in loader:
            losses = F.cross_entropy(model(x), y, reduction="none")
            sampler.update(idx, losses.detach())
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
            ids.extend(idx.tolist())
            time.sleep(cfg.get("step_s", 0.0))
        sampler.end_epoch()
        print(json.dumps({"epoch": epoch, "ids": ids, "hits": node.stats()["hits"] - hits0}), flush=True)
        if cfg.get("hold"):
            cached = np.flatnonzero(np.asarray(cache.cached_mask(), dtype=bool))
            view = cache.view(int(cached[0]))
            print(json.dumps({"holding": view is not None}), flush=True)
            time.sleep(600)
    st = node.stats()
    print(json.dumps({"done": True, "followed": sampler.follow_history, "store_reads": st["store_reads"],
                      "prefetch_hits": st["prefetch_hits"], "wait_s": st["wait_s"]}), flush=True)
    node.close()
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
