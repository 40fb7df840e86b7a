"""The package's rooms keep their shape (docs/architecture.md): a lower room knows nothing above it,
and no function grows past what a reader takes in at once. Read from the source (ast), so a change
that breaks either fails here, naming the place."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "shadecache"
MAX_FUNCTION_LINES = 80
# room -> rooms (subpackages of shadecache) it may not import, at module level or inside a function
BELOW = {
    "cache": ("peer", "lookahead", "sampling", "loader", "node", "ssd", "store"),
    "store": ("peer", "lookahead", "sampling", "loader", "node", "cache", "ssd"),
    "ssd": ("peer", "lookahead", "sampling", "loader", "node"),
    "peer": ("lookahead", "sampling", "loader", "node"),
    "lookahead": ("sampling", "loader", "peer"),
}


def _imports(path: pathlib.Path):
    """(line, module) of every import of a shadecache module in `path`, relative ones resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(rel[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for a in node.names:
                yield node.lineno, f"{mod}.{a.name}" if node.module is None else mod
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def room_violations():
    found = []
    for room, forbidden in BELOW.items():
        for path in sorted((PACKAGE / room).rglob("*.py")):
            for line, mod in _imports(path):
                parts = (mod or "").split(".")
                if parts[0] == "shadecache" and len(parts) > 1 and parts[1] in forbidden:
                    found.append(f"{path.relative_to(PACKAGE)}:{line} imports {mod}")
    return found


def long_functions():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "demo" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_lower_rooms_know_nothing_above_them():
    assert room_violations() == []


def test_no_function_is_longer_than_a_reader_takes_in():
    assert long_functions() == []


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    """The checkers themselves: a cache module that imports the peer layer, and a function of
    81 lines, are reported."""
    import shutil
    copy = tmp_path / "shadecache"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "cache" / "intruder.py").write_text(
        "def f():\n    from ..peer import wire\n" + "    x = 1\n" * 79)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    assert any("cache/intruder.py:2 imports shadecache.peer" in v for v in room_violations())
    assert any("cache/intruder.py:1 f: 81 lines" in v for v in long_functions())
