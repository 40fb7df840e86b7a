"""The peer layer: nodes of a job serve each other's cache misses over a thin TCP protocol,
authenticated and encrypted (docs/peer.md has the protocol and the threat model).

  wire.py      the framed, versioned, bounded message format
  secret.py    the shared secret: where it comes from, what is strong enough, how to make one
  identity.py  the data set a connection is about (fingerprint, num_samples)
  auth.py      the handshake: proofs both ways, the data set checked, the session keys derived
  server.py    the server (PeerService; its own process, started by serve())
  launch.py    serve(): start a server process and get its handle (PeerServer)
  client.py    one connection to one server: batched GET under a deadline, replies verified
  homes.py     rendezvous hashing: the home node of every sample id
  cluster.py   Cluster: membership (explicit or torch.distributed) and the batched fetch

The frames themselves are sealed and opened in C++ (csrc/bindings/peer_io.cc, csrc/net/).
"""
from .auth import AuthenticationError, ForgedFrameError
from .client import PeerClient
from .cluster import Cluster
from .launch import PeerServer, serve
from .secret import SecretError, new_secret
from .wire import ProtocolError, RemoteError

__all__ = ["AuthenticationError", "Cluster", "ForgedFrameError", "PeerClient", "PeerServer", "ProtocolError",
           "RemoteError", "SecretError", "new_secret", "serve"]
