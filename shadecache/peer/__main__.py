"""`python -m shadecache.peer`: the peer server process (server.main). serve() runs this module in
an isolated interpreter instead (shadecache/process.py `isolated_python`), not with `-m`, which
would put the working directory first on the import path."""
from .server import main

main()
