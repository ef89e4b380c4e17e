"""The house rules, checked on the source with ``ast``: a package per stage, imports flowing
one way (lazy imports inside functions included), no import cycles between modules, and no
module reaching into another package's ``_private`` names. ``if TYPE_CHECKING:`` imports
are annotations only and are not counted.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "autopar"

#: The stages in the order data flows through them. A module may import from its own layer
#: and earlier ones only. ``errors`` is shared by all; ``compat`` (PyTorch's private APIs)
#: too; ``pipeline`` and ``api`` compose.
LAYERS = (
    "errors",
    "logs",
    "compat",
    "capture",
    "profiling",
    "planning",
    "codegen",
    "runtime",
    "rnn",
    "adapt",
    "pipeline",
    "inspection",
    "api",
    "parallel",
    "tools",
)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = ("autopar",) + path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root (exempt)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: pathlib.Path, mods: dict) -> tuple[set[str], list[tuple[str, str]]]:
    """(modules imported, (module, name) pairs for every private name used from them)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and _is_type_checking(t)
            for b in t.body for n in ast.walk(b)}  # fmt: skip
    found: set[str] = set()
    private: list[tuple[str, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autopar"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in mods:  # from autopar.pkg import module
                    found.add(full)
                    aliases[a.asname or a.name] = full
                else:
                    found.add(node.module)
                    if a.name.startswith("_"):
                        private.append((node.module, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("autopar"):
                    found.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
    for node in ast.walk(tree):  # alias._private
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            private.append((aliases[node.value.id], node.attr))
    return found, private


def _graph():
    mods = _modules()
    g = nx.DiGraph()
    private = []
    for name, path in mods.items():
        g.add_node(name)
        found, priv = _imports(path, mods)
        for target in found:
            if target in mods and target != name:
                g.add_edge(name, target)
        private += [(name, m, n) for m, n in priv]
    return g, private


def test_every_module_belongs_to_a_layer():
    unknown = {_layer(m) for m in _modules()} - set(LAYERS) - {None}
    assert not unknown, f"packages/modules missing from LAYERS: {sorted(unknown)}"


def test_imports_flow_one_way():
    g, _ = _graph()
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = [
        f"{a} -> {b}"
        for a, b in g.edges
        if _layer(a) is not None
        and _layer(b) is not None
        and rank[_layer(b)] > rank[_layer(a)]
    ]
    assert not bad, "imports against the stage order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g, _ = _graph()
    # The package root re-exports the public API; packages' own __init__ hold docs only.
    g.remove_node("autopar")
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def test_no_private_names_across_packages():
    _, private = _graph()
    bad = [
        f"{who} uses {mod}.{name}"
        for who, mod, name in private
        if _layer(who) != _layer(mod)
    ]
    assert not bad, "private names used across packages:\n" + "\n".join(sorted(bad))


def test_modules_stay_small():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"modules over 600 lines (split by responsibility): {big}"
