"""One training run in a process of its own, for the reproducibility test: a node over the store
at argv[1] with the defaults, a ShadeSampler with seed argv[2], a stock DataLoader with argv[3]
workers, stalls argv[4] ("on"/"off"), a small deterministic model; prints JSON: the read plan,
each epoch's ids in the order trained, and each batch's mean loss."""
import json
import os
import sys
import uuid

import torch
import torch.nn.functional as F

import shadecache as sc

EPOCHS, BATCH, FEATURES = 2, 64, 64


def main(path: str, seed: int, workers: int, stalls: bool) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = sc.PackedStore(path)
    name = f"t-repro-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    capacity = sc.Cache.capacity_for(len(store) // 5, store.lengths)
    out = {"epochs": [], "losses": []}
    with sc.Cache.for_store(name, store, capacity_bytes=capacity, attach=False) as cache:
        node = sc.Node(store, cache)
        out["read_plan"] = node.read_plan.state()
        sampler = node.sampler(batch_size=BATCH, seed=seed, stalls=stalls)
        loader = torch.utils.data.DataLoader(node.dataset(), batch_size=BATCH, sampler=sampler,
                                             num_workers=workers)
        model = torch.nn.Linear(FEATURES, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            ids = []
            for x, y, idx in loader:
                losses = F.cross_entropy(model(x[:, :FEATURES].float() / 255), y, reduction="none")
                sampler.update(idx, losses.detach())
                losses.mean().backward()
                opt.step()
                opt.zero_grad()
                ids.extend(idx.tolist())
                out["losses"].append(float(losses.mean()))
            sampler.end_epoch()
            out["epochs"].append(ids)
        node.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "on")))
