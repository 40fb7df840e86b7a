"""Fixtures of the object-store tests (a pytest plugin: tests/conftest.py names it, so that one
server serves the whole session and no second conftest module shadows `from conftest import`):
an S3 server, SeaweedFS (bench/seaweed.py), one per test session, skipped with the reason where it
cannot start; and the fault proxy (bench/s3_proxy.py) in front of it, one per test that asks."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return __import__(name)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    seaweed = _bench("seaweed")
    why = seaweed.unavailable()
    if why:
        pytest.skip(f"no S3 server for the object-store tests: {why}")
    server = seaweed.SeaweedServer(str(tmp_path_factory.mktemp("seaweed")))
    try:
        server.start()
    except RuntimeError as e:
        pytest.skip(f"SeaweedFS could not start here: {e}")
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """The server, with the AWS settings of its clients in the environment (child processes
    inherit them) and a slot directory of this test's own (the node-wide bound)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SHADECACHE_SLOT_DIR", str(tmp_path / "slots"))
    return s3_server


@pytest.fixture
def proxy(s3):
    """A fault proxy in front of the server (no faults until configured)."""
    px = _bench("s3_proxy").ProxyProcess(s3.port)
    yield px
    px.stop()
