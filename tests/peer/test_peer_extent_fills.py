"""A peer server of a node under the extent plan fills the misses of all its connections through
one tier chain and one stage of extent mates (shadecache/extent_reads.py MateStage), from as many
threads as it has connections: every value served must be the store's, and the stage's byte
count must stay the bytes it holds."""
import os
import sys
import threading
import uuid

import numpy as np

import shadecache as sc
from shadecache.peer import PeerClient, new_secret
from shadecache.peer.server import PeerService
from shadecache.read_plan import ReadPlan

N = 3000
SECRET = new_secret()


def test_concurrent_fills_keep_the_servers_stage_whole(tmp_path):
    path = str(tmp_path / "s.shc")
    rng = np.random.default_rng(5)
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(rng.integers(0, 256, 1500 + (i * 37) % 900, dtype=np.uint8).tobytes(), i % 10)
    store = sc.PackedStore(path)
    truth = store.read_many(list(range(N)))
    name = f"t-pxf-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = sc.Cache.create(name, N, sc.Cache.capacity_for(200, store.lengths), policy="importance",
                            sizes=store.lengths, fingerprint=store.fingerprint)
    node = sc.Node(store, cache, read_plan=ReadPlan.of_extents(store, 64 << 10), read_ahead=False)
    service = PeerService(node, "127.0.0.1", 0, SECRET)
    service.start()
    wrong, errors = [], []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)     # threads interleave at any bytecode, as on many cores
    try:
        def client(seed):
            try:
                c = PeerClient(service.address, SECRET, store)
                r = np.random.default_rng(seed)
                for _ in range(60):
                    ids = r.choice(N, 48, replace=False)
                    for i, v in zip(ids.tolist(), c.get_many(ids, timeout=10.0)):
                        if v is not None and v != truth[i]:
                            wrong.append(i)
                c.close()
            except BaseException as e:   # noqa: BLE001 (the test reports it)
                errors.append(e)
        threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(switch)
        service.close()
    stage = service.misses.chain.extents().stage
    counted = sum(len(v) for v, _ in stage._d.values())
    try:
        assert not errors and not wrong, (errors[:3], wrong[:5])
        assert service.counters["errors"] == 0
        # the cache (importance, equal scores) refuses once full, so mates wait in the stage
        assert len(stage) > 0
        # its byte count is the bytes it holds: its room decides how many mates a read keeps
        assert stage._bytes == counted, (stage._bytes, counted)
        assert 0 <= stage._bytes <= stage.capacity
    finally:
        cache.close()
        cache.unlink()
        store.close()
