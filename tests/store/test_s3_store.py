"""The packed store as an object on a real S3 server (SeaweedFS): the same bytes, labels and
fingerprint as the file, packing into and from objects, the CLI, pinning, clear errors."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import shadecache as sc
from s3_data import local_store, upload
from shadecache.store.object_client import ObjectClient


@pytest.fixture
def pair(s3, tmp_path):
    local = local_store(tmp_path / "a.shc")
    return local, upload(s3, tmp_path / "a.shc")


def test_an_object_reads_as_its_file(pair):
    local, url = pair
    store = sc.PackedStore(url)
    assert isinstance(store, sc.S3Store) and len(store) == len(local)
    assert store.fingerprint == local.fingerprint
    assert store.labels.tolist() == local.labels.tolist()
    assert store.lengths.tolist() == local.lengths.tolist()
    assert store.disk_order().tolist() == local.disk_order().tolist()
    assert store.classes == local.classes and store.placement == local.placement
    ids = np.random.default_rng(1).permutation(len(local))[:700].tolist() + [5, 5, 0]
    assert store.read_many(ids) == local.read_many(ids)
    assert store.read(17) == local.read(17) and store[3] == local[3]
    c = store.io_counters()
    assert c["samples"] == len(ids) + 1 + 1 and c["requests"] >= 1
    again = pickle.loads(pickle.dumps(store))      # a spawned worker: reopened on the same ETag
    assert again.etag == store.etag and again.read_many(ids[:50]) == local.read_many(ids[:50])


def test_pack_writes_an_object_and_reads_one_back(s3, tmp_path):
    local = local_store(tmp_path / "a.shc", n=500)
    url = f"s3://{s3.bucket}/packed/x.shc"
    assert sc.pack(local, url, progress=False) == 500
    store = sc.PackedStore(url)
    assert store.read_many(range(500)) == local.read_many(range(500))
    # and from the object to a file
    assert sc.pack(url, tmp_path / "back.shc", progress=False) == 500
    back = sc.PackedStore(tmp_path / "back.shc")
    assert back.read_many(range(500)) == local.read_many(range(500))
    assert back.meta["converted_from"]["path"] == url


def test_a_failed_pack_leaves_the_older_object(s3, tmp_path):
    local_store(tmp_path / "a.shc", n=100)
    url = upload(s3, tmp_path / "a.shc")
    before = sc.PackedStore(url).fingerprint

    class Breaks:
        def __len__(self):
            return 50

        def __getitem__(self, i):
            if i == 30:
                raise RuntimeError("the source broke")
            return b"x" * 10, 0
    with pytest.raises(RuntimeError, match="the source broke"):
        sc.pack(Breaks(), url, progress=False)
    assert sc.PackedStore(url).fingerprint == before
    # an upload that fails part way is aborted: no object, no upload left behind
    client = ObjectClient()
    fresh = f"s3://{s3.bucket}/never.shc"
    big = tmp_path / "big.shc"
    local_store(big, n=300, low=40_000, high=40_001)

    def broken_part(*a, **k):
        raise OSError("the disk went away")
    calls = []
    real = client._request

    def request(url_, what, call):
        calls.append(what)
        if what.startswith("UploadPart 2"):
            return broken_part()
        return real(url_, what, call)
    client._request = request
    with pytest.raises(OSError, match="the disk went away"):
        client.upload_file(str(big), s3.bucket, "never.shc", part_bytes=5 << 20)
    assert "AbortMultipartUpload" in calls
    with pytest.raises(FileNotFoundError, match="never.shc"):
        sc.PackedStore(fresh)
    uploads = s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"] == "never.shc"]


def test_a_replaced_object_is_an_error_naming_it(pair, s3, tmp_path):
    local, url = pair
    store = sc.PackedStore(url)
    store.read_many([1, 2])
    local_store(tmp_path / "b.shc", n=3000, seed=9)
    s3.client().put_object(Bucket=s3.bucket, Key=url.split("/", 3)[3], Body=(tmp_path / "b.shc").read_bytes())
    with pytest.raises(sc.ObjectChangedError, match=url.replace(".", r"\.")):
        store.read_many(list(range(0, 3000, 7)))
    with pytest.raises(sc.ObjectChangedError, match="replaced"):
        pickle.loads(pickle.dumps(store))       # a worker reopening on the old ETag
    assert sc.PackedStore(url).fingerprint != local.fingerprint   # a new open takes the new one


def test_a_corrupt_sample_in_the_object_names_its_id(s3, tmp_path):
    local = local_store(tmp_path / "a.shc", n=400)
    victim = 123
    data = bytearray((tmp_path / "a.shc").read_bytes())
    data[local.offset(victim) + 3] ^= 0xFF
    key = "corrupt.shc"
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    store = sc.PackedStore(f"s3://{s3.bucket}/{key}")
    assert store.read_many([1, 2]) == local.read_many([1, 2])
    with pytest.raises(sc.CorruptSampleError, match=f"sample {victim} ") as e:
        store.read_many([1, victim, 200])
    assert e.value.sample_id == victim and "s3://" in str(e.value)
    assert store.stats()["refetched"] >= 1      # fetched again before it was reported
    assert store.verify() == [victim]


def test_missing_objects_and_malformed_ones_are_clear_errors(s3):
    with pytest.raises(FileNotFoundError, match="nothing-here.shc"):
        sc.PackedStore(f"s3://{s3.bucket}/nothing-here.shc")
    with pytest.raises(FileNotFoundError, match="no-such-bucket"):
        sc.PackedStore("s3://no-such-bucket/x.shc")
    s3.client().put_object(Bucket=s3.bucket, Key="notastore", Body=b"hello" * 100)
    with pytest.raises(sc.StoreFormatError, match="notastore.*not a shadecache store"):
        sc.PackedStore(f"s3://{s3.bucket}/notastore")
    with pytest.raises(ValueError, match="does not name an object"):
        sc.PackedStore(f"s3://{s3.bucket}/")
    with pytest.raises(ValueError, match="apply to store files"):
        sc.PackedStore(f"s3://{s3.bucket}/x.shc", direct=True)


def test_the_directory_is_kept_on_local_disk(pair, proxy, tmp_path):
    local, url = pair
    keep = tmp_path / "ssd"
    first = sc.S3Store(url, endpoint_url=proxy.endpoint, cache_dir=str(keep))
    fetched = proxy.stats()["get_bytes"]
    assert fetched >= first.file_bytes - first.data_bytes        # header and directory
    proxy.reset()
    second = sc.S3Store(url, endpoint_url=proxy.endpoint, cache_dir=str(keep))
    st = proxy.stats()
    assert st["gets"] == 1 and st["get_bytes"] <= 4096              # the header block only
    assert second.fingerprint == local.fingerprint
    assert second.read_many([3, 4]) == local.read_many([3, 4])


def test_cli_pack_info_verify_with_object_urls(s3, tmp_path):
    local_store(tmp_path / "a.shc", n=200)
    url = f"s3://{s3.bucket}/cli/a.shc"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "shadecache.cli", *args], capture_output=True,
                              text=True, env=env, timeout=120)
    r = run("pack", "-q", str(tmp_path / "a.shc"), url)
    assert r.returncode == 0, r.stderr
    assert f"packed 200 samples into {url}" in r.stdout
    r = run("info", url)
    assert r.returncode == 0 and "samples        200" in r.stdout and "ETag" in r.stdout, r.stderr
    r = run("verify", "-q", url)
    assert r.returncode == 0 and "every checksum matches" in r.stdout, r.stderr


def test_a_node_keeps_the_directory_on_its_ssd_tier(pair, proxy, tmp_path):
    """Composed with an SSD tier, a node keeps the object's header and directory on the tier's
    disk: the next job on the node opens the object with one small GET."""
    local, url = pair
    store = sc.S3Store(url, endpoint_url=proxy.endpoint)
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    sc.Node(store, None, ssd=ssd, read_ahead=False)
    ssd.close()
    proxy.reset()
    again = sc.S3Store(url, endpoint_url=proxy.endpoint, cache_dir=str(tmp_path / "ssd"))
    st = proxy.stats()
    assert st["gets"] == 1 and st["get_bytes"] <= 4096
    assert again.fingerprint == local.fingerprint
