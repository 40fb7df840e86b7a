"""`python -m shadecache.peer`: the peer server process that serve() starts (server._main)."""
from .server import _main

_main()
