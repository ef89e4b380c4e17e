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
#: and earlier ones only. ``compat`` (PyTorch's private APIs, importing nothing of autopar)
#: is shared by all, ``errors`` too; ``pipeline`` and ``api`` compose.
LAYERS = (
    "compat",
    "errors",
    "logs",
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


#: Modules that still reach PyTorch's private names themselves: being migrated to
#: ``autopar.compat`` (another change is editing them now). Remove each once it is.
PRIVATE_TORCH_ALLOWED = {
    "autopar.compat",  # the one door
    "autopar.codegen.inductor",  # being migrated
    "autopar.codegen.inductor_streams",  # being migrated
    "autopar.codegen.cuda",  # being migrated
    "autopar.codegen.emit",  # being migrated
    "autopar.adapt.monitor",  # being migrated
    "autopar.planning.simulate",  # being migrated
}


def _private_torch(dotted: str) -> bool:
    """Whether a dotted name is private PyTorch: ``torch._x...``, or a private module or name
    under a public package (``torch.utils._pytree``); operator names (``torch.ops.aten._foo``)
    are public."""
    parts = dotted.split(".")
    if parts[0] != "torch" or len(parts) < 2 or parts[1] == "ops":
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_torch_uses(source: str) -> list[str]:
    """``line: name`` of every private PyTorch name a module's source reaches: attribute
    chains (``torch._C._foo``, ``torch.utils._pytree.x``) and imports (``from torch._dynamo
    import x``, ``import torch._inductor``, ``from torch.utils import _pytree``). Docstrings
    and comments do not count; ``if TYPE_CHECKING:`` imports do."""
    found: list[tuple[int, str]] = []
    inner: set[int] = set()  # attributes inside a longer chain (seen with it)
    for node in ast.walk(ast.parse(source)):  # breadth first: a chain before its parts
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            part = node.value
            while isinstance(part, ast.Attribute):
                inner.add(id(part))
                part = part.value
            names = [d] if (d := _dotted(node)) else []
        found += [(node.lineno, n) for n in names if _private_torch(n)]
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_private_torch_names_only_in_compat():
    """Every use of a private PyTorch API goes through ``autopar.compat``, which knows the
    releases the project has tested; no other module names ``torch._*`` itself."""
    bad = []
    for name, path in sorted(_modules().items()):
        if name in PRIVATE_TORCH_ALLOWED:
            continue
        bad += [f"{name}:{use}" for use in _private_torch_uses(path.read_text())]
    assert not bad, "private PyTorch names outside autopar.compat:\n" + "\n".join(bad)


def test_the_private_torch_check_sees_every_form():
    source = (
        '"""torch._dynamo in a docstring is text."""\n'
        "import torch._dynamo\n"
        "from torch._inductor import config\n"
        "from torch.utils import _pytree\n"
        "x = isinstance(y, torch._ops.OpOverload)\n"
        "z = torch.utils._pytree.tree_leaves(w)\n"
        "def f():\n"
        "    from torch._functorch.partitioners import default_partition\n"
        "ok = torch.ops.aten._unsafe_view.default, torch.fx.Node, torch.compile, x._y\n"
    )
    assert _private_torch_uses(source) == [
        "2: torch._dynamo",
        "3: torch._inductor.config",
        "4: torch.utils._pytree",
        "5: torch._ops.OpOverload",
        "6: torch.utils._pytree.tree_leaves",
        "8: torch._functorch.partitioners.default_partition",
    ]
