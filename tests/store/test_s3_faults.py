"""Faults between the object store and its reader, injected by the proxy (bench/s3_proxy.py) in
front of a real S3 server: each gets a retry (counted) or a clear error, never wrong bytes."""
import datetime
import time

import numpy as np
import pytest

import shadecache as sc
from s3_data import ACCESS_KEY, SECRET_KEY, local_store, upload


@pytest.fixture
def pair(s3, tmp_path):
    local = local_store(tmp_path / "a.shc", n=2000, low=200, high=3000)
    return local, upload(s3, tmp_path / "a.shc")


def test_slowdowns_resets_and_truncation_are_retried_never_wrong_bytes(pair, proxy):
    local, url = pair
    store = sc.S3Store(url, endpoint_url=proxy.endpoint, connections=4, max_extent_bytes=64 << 10,
                       gap_bytes=1 << 20)
    proxy.reset()
    proxy.configure(p503=0.08, preset=0.05, ptruncate=0.05)
    rng = np.random.default_rng(0)
    for epoch in range(3):
        order = rng.permutation(len(local))
        for start in range(0, len(order), 500):
            ids = order[start:start + 500]
            assert store.read_many(ids) == local.read_many(ids), f"epoch {epoch}"
    px, c = proxy.stats(), store.stats()["client"]
    assert px["injected_503"] > 0 and px["injected_reset"] > 0 and px["injected_truncate"] > 0
    assert c["throttled"] == px["injected_503"]
    assert c["broken"] == px["injected_reset"] + px["injected_truncate"]
    assert c["retries"] == c["throttled"] + c["broken"]
    assert c["limit_now"] <= 4


def test_a_whole_object_answer_to_a_ranged_get_gives_the_range(pair, proxy):
    local, url = pair
    store = sc.S3Store(url, endpoint_url=proxy.endpoint, gap_bytes=0)
    proxy.configure(whole_object=True)
    ids = [1, 500, 1999]
    assert store.read_many(ids) == local.read_many(ids)
    assert store.stats()["client"]["whole_object_answers"] == proxy.stats()["whole_object_answers"] >= 3


def test_a_request_that_keeps_failing_is_an_error_naming_the_object(pair, proxy):
    local, url = pair
    store = sc.S3Store(url, endpoint_url=proxy.endpoint)
    proxy.configure(p503=1.0)
    store.client.max_attempts = 3
    store.client._backoff = (0.001, 0.01)
    with pytest.raises(sc.ObjectStoreError, match=f"{url}.*failed 3 times.*throttled"):
        store.read_many([1, 2, 3])


def _source(life, calls, lie=False):
    def source():
        exp = int(time.time()) + life
        calls.append(exp)
        said = exp + 3600 if lie else exp    # lie: the source claims an hour, the token lasts `life`
        return {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "token": f"expires-{exp}-t",
                "expiry_time": datetime.datetime.fromtimestamp(said, datetime.timezone.utc)}
    return source


def test_short_lived_credentials_are_refreshed_before_they_expire(pair, proxy):
    local, url = pair
    proxy.configure(expired_tokens=True)
    calls = []
    store = sc.S3Store(url, endpoint_url=proxy.endpoint, credentials=_source(3, calls), gap_bytes=0)
    deadline = time.monotonic() + 7
    rng = np.random.default_rng(0)
    while time.monotonic() < deadline:
        ids = rng.integers(0, len(local), 8)
        assert store.read_many(ids) == local.read_many(ids)
        time.sleep(0.05)
    assert len(calls) >= 3                                  # refreshed, a few times
    assert proxy.stats()["expired_refused"] == 0            # before they expired


def test_credentials_refused_as_expired_are_refreshed_and_the_read_goes_on(pair, proxy):
    local, url = pair
    proxy.configure(expired_tokens=True)
    calls = []
    store = sc.S3Store(url, endpoint_url=proxy.endpoint, credentials=_source(2, calls, lie=True), gap_bytes=0)
    time.sleep(3)
    assert store.read_many([4, 5]) == local.read_many([4, 5])
    assert proxy.stats()["expired_refused"] >= 1
    assert store.stats()["client"]["credential_refreshes"] >= 1
