"""`python -m shadecache.peer`: the peer server process that serve() starts (server.main)."""
from .server import main

main()
