"""The peer protocol's constants are defined once, in the native framing (csrc/net/peer_wire.h:
replies sent and read without the GIL), and shadecache/peer/wire.py takes them from the engine
(_core.WIRE): the two sides of the reply path cannot disagree, and a change is made in one place."""
import ast
import pathlib

from shadecache import _core
from shadecache.peer import wire


def test_every_native_wire_constant_is_wire_pys_value():
    for name, value in _core.WIRE.items():
        assert getattr(wire, name) == value, name


def test_wire_py_writes_no_native_constant_itself():
    """Each constant the engine exports is assigned in wire.py from _core.WIRE, never as a
    number of its own (a copy would drift from the native side)."""
    tree = ast.parse(pathlib.Path(wire.__file__).read_text())
    own = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        from_engine = any(isinstance(n, ast.Name) and n.id == "_W" for n in ast.walk(node.value))
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if not from_engine:
                own.update(n.id for n in names if isinstance(n, ast.Name))
    assert not own & set(_core.WIRE), sorted(own & set(_core.WIRE))
