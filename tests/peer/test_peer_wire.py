"""The peer protocol's constants are written twice, once per side of the reply path: in Python
(shadecache/peer/wire.py: headers, GET requests, the handshake) and in C++ (csrc/net/peer_wire.h:
replies sent and read without the GIL). The native module exports its own (_core.WIRE); they must
be the same numbers."""
from shadecache import _core
from shadecache.peer import wire


def test_native_and_python_wire_constants_agree():
    native = dict(_core.WIRE)
    python = {"MAGIC": wire.MAGIC, "VERSION": wire.VERSION, "GET_REPLY": wire.GET_REPLY,
              "ERROR": wire.ERROR, "MORE": wire.MORE, "MAX_BATCH": wire.MAX_BATCH, "MAX_VALUE": wire.MAX_VALUE,
              "MAX_REPLY": wire.MAX_REPLY, "MAX_ERROR": wire.MAX_ERROR, "MISS": wire.MISS,
              "HEADER_BYTES": wire.HEADER_BYTES, "ENTRY_BYTES": wire.ENTRY_BYTES}
    assert native == python
