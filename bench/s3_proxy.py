"""A fault-injecting HTTP proxy in front of an S3 server, shaped like S3 and counting what passes.

    python bench/s3_proxy.py --upstream 127.0.0.1:8333 --port 0 [--latency 0.02 --conn-bps 50e6
        --total-bps 100e6 --p503 0.02 --preset 0.005 --ptruncate 0.005 --whole-object]
    # prints "listening PORT"; every setting can be changed while it runs:
    #   POST /__proxy/config  {"latency": 0.02, ...}    GET /__proxy/stats    POST /__proxy/reset

    proxy = ProxyProcess(upstream_port, latency=0.02, ...)   # the same, as a child process
    proxy.endpoint; proxy.stats(); proxy.configure(p503=0.0); proxy.stop()

What it does to each request (HTTP/1.1, keep-alive, one upstream connection per client one):
- latency: waits this long before forwarding a request (S3's time to first byte);
- conn_bps / total_bps: every response body is sent through two token buckets, the
  connection's and the proxy's (a cap per connection and one in all), in 64 KiB pieces;
- p503: answers a GET of an object with 503 SlowDown (an S3 error body) without forwarding it;
- preset: resets the connection (RST) part way through a GET's body; ptruncate: ends the body
  early and closes (FIN), the Content-Length still claiming the whole;
- whole_object: drops the Range header, so the server answers a ranged GET with 200 and the
  whole object (the request is signed again, with the credentials in this process's
  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY: the Range header is part of the signature);
- expired_tokens: answers 400 ExpiredToken to a request whose x-amz-security-token names a time
  ("expires-<unix seconds>-...") that has passed: a credential source's expiry enforced; a
  request whose token is still valid goes on without it, signed again (as whole_object: the
  server, SeaweedFS, knows its static identity, not session tokens).
Counted: requests (by method), GET bytes out, connections open now and at most, requests in
flight now and at most, and each fault injected. Control requests are not counted.
Random choices come from one seeded generator (--seed), so a run can be repeated.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request

PIECE = 64 << 10
_FIELDS = ("latency", "conn_bps", "total_bps", "p503", "preset", "ptruncate", "whole_object",
           "expired_tokens")


class _Bucket:
    """A token bucket of `rate` bytes/s (None: no cap), with a burst of 50 ms of its rate."""

    def __init__(self, rate):
        self.set(rate)

    def set(self, rate):
        self.rate = float(rate) if rate else None
        self.tokens = 0.0
        self.t = time.monotonic()

    async def take(self, n: int):
        if not self.rate:
            return
        now = time.monotonic()
        self.tokens = min(self.rate * 0.05, self.tokens + (now - self.t) * self.rate)
        self.t = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class Proxy:
    def __init__(self, upstream: tuple, seed: int = 0, **settings):
        self.upstream = upstream
        self.cfg = {"latency": 0.0, "conn_bps": None, "total_bps": None, "p503": 0.0, "preset": 0.0,
                    "ptruncate": 0.0, "whole_object": False, "expired_tokens": False}
        self.rng = random.Random(seed)
        self.total = _Bucket(None)
        self.configure(settings)
        self.reset()

    def configure(self, settings: dict):
        for k, v in settings.items():
            if k not in _FIELDS:
                raise ValueError(f"unknown proxy setting {k!r}")
            self.cfg[k] = v
        self.total.set(self.cfg["total_bps"])

    def reset(self):
        self.st = {"requests": 0, "gets": 0, "heads": 0, "puts": 0, "posts": 0, "deletes": 0,
                   "bytes_out": 0, "get_bytes": 0, "bytes_in": 0, "connections": 0,
                   "connections_max": 0, "connections_total": 0, "in_flight": 0,
                   "in_flight_max": 0, "injected_503": 0, "injected_reset": 0,
                   "injected_truncate": 0, "whole_object_answers": 0, "expired_refused": 0,
                   "since": time.time()}
        # what is open now stays counted
        self.st["connections"] = self.st["connections_max"] = getattr(self, "_open", 0)

    # ---- one client connection --------------------------------------------------------------
    async def handle(self, reader, writer):
        self._open = getattr(self, "_open", 0) + 1
        self.st["connections"] = self._open
        self.st["connections_total"] += 1
        self.st["connections_max"] = max(self.st["connections_max"], self._open)
        conn = _Bucket(self.cfg["conn_bps"])
        up = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                method, target, headers, raw = head
                body = await _read_body(reader, headers)
                if target.startswith("/__proxy/"):
                    await self.control(writer, method, target, body)
                    continue
                self.st["requests"] += 1
                key = method.lower() + "s"
                if key in self.st:
                    self.st[key] += 1
                self.st["bytes_in"] += len(body)
                self.st["in_flight"] += 1
                self.st["in_flight_max"] = max(self.st["in_flight_max"], self.st["in_flight"])
                try:
                    if self.cfg["latency"]:
                        await asyncio.sleep(float(self.cfg["latency"]))
                    if self.cfg["expired_tokens"] and _expired(headers):
                        self.st["expired_refused"] += 1
                        await _error(writer, 400, "ExpiredToken", "The provided token has expired.")
                        continue
                    is_get = method == "GET" and len(target.split("?")[0].strip("/").split("/")) >= 2
                    if is_get and self.rng.random() < float(self.cfg["p503"]):
                        self.st["injected_503"] += 1
                        await _error(writer, 503, "SlowDown", "Please reduce your request rate.")
                        continue
                    drop = ()
                    if self.cfg["whole_object"] and "range" in headers:
                        drop += ("range",)
                    if self.cfg["expired_tokens"] and "x-amz-security-token" in headers:
                        drop += ("x-amz-security-token",)   # the server knows no session tokens
                    if drop:
                        raw = _signed_again(method, target, headers, drop)
                    if up is None:
                        up = await asyncio.open_connection(*self.upstream)
                    up[1].write(raw + body)
                    await up[1].drain()
                    ok = await self.relay(up[0], writer, method, is_get, conn, raw)
                    if not ok:
                        return
                finally:
                    self.st["in_flight"] -= 1
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            self._open -= 1
            self.st["connections"] = self._open
            if up is not None:
                up[1].close()
            try:
                writer.close()
            except Exception:
                pass

    async def relay(self, ureader, writer, method, is_get, conn, req=b"") -> bool:
        """The upstream's response to the client, faults applied; False when the client
        connection was ended (a fault)."""
        head = await _read_head(ureader, response=True)
        if head is None:
            raise ConnectionError("upstream closed")
        status, _, headers, raw = head
        if status == 403 and os.environ.get("S3_PROXY_DEBUG"):
            print("403 for", req.decode("latin-1"), file=sys.stderr, flush=True)
        if is_get and status == 200 and "content-range" not in headers and self.cfg["whole_object"]:
            self.st["whole_object_answers"] += 1
        length = int(headers.get("content-length", 0)) if method != "HEAD" else 0
        chunked = headers.get("transfer-encoding", "").lower() == "chunked" and method != "HEAD"
        cut = None
        if is_get and status in (200, 206) and length > 1:
            r = self.rng.random()
            if r < float(self.cfg["preset"]):
                cut = ("reset", self.rng.randrange(0, length))
            elif r < float(self.cfg["preset"]) + float(self.cfg["ptruncate"]):
                cut = ("truncate", self.rng.randrange(0, length))
        writer.write(raw)
        if chunked:
            await self._relay_chunked(ureader, writer, conn)
            return True
        sent = 0
        while sent < length:
            n = min(PIECE, length - sent)
            if cut is not None and sent + n > cut[1]:
                n = cut[1] - sent
            data = await ureader.readexactly(n) if n else b""
            await conn.take(len(data))
            await self.total.take(len(data))
            writer.write(data)
            await writer.drain()
            sent += len(data)
            self.st["bytes_out"] += len(data)
            if is_get:
                self.st["get_bytes"] += len(data)
            if cut is not None and sent >= cut[1]:
                self.st["injected_" + cut[0]] += 1
                sock = writer.get_extra_info("socket")
                if cut[0] == "reset" and sock is not None:   # RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort() if cut[0] == "reset" else writer.close()
                return False
        await writer.drain()
        return True

    async def _relay_chunked(self, ureader, writer, conn):
        while True:
            line = await ureader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            data = await ureader.readexactly(size + 2)
            await conn.take(size)
            await self.total.take(size)
            writer.write(line + data)
            await writer.drain()
            self.st["bytes_out"] += size
            if size == 0:
                return

    async def control(self, writer, method, target, body):
        if target.startswith("/__proxy/stats"):
            out = dict(self.st, config=self.cfg)
        elif target.startswith("/__proxy/reset"):
            self.reset()
            out = {"ok": True}
        elif target.startswith("/__proxy/config"):
            self.configure(json.loads(body or b"{}"))
            out = {"ok": True, "config": self.cfg}
        else:
            out = {"error": f"unknown control {target}"}
        data = json.dumps(out).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(data) + data)
        await writer.drain()


async def _read_head(reader, response: bool = False):
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    lines = raw.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if response:
        return int(first[1]), first[2] if len(first) > 2 else "", headers, raw
    return first[0], first[1], headers, raw


async def _read_body(reader, headers) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            out += line + data
            if size == 0:
                return bytes(out)
    n = int(headers.get("content-length", 0))
    return await reader.readexactly(n) if n else b""


def _signed_again(method: str, target: str, headers: dict, drop: tuple) -> bytes:
    """The request head without the headers in `drop`, signed again (SigV4) with this process's
    credentials, for the same Host (the server checks the signature against it)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    keep = {k: v for k, v in headers.items()
            if k not in drop and k not in ("authorization", "x-amz-date", "amz-sdk-invocation-id", "amz-sdk-request")}
    req = AWSRequest(method=method, url=f"http://{headers['host']}{target}", headers=keep)
    region = re.search(r"Credential=[^/]+/\d+/([^/]+)/", headers.get("authorization", ""))
    S3SigV4Auth(Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]),
                "s3", region.group(1) if region else "us-east-1").add_auth(req)
    lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in req.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _expired(headers) -> bool:
    m = re.match(r"expires-(\d+)-", headers.get("x-amz-security-token", ""))
    return bool(m) and time.time() > int(m.group(1))


async def _error(writer, status: int, code: str, message: str):
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    reason = {503: "Slow Down", 400: "Bad Request"}.get(status, "Error")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()


async def _serve(args):
    proxy = Proxy(_parse_hostport(args.upstream), seed=args.seed,
                  **{k: getattr(args, k) for k in _FIELDS})
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.port, limit=1 << 20,
                                        backlog=512)
    port = server.sockets[0].getsockname()[1]
    print(f"listening {port}", flush=True)
    async with server:
        await server.serve_forever()


def _parse_hostport(s: str) -> tuple:
    host, _, port = s.rpartition(":")
    return host or "127.0.0.1", int(port)


class ProxyProcess:
    """The proxy in a child process (its own interpreter: its work does not share a GIL with the
    client it measures). stats(), configure(**settings), reset(), stop()."""

    def __init__(self, upstream_port: int, seed: int = 0, **settings):
        args = [sys.executable, os.path.abspath(__file__), "--upstream", f"127.0.0.1:{upstream_port}",
                "--port", "0", "--seed", str(seed)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            self.proc.kill()
            raise RuntimeError(f"the S3 proxy did not start: {line!r}")
        self.port = int(line.split()[1])
        if settings:
            self.configure(**settings)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + path, data=data, method="POST" if data is not None else "GET")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict:
        return self._call("/__proxy/stats")

    def configure(self, **settings) -> dict:
        return self._call("/__proxy/config", settings)

    def reset(self) -> dict:
        return self._call("/__proxy/reset", {})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each response")
    ap.add_argument("--conn-bps", dest="conn_bps", type=float, default=None)
    ap.add_argument("--total-bps", dest="total_bps", type=float, default=None)
    ap.add_argument("--p503", type=float, default=0.0)
    ap.add_argument("--preset", type=float, default=0.0)
    ap.add_argument("--ptruncate", type=float, default=0.0)
    ap.add_argument("--whole-object", dest="whole_object", action="store_true")
    ap.add_argument("--expired-tokens", dest="expired_tokens", action="store_true")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
