"""Print autopar's package-level import graph, read from the source with ``ast``.

The table in docs/architecture.md ("The import graph") is this script's output. Every
``import autopar.x`` / ``from autopar.x import ...`` counts, lazy imports inside functions
included; imports under ``if TYPE_CHECKING:`` (annotations only) do not: the rule of
tests/test_architecture.py, which enforces the direction.

    .venv/bin/python scripts/import_graph.py             # package -> packages it imports
    .venv/bin/python scripts/import_graph.py --modules   # module -> modules of other packages
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections import defaultdict

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "autopar"


def module_name(path: pathlib.Path) -> str:
    parts = ("autopar", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package(module: str) -> str | None:
    """``autopar.capture.backend`` -> ``capture``; the package root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for t in ast.walk(tree)
        if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
        for b in t.body
        for n in ast.walk(b)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autopar."):
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autopar.")}
    return found


def main(argv: list[str]) -> int:
    per_module = "--modules" in argv
    mods = {module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for target in imports(path) & mods.keys():
            a, b = package(name), package(target)
            if a and b and a != b:
                edges[name if per_module else a].add(target if per_module else b)
    rows = sorted(edges) if per_module else sorted({package(m) for m in mods} - {None})
    for row in rows:
        print(f"{row:<12} -> {', '.join(sorted(edges.get(row, ()))) or '(nothing)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
