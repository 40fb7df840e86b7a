"""The package's modules use each other through public names only: a test that reads every module's
imports and attribute accesses (ast) and fails on another module's private (underscore) name.

Three ways a module can reach into another's privates, each checked:
  - `from .x import _name` (or `from .. import _name`) of an object;
  - `x._name` where x is a module of the package imported here;
  - `obj._name` where `_name` is a private attribute that another module's classes define
    (self._name = ..., or a class-level _name) and this module defines none of that name: a
    handle's engine object (`cache._core`), a store's reader (`store._r`), a board's arrays.
The native modules themselves (_core, _io) and _version are the package's own implementation and
may be imported by name; what they hold is used through their documented functions.
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "shadecache"
NATIVE = {"_core", "_io", "_version"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield ".".join(parts), is_pkg, path, ast.parse(path.read_text(), str(path))


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_attributes(tree) -> set:
    """Private attribute names a module's classes define: self._x = ..., cls._x, class-level _x."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and _private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                out.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(stmt.name):
                    out.add(stmt.name)
    return out


def violations():
    mods = list(_modules())
    names = {m for m, *_ in mods}
    private_attrs = {m: _own_private_attributes(tree) for m, _, _, tree in mods}
    found = []
    for module, is_pkg, path, tree in mods:
        own = private_attrs[module]
        others = set().union(*(a for m, a in private_attrs.items() if m != module)) - own
        aliases = {}      # local name -> a package module imported here
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(module, is_pkg, node)
                if not src.startswith("shadecache"):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in names or a.name in NATIVE:
                        aliases[a.asname or a.name] = full
                        if a.name in NATIVE:
                            continue
                    if _private(a.name):
                        found.append(f"{path.name}:{node.lineno}: imports {a.name} from {src}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("shadecache"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                if target.split(".")[-1] not in NATIVE:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: uses {node.value.id}.{node.attr} "
                                 f"of {target}")
            elif node.attr in others:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: uses .{node.attr}, a private "
                             "attribute of another module's class")
    return found


def test_no_module_uses_another_modules_private_names():
    assert violations() == []


def test_the_walk_finds_a_private_import(tmp_path, monkeypatch):
    """The checker itself: a module that takes another's private name is reported."""
    import shutil
    copy = tmp_path / "shadecache"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "intruder.py").write_text("from .cache.handle import _check_int\n"
                                      "from . import tiers\n"
                                      "x = tiers._private_thing\n"
                                      "def f(cache):\n    return cache._core\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    found = "\n".join(violations())
    assert "intruder.py:1: imports _check_int" in found
    assert "intruder.py:3: uses tiers._private_thing" in found
    assert "intruder.py:5: uses ._core" in found


def test_a_room_of_the_package_is_an_attribute_without_an_import_of_its_own():
    """`sc.cache.gc()` right after `import shadecache as sc`, in a fresh interpreter (in one
    where another import loaded shadecache.cache first, it worked by luck)."""
    import subprocess
    import sys
    code = ("import shadecache as sc; assert isinstance(sc.cache.list_caches(), list); "
            "assert callable(sc.store.PackedStore)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
