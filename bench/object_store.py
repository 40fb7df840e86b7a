"""The packed store on object storage: SeaweedFS (bench/seaweed.py) behind the fault proxy
(bench/s3_proxy.py) shaped like S3 (20 ms before each response, 50 MB/s a connection, 100 MB/s
in all), everything counted at the proxy.

    python bench/object_store.py                       # every section
    python bench/object_store.py --sections cold,bound --quick

Sections (each prints a table; each row says the command that reproduces it):
  clients  the client libraries on the same GETs: 4 KiB ranged GETs (requests/s, client CPU per
           GET) and 8 MiB ranged GETs, 4 threads (MiB/s, CPU per GET), straight to SeaweedFS and
           through the proxy: boto3/botocore, obstore, http.client + botocore's SigV4
  cold     one cold pass over a store (3 KB samples) in the store's disk order, as whole extents
           through S3Store.stream (the prefetcher's path): bytes/s against the proxy's cap, GETs
           against data / 8 MiB
  bound    2 ranks x 4 DataLoader workers reading the object directly (no cache), connections=4:
           requests in flight at the proxy at most, connections open at most
  first    time to the first batch of a store of 10 million samples: open (header, directory)
           plus one batch of 256 random ids, cold and with the directory kept on local disk
  faults   epochs through CachedLoader (cache 20%, SSD tier 30%, extent order) with 2% of GETs
           answered 503 and 1% of responses reset or truncated: every sample's bytes against
           the file's, the retries stats() counted
  credentials  (not in the default list) --minutes of reads with credentials that expire every
           --expiry seconds (a credential source of this script's, enforced by the proxy): failed
           requests, refreshes
Writes bench/out/object_store.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from s3_proxy import ProxyProcess  # noqa: E402
from seaweed import REGION, SeaweedServer  # noqa: E402

LATENCY, CONN_BPS, TOTAL_BPS = 0.020, 50e6, 100e6
MiB = 1 << 20


def cmd(section: str, quick: bool) -> str:
    return f"python bench/object_store.py --sections {section}" + (" --quick" if quick else "")


def pack_random(path: str, n: int, size: int, seed: int = 0) -> None:
    """n samples of `size` bytes cut from a seeded random pool; label i % 100."""
    import shadecache as sc
    pool = np.random.default_rng(seed).bytes(max(64 * MiB, 2 * size))
    span = len(pool) - size
    with sc.PackWriter(path) as w:
        for i in range(n):
            o = (i * 4099 + 17) % span
            w.add(pool[o:o + size], i % 100)


def upload(s3, path: str, key: str) -> str:
    from shadecache.store.object_client import ObjectClient
    ObjectClient(endpoint_url=s3.endpoint).upload_file(path, s3.bucket, key)
    return f"s3://{s3.bucket}/{key}"


def shaped_proxy(s3) -> ProxyProcess:
    return ProxyProcess(s3.port, latency=LATENCY, conn_bps=CONN_BPS, total_bps=TOTAL_BPS)


# ---- clients ---------------------------------------------------------------------------------

def section_clients(s3, work, quick):
    import http.client

    import botocore.session
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config

    size = 64 * MiB
    s3.client().put_object(Bucket=s3.bucket, Key="clients", Body=os.urandom(size))
    n_small, n_big = (100, 8) if quick else (400, 24)
    rows = []
    proxy = ProxyProcess(s3.port)   # no latency, no caps: what the client itself costs
    try:
        for where, endpoint in (("server", s3.endpoint), ("proxy", proxy.endpoint)):
            port = int(endpoint.rsplit(":", 1)[1])
            session = botocore.session.get_session()
            b3 = session.create_client("s3", endpoint_url=endpoint, region_name=REGION,
                                       config=Config(max_pool_connections=8,
                                                     retries={"total_max_attempts": 1}))

            def boto(o, n, c=b3):
                return c.get_object(Bucket=s3.bucket, Key="clients", Range=f"bytes={o}-{o + n - 1}")["Body"].read()
            clients = {"boto3/botocore": boto}
            try:
                import obstore
                from obstore.store import S3Store as ObStore
                ob = ObStore(s3.bucket, endpoint=endpoint, region=REGION,
                             client_options={"allow_http": True})
                clients["obstore"] = lambda o, n: obstore.get_range(ob, "clients", start=o, length=n)
            except ImportError as e:
                print(f"  obstore left out: {e}")
            creds = session.get_credentials().get_frozen_credentials()
            local = threading.local()

            def raw(o, n):
                c = getattr(local, "c", None)
                if c is None:
                    c = local.c = http.client.HTTPConnection("127.0.0.1", port)
                req = AWSRequest(method="GET", url=f"{endpoint}/{s3.bucket}/clients",
                                 headers={"Range": f"bytes={o}-{o + n - 1}"})
                S3SigV4Auth(creds, "s3", REGION).add_auth(req)
                c.request("GET", f"/{s3.bucket}/clients", headers=dict(req.headers.items()))
                r = c.getresponse()
                buf = bytearray(n)
                view, got = memoryview(buf), 0
                while got < n:
                    k = r.readinto(view[got:])
                    if not k:
                        raise ConnectionError("short body")
                    got += k
                return buf
            clients["http.client + SigV4"] = raw
            for name, get in clients.items():
                for rep in range(3):
                    t, c = time.perf_counter(), time.process_time()
                    for i in range(n_small):
                        get((i * 7 * 4096) % (size - 4096), 4096)
                    small = (n_small / (time.perf_counter() - t), 1e6 * (time.process_time() - c) / n_small)
                    from concurrent.futures import ThreadPoolExecutor
                    t, c = time.perf_counter(), time.process_time()
                    with ThreadPoolExecutor(4) as ex:
                        list(ex.map(lambda i: get((i * 8 * MiB) % (size - 8 * MiB), 8 * MiB), range(n_big)))
                    big = (n_big * 8 / (time.perf_counter() - t), 1e3 * (time.process_time() - c) / n_big)
                    rows.append({"where": where, "client": name, "rep": rep, "small_per_s": small[0],
                                 "small_cpu_us": small[1], "big_mib_s": big[0], "big_cpu_ms": big[1]})
    finally:
        proxy.stop()
    print("\n| to | client | 4 KiB GETs/s | CPU per 4 KiB GET | 8 MiB GETs x4 threads, MiB/s | CPU per 8 MiB GET |")
    print("|---|---|---|---|---|---|")
    for where in ("server", "proxy"):
        for name in dict.fromkeys(r["client"] for r in rows):
            rs = [r for r in rows if r["where"] == where and r["client"] == name]
            if not rs:
                continue
            med = {k: float(np.median([r[k] for r in rs])) for k in ("small_per_s", "small_cpu_us", "big_mib_s", "big_cpu_ms")}
            print(f"| {where} | {name} | {med['small_per_s']:,.0f} | {med['small_cpu_us']:,.0f} us | "
                  f"{med['big_mib_s']:,.0f} | {med['big_cpu_ms']:.1f} ms |")
    print(f"(medians of 3; `{cmd('clients', quick)}`)")
    return rows


# ---- cold ------------------------------------------------------------------------------------

def section_cold(s3, work, quick):
    import shadecache as sc
    n, size = (10_000, 3_000) if quick else (40_000, 3_000)
    path = os.path.join(work, "cold.shc")
    pack_random(path, n, size)
    url = upload(s3, path, "cold.shc")
    rows = []
    with shaped_proxy(s3) as px:
        for rep in range(3):
            store = sc.S3Store(url, endpoint_url=px.endpoint, connections=8)
            # the extents of the node's extent plan (read_plan.py): what its order asks for
            from shadecache.read_plan import ReadPlan
            layout = ReadPlan.of_extents(store).layout
            batches = [layout.by_extent[layout.first[e]:layout.first[e + 1]] for e in range(layout.extents)]
            px.reset()
            t = time.perf_counter()
            got = 0
            with store.stream() as s:
                depth = 4
                for b in batches[:depth]:
                    s.submit(b)
                for k in range(len(batches)):
                    got += sum(len(v) for v in s.take())
                    if k + depth < len(batches):
                        s.submit(batches[k + depth])
            dt = time.perf_counter() - t
            st = px.stats()
            data = store.data_bytes
            rows.append({"rep": rep, "seconds": dt, "bytes_per_s": st["get_bytes"] / dt,
                         "of_cap": st["get_bytes"] / dt / TOTAL_BPS, "gets": st["gets"],
                         "gets_per_8mib": st["gets"] / (data / (8 * MiB)), "read_x": st["get_bytes"] / data,
                         "in_flight_max": st["in_flight_max"], "samples_ok": got == data})
    print(f"\ncold pass over {n:,} x {size:,} B ({n * size / MiB:.0f} MiB) in disk order, whole extents "
          f"of the sampler's layout (8 MiB), 4 batches in flight, S3Store.stream; proxy: {LATENCY * 1e3:.0f} ms, "
          f"{CONN_BPS / 1e6:.0f} MB/s a connection, {TOTAL_BPS / 1e6:.0f} MB/s in all")
    print("| rep | MB/s | of the cap | GETs | GETs / (data / 8 MiB) | bytes / data | in flight max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rep']} | {r['bytes_per_s'] / 1e6:.1f} | {r['of_cap']:.2f}x | {r['gets']} | "
              f"{r['gets_per_8mib']:.2f} | {r['read_x']:.3f} | {r['in_flight_max']} |")
    print(f"(`{cmd('cold', quick)}`)")
    return rows


# ---- bound -----------------------------------------------------------------------------------

_RANK = r"""
import os, sys, numpy as np, torch
import shadecache as sc
store = sc.S3Store(sys.argv[1], endpoint_url=sys.argv[2], connections=int(sys.argv[3]),
                   gap_bytes=0, max_extent_bytes=64 << 10)
rank = int(sys.argv[4])
ids = np.random.default_rng(rank).permutation(len(store))[: int(sys.argv[5])]
loader = torch.utils.data.DataLoader(store, batch_size=64, sampler=ids.tolist(), num_workers=4,
                                     collate_fn=lambda items: len(items))
print(sum(loader))
"""


def section_bound(s3, work, quick):
    n, size = 20_000, 3_000
    path = os.path.join(work, "bound.shc")
    pack_random(path, n, size)
    url = upload(s3, path, "bound.shc")
    bound = 4
    rows = []
    with shaped_proxy(s3) as px:
        px.reset()
        per_rank = 2_000 if quick else 6_000
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        t = time.perf_counter()
        ranks = [subprocess.Popen([sys.executable, "-c", _RANK, url, px.endpoint, str(bound), str(r),
                                   str(per_rank)], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [int(p.communicate()[0].strip() or -1) for p in ranks]
        dt = time.perf_counter() - t
        st = px.stats()
        rows.append({"ranks": 2, "workers": 4, "bound": bound, "samples": outs, "seconds": dt,
                     "gets": st["gets"], "in_flight_max": st["in_flight_max"],
                     "connections_max": st["connections_max"]})
    r = rows[0]
    print(f"\n2 ranks x 4 DataLoader workers (forked), each process reading the object directly "
          f"(S3Store, connections={bound}, one GET per sample)")
    print("| processes | configured bound | GETs | requests in flight at the proxy, at most | "
          "connections open at the proxy, at most | samples | s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 2 x (1 + 4) | {bound} | {r['gets']:,} | {r['in_flight_max']} | {r['connections_max']} | "
          f"{sum(r['samples']):,} | {r['seconds']:.1f} |")
    print(f"(`{cmd('bound', quick)}`)")
    return rows


# ---- first batch -----------------------------------------------------------------------------

def section_first(s3, work, quick):
    import shadecache as sc
    n = 1_000_000 if quick else 10_000_000
    path = os.path.join(work, "first.shc")
    t = time.perf_counter()
    pack_random(path, n, 16)
    packed_s = time.perf_counter() - t
    url = upload(s3, path, "first.shc")
    size = os.path.getsize(path)
    os.unlink(path)
    rows = []
    cache_dir = os.path.join(work, "dircache")
    with shaped_proxy(s3) as px:
        for label, keep in (("cold", None), ("cold, keeps it", cache_dir), ("kept on local disk", cache_dir),
                            ("cold", None), ("kept on local disk", cache_dir)):
            px.reset()
            t = time.perf_counter()
            store = sc.S3Store(url, endpoint_url=px.endpoint, cache_dir=keep)
            opened = time.perf_counter() - t
            ids = np.random.default_rng(0).integers(0, n, 256)
            store.read_many(ids)
            first = time.perf_counter() - t
            st = px.stats()
            rows.append({"case": label, "open_s": opened, "first_batch_s": first, "gets": st["gets"],
                         "bytes": st["get_bytes"]})
            del store
    print(f"\ntime to the first batch (256 random ids) of a store of {n:,} samples "
          f"({size / MiB:.0f} MiB, directory {rows[0]['bytes'] / MiB:.0f} MiB fetched; packed in {packed_s:.0f} s)")
    print("| directory | open s | first batch s | GETs | MiB fetched |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['open_s']:.2f} | {r['first_batch_s']:.2f} | {r['gets']} | {r['bytes'] / MiB:.1f} |")
    print(f"(`{cmd('first', quick)}`)")
    return rows


# ---- faults ----------------------------------------------------------------------------------

def section_faults(s3, work, quick):
    import uuid

    import shadecache as sc
    n, size = (6_000, 3_000) if quick else (40_000, 3_000)
    path = os.path.join(work, "faults.shc")
    pack_random(path, n, size)
    url = upload(s3, path, "faults.shc")
    local = sc.PackedStore(path)
    rows = []
    with shaped_proxy(s3) as px:
        px.configure(p503=0.02, preset=0.005, ptruncate=0.005)
        # extents of 1 MiB (gap 64 KiB): GETs enough for faults at these rates to happen
        store = sc.S3Store(url, endpoint_url=px.endpoint, gap_bytes=64 << 10)
        data = store.data_bytes
        cache = sc.Cache.create(f"objbench-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_samples=n,
                                capacity_bytes=int(0.2 * data), policy="importance")
        ssd = sc.SSDTier(os.path.join(work, "faults-ssd"), capacity_bytes=int(0.3 * data), cache=cache)
        try:
            ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset(decode=bytes)
            sampler = sc.ShadeSampler(ds, batch_size=256, rep_factor=0, seed=0)
            loader = sc.CachedLoader(ds, batch_size=256, sampler=sampler, num_workers=2,
                                     collate=lambda items: items)
            for epoch in range(6):
                sampler.set_epoch(epoch)
                px.reset()
                t = time.perf_counter()
                seen = wrong = 0
                for batch in loader:
                    for x, y, i in batch:
                        seen += 1
                        wrong += x != local.read(int(i))
                sampler.end_epoch()
                dt = time.perf_counter() - t
                st, c = px.stats(), store.stats()["client"]
                rows.append({"epoch": epoch, "samples": seen, "wrong": wrong, "seconds": dt,
                             "gets": st["gets"], "injected_503": st["injected_503"],
                             "injected_reset": st["injected_reset"], "injected_truncate": st["injected_truncate"],
                             "retries_total": c["retries"], "throttled_total": c["throttled"],
                             "broken_total": c["broken"]})
        finally:
            ssd.close()
            cache.close()
            cache.unlink()
    print(f"\nfaults: {n:,} x {size:,} B through CachedLoader (cache 20%, SSD tier 30%, extent order, "
          "extents of 1 MiB), the proxy answering 2% of GETs 503 SlowDown, resetting 0.5% and truncating 0.5% of responses")
    print("| epoch | samples | wrong bytes | GETs | 503 / resets / truncations injected | retries counted (so far) | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['epoch']} | {r['samples']:,} | {r['wrong']} | {r['gets']} | {r['injected_503']} / "
              f"{r['injected_reset']} / {r['injected_truncate']} | {r['retries_total']} (503: "
              f"{r['throttled_total']}, broken: {r['broken_total']}) | {r['seconds']:.1f} |")
    print(f"(`{cmd('faults', quick)}`)")
    return rows


# ---- credentials -------------------------------------------------------------------------------

class _ExpiringCredentials:
    """This script's credential source: the server's identity with a session token that the proxy
    refuses `life` seconds after it was handed out (bench/s3_proxy.py, expired_tokens)."""

    def __init__(self, life: float):
        self.life = life

    def __call__(self):
        import datetime

        from seaweed import ACCESS_KEY, SECRET_KEY
        exp = int(time.time() + self.life)
        return {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "token": f"expires-{exp}-bench",
                "expiry_time": datetime.datetime.fromtimestamp(exp, datetime.timezone.utc)}


def section_credentials(s3, work, quick, minutes: float = 6.0, expiry: float = 120.0):
    import shadecache as sc
    if quick:
        minutes, expiry = 0.5, 10.0
    path = os.path.join(work, "creds.shc")
    pack_random(path, 20_000, 3_000)
    url = upload(s3, path, "creds.shc")
    local = sc.PackedStore(path)
    with shaped_proxy(s3) as px:
        px.configure(expired_tokens=True)
        store = sc.S3Store(url, endpoint_url=px.endpoint, credentials=_ExpiringCredentials(expiry),
                           gap_bytes=0)
        rng = np.random.default_rng(0)
        t0 = time.monotonic()
        batches = failed = wrong = 0
        while time.monotonic() - t0 < minutes * 60:
            ids = rng.integers(0, len(local), 64)
            try:
                wrong += store.read_many(ids) != local.read_many(ids)
            except Exception as e:   # what would reach the loader
                failed += 1
                print(f"  failed: {type(e).__name__}: {e}")
            batches += 1
            time.sleep(0.05)
        st, c = px.stats(), store.stats()["client"]
    row = {"minutes": minutes, "expiry_s": expiry, "batches": batches, "failed": failed, "wrong": wrong,
           "expired_refused": st["expired_refused"], "refreshed_on_refusal": c["credential_refreshes"],
           "gets": st["gets"]}
    print(f"\ncredentials that expire every {expiry:.0f} s, {minutes:g} minutes of batches of 64 random ids")
    print("| batches | GETs | failed batches | wrong bytes | refused as expired at the proxy | refreshed after a refusal |")
    print("|---|---|---|---|---|---|")
    print(f"| {batches:,} | {row['gets']:,} | {failed} | {wrong} | {row['expired_refused']} | {row['refreshed_on_refusal']} |")
    print(f"(`{cmd('credentials', quick)}`)")
    return [row]


SECTIONS = {"clients": section_clients, "cold": section_cold, "bound": section_bound, "first": section_first,
            "faults": section_faults}
EXTRA = {"credentials": section_credentials}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="smaller stores (seconds, not minutes)")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "object_store.json"))
    args = ap.parse_args(argv)
    results = {"quick": args.quick, "proxy": {"latency_s": LATENCY, "conn_bps": CONN_BPS, "total_bps": TOTAL_BPS}}
    work = tempfile.mkdtemp(prefix="shadecache-objbench-", dir=args.workdir)
    try:
        with SeaweedServer(work) as s3:
            os.environ.update(s3.env)
            os.environ.setdefault("SHADECACHE_SLOT_DIR", os.path.join(work, "slots"))
            for name in [s for s in args.sections.split(",") if s]:
                results[name] = {**SECTIONS, **EXTRA}[name](s3, work, args.quick)
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
