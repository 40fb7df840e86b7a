"""A middleman on loopback that relays every connection to a server, records both directions (and
may alter a byte), then reads the records back as the wire carries them: the clear header of each
message, its sealed body. For tests of what someone on the path sees and does
(test_peer_security.py, test_peer_fork.py, test_peer_threat_model.py)."""
import socket
import threading

from shadecache.peer import wire


class Recorder:
    """Relays every connection to `target` ((host, port)); `sent[k]` and `received[k]` are what the
    client of connection k sent and received, in order. With `flip_at`, the byte at that offset of
    what the server sends on each connection is changed on the way (a bit flipped)."""

    def __init__(self, target, flip_at=None):
        self.target, self.flip_at = target, flip_at
        self.sent, self.received = [], []
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.address = "127.0.0.1:%d" % self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            up, down = bytearray(), bytearray()
            self.sent.append(up)
            self.received.append(down)
            threading.Thread(target=self._pump, args=(a, b, up, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, down, self.flip_at), daemon=True).start()

    @staticmethod
    def _pump(src, dst, log, flip_at):
        while True:
            try:
                data = bytearray(src.recv(1 << 16))
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            start = len(log)
            log += data
            if flip_at is not None and start <= flip_at < start + len(data):
                data[flip_at - start] ^= 0x20
            try:
                dst.sendall(data)
            except OSError:
                return

    def client_records(self, k):
        """(header fields, header bytes, sealed body) of every message the client of connection k
        sent after its handshake."""
        out = []
        log = bytes(self.sent[k])
        at = 2 * wire.HEADER_BYTES + wire.HELLO_BYTES + wire.DIGEST_BYTES   # the handshake: HELLO and PROOF
        while at + wire.HEADER_BYTES <= len(log):
            head = log[at:at + wire.HEADER_BYTES]
            fields = wire.unpack_header(head)
            end = at + wire.HEADER_BYTES + fields[3] + wire.TAG_BYTES
            out.append((fields, head, log[at + wire.HEADER_BYTES:end]))
            at = end
        return out

    def get_records(self):
        """Per connection, the sealed GET bodies (ciphertext, tag left off) the client sent."""
        return [[body[:f[3]] for f, _, body in self.client_records(k) if f[0] == wire.GET]
                for k in range(len(self.sent))]

    def close(self):
        self.srv.close()
