"""serve(): starts this node's peer server in a process of its own and returns its handle.

The server process is a fresh interpreter (no fork of a training process with its threads, no
re-import of the user's __main__), started isolated with a safe import path
(shadecache/process.py `isolated_python`: a module planted in a world-writable working directory
would run inside the server and read the secret). It gets its configuration, secret included,
over its stdin pipe, never on the command line, and exits when that pipe closes, so it never
outlives the process that started it.
"""
import pickle
import select
import struct
import subprocess

from . import identity
from . import secret as secrets_
from .server import check_bind
from ..process import isolated_python

START_TIMEOUT = 60.0


class PeerServer:
    """Handle of a running peer server process: .address ("host:port"), .pid, close()."""

    def __init__(self, proc, address: str):
        self._proc = proc
        self.address = address
        self.pid = proc.pid

    def set_peers(self, addresses) -> None:
        """Tells the server the addresses of the job's nodes (shown by `shadecache ls`)."""
        msg = pickle.dumps({"peers": [str(a) for a in addresses]})
        self._proc.stdin.write(struct.pack("<I", len(msg)) + msg)
        self._proc.stdin.flush()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """Stops the server (closing its pipe asks it to exit; SIGKILL after `timeout`)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<PeerServer {self.address} pid={self.pid}{'' if self.alive else ' exited'}>"


def serve(node, host: str = "127.0.0.1", port: int = 0, secret=None) -> PeerServer:
    """Serves `node`'s cache (sc.Node: node.serve() calls this) to the other nodes, reading its
    misses through the node's SSD tier and store: the home node of a sample reads it from shared
    storage once, caches it by the node's admission rule and serves it to every node, so the
    cluster reads each sample once. secret: see secret.py (default: $SHADECACHE_SECRET, or the
    0600 file $SHADECACHE_SECRET_FILE names), required on every address, loopback included.
    port 0 picks a free port; the handle's .address says which."""
    key = secrets_.resolve(secret)
    check_bind(host)
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    identity.of_server(node.cache, node.store)   # a store of another data set than the cache's
    cfg = pickle.dumps({"node": node.pickled_for_process(), "host": host, "port": port, "secret": key})
    proc = subprocess.Popen(isolated_python("shadecache.peer"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    proc.stdin.write(struct.pack("<I", len(cfg)) + cfg)
    proc.stdin.flush()
    poller = select.poll()   # not select(): this process may hold descriptors above 1024
    poller.register(proc.stdout, select.POLLIN)
    ready = poller.poll(START_TIMEOUT * 1000)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        raise OSError(f"peer server did not start (exit status {proc.returncode})")
    return PeerServer(proc, line)

