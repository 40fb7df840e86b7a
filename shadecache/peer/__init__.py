"""The peer layer: nodes of a job serve each other's cache misses over a thin TCP protocol.

  wire.py     the framed, versioned, bounded message format
  auth.py     the shared-secret HMAC challenge-response, both directions
  server.py   the server (PeerService; its own process, `python -m shadecache.peer`)
  launch.py   serve(): start a server process and get its handle (PeerServer)
  client.py   one connection to one server: batched GET under a deadline, replies verified
  homes.py    rendezvous hashing: the home node of every sample id
  cluster.py  Cluster: membership (explicit or torch.distributed) and the batched fetch

docs/peer.md describes the protocol and the failure behaviour.
"""
from .auth import AuthenticationError
from .client import PeerClient
from .cluster import Cluster
from .launch import PeerServer, serve
from .wire import ProtocolError, RemoteError

__all__ = ["AuthenticationError", "Cluster", "PeerClient", "PeerServer", "ProtocolError",
           "RemoteError", "serve"]
