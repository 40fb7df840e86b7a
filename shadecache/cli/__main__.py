"""`python -m shadecache.cli`: the `shadecache` command."""
import sys

from . import main

sys.exit(main())
