"""`python -m shadecache.peer`: the peer server process (server.main). serve() starts the same
entry point in an isolated interpreter instead (launch.server_argv), without `-m`, which would put
the working directory first on the import path."""
from .server import main

main()
