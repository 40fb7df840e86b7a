"""The node: its parts composed once (node.py), its miss path (miss_path.py) and its admission
rule (admission.py)."""
from ..admission import Admission, ReadThrough  # noqa: F401
from .miss_path import MissPath  # noqa: F401
from .node import Node  # noqa: F401
