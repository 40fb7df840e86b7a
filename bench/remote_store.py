"""A packed store served over TCP: "shared storage" in another network namespace for benchmarks.

    python bench/remote_store.py PATH HOST PORT      # serves PATH (prints "ready" when listening)
    store = RemoteStore("10.213.0.9:7000")           # len(), read_many(ids), label(i), labels

The link to it is what a benchmark shapes (bench/netns.py, tc tbf): every byte a node reads from
this store crosses that link. Protocol (benchmark only, trusted peers): request u32 count then
count x u64 ids (count 0xFFFFFFFF asks for the metadata: u64 N then N x i64 labels); reply
count x u32 lengths then the bytes. RemoteStore pickles by address; each process and thread opens
its own connection.
"""
import os
import socket
import struct
import sys
import threading

import numpy as np

META = 0xFFFFFFFF


def _recv(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("store server closed the connection")
        got += k
    return buf


def _serve_conn(conn, path):
    import shadecache as sc

    store = sc.PackedStore(path)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            try:
                (count,) = struct.unpack("<I", _recv(conn, 4))
            except ConnectionError:
                return
            if count == META:
                labels = store.labels.astype("<i8")
                conn.sendall(struct.pack("<Q", labels.size) + labels.tobytes())
                continue
            ids = np.frombuffer(_recv(conn, 8 * count), dtype="<u8").tolist()
            data = store.read_many(ids)
            lengths = np.array([len(d) for d in data], dtype="<u4")
            conn.sendmsg([lengths.tobytes()] + data)


def serve(path, host, port):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_conn, args=(conn, path), daemon=True).start()


class RemoteStore:
    def __init__(self, address: str):
        self.address = address
        host, _, port = address.rpartition(":")
        self._where = (host, int(port))
        self._local = threading.local()
        s = self._sock()
        s.sendall(struct.pack("<I", META))
        (n,) = struct.unpack("<Q", _recv(s, 8))
        self.labels = np.frombuffer(_recv(s, 8 * n), dtype="<i8").copy()

    def __reduce__(self):
        return (RemoteStore, (self.address,))

    def _sock(self):
        loc = self._local
        if getattr(loc, "pid", None) != os.getpid():
            loc.sock = socket.create_connection(self._where)
            loc.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loc.pid = os.getpid()
        return loc.sock

    def __len__(self):
        return int(self.labels.size)

    def label(self, i):
        return int(self.labels[i])

    def read_many(self, ids):
        ids = np.asarray(ids, dtype="<u8")
        if ids.size == 0:
            return []
        s = self._sock()
        s.sendall(struct.pack("<I", ids.size) + ids.tobytes())
        lengths = np.frombuffer(_recv(s, 4 * ids.size), dtype="<u4")
        body = _recv(s, int(lengths.sum(dtype=np.int64)))
        out, off = [], 0
        for n in lengths.tolist():
            out.append(bytes(body[off:off + n]))
            off += n
        return out

    def read(self, i):
        return self.read_many([i])[0]

    def close(self):
        pass


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
