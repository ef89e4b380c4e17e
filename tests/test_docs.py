"""The documentation cites only what exists: every repository path, relative link and
``autopar.`` module name in README.md, CHANGELOG.md, docs/*.md, benchmarks/README.md and
profiles/README.md resolves in this checkout.

The rules:

* a path that starts with one of the repository's folders (``src/``, ``docs/``,
  ``benchmarks/``, ``tests/``, ``scripts/``, ``examples/``, ``notebooks/``, ``profiles/``,
  ``.ci/``) names a file or folder that exists; a ``*`` in it must match one at least;
  ``tests/x.py::name`` is checked as ``tests/x.py``. A path from the package on
  (``autopar/api.py``) or from one of its subpackages (``capture/backend.py``, as the docs
  shorten them) is looked for under ``src/autopar``. ``results/`` is skipped: it is what the
  commands write (and ignored by git), never part of a checkout;
* a relative Markdown link ``[text](target)`` resolves from the document's own folder;
* ``autopar.a.b.c`` resolves to a module under ``src/autopar`` and, past the longest module
  prefix, to a name that module defines or imports at its top level (a module's attribute:
  ``autopar.profiling.store.STORE_VERSION``). A name written in backticks from a subpackage
  on (``profiling.store.STORE_VERSION``, as the docs shorten them) is read as under
  ``autopar.``.
  A name in double quotes is a string (``node.meta["autopar.key"]``), not a module.
"""

from __future__ import annotations

import ast
import functools
import glob
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
     ROOT / "profiles" / "README.md", *(ROOT / "docs").glob("*.md")]
)  # fmt: skip
FOLDERS = ("src", "docs", "benchmarks", "tests", "scripts", "examples", "notebooks", "profiles",
           r"\.ci")  # fmt: skip
SUBPACKAGES = sorted(
    p.name for p in (SRC / "autopar").iterdir() if (p / "__init__.py").exists()
)


def _path_pattern(folders, files_only: bool = False) -> re.Pattern:
    top = "(?:" + "|".join(folders) + ")/"
    if files_only:  # a file name with its extension: "autopar/best" is a ratio, not a path
        return re.compile(rf"(?<![\w./~$:-])({top}[\w./*-]*\.[a-z]+)(?![\w/])")
    return re.compile(rf"(?<![\w./~$:-])({top}[\w./*-]*[\w/*]|{top})")


#: (pattern, the folder its paths are relative to). A path is not part of a longer path or a
#: URL (``~/.cache/autopar/profiles``, ``https://host/src/x``) and ends on a name character,
#: ``/`` or ``*`` (so a sentence's full stop is not part of it).
PATHS = ((_path_pattern(FOLDERS), ROOT), (_path_pattern(["autopar"], True), SRC),
         (_path_pattern(SUBPACKAGES, True), SRC / "autopar"))  # fmt: skip
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"(?<![\w.\"])autopar(?:\.[A-Za-z_]\w*)+")
SHORT_MODULE = re.compile(rf"`((?:{'|'.join(SUBPACKAGES)})(?:\.[A-Za-z_]\w*)+)")


def _missing_paths(text: str) -> list[str]:
    missing = []
    for pattern, base in PATHS:
        for m in pattern.finditer(text):
            path = m.group(1)
            found = glob.glob(str(base / path)) if "*" in path else (base / path).exists()
            if not found:
                missing.append(path)
    return missing


def _missing_links(doc: pathlib.Path, text: str) -> list[str]:
    missing = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
    return missing


@functools.cache
def _top_level_names(path: pathlib.Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):  # guarded definitions count too
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return frozenset(names)


def _module_file(parts: list[str]) -> pathlib.Path | None:
    base = SRC.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def resolves(dotted: str) -> bool:
    """Whether ``autopar.x.y[.name]`` names a module under src/, or a top-level name of one.

    Example::

        >>> resolves("autopar.profiling.store.default_dir"), resolves("autopar.no_such")
        (True, False)
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is None:
            continue
        if cut == len(parts):
            return True
        rest = parts[cut]
        if rest in _top_level_names(path):
            return True
        return path.name == "__init__.py" and _module_file(parts[: cut + 1]) is not None
    return False


def _missing_modules(text: str) -> list[str]:
    names = {m.group(0).rstrip(".") for m in MODULE.finditer(text)}
    names |= {"autopar." + m.group(1) for m in SHORT_MODULE.finditer(text)}
    return sorted(n for n in names if not resolves(n))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_what_exists(doc):
    text = doc.read_text(encoding="utf-8")
    problems = {
        "paths": _missing_paths(text),
        "links": _missing_links(doc, text),
        "modules": _missing_modules(text),
    }
    problems = {k: sorted(set(v)) for k, v in problems.items() if v}
    assert not problems, f"{doc.relative_to(ROOT)} cites what does not exist: {problems}"


def test_results_folder_is_output():
    """``results/`` paths are not checked because the commands write them: git ignores the
    folder, so no checkout has it."""
    assert "results/" in (ROOT / ".gitignore").read_text().split()


def test_the_checker_catches_dead_citations(tmp_path):
    doc = tmp_path / "x.md"
    text = (
        "See src/autopar/no_such.py, capture/gone.py, `runtime.no_such_module`, "
        "autopar.profiling.store.nope and [a link](no_such.md); results/any/thing.json, "
        "~/.cache/autopar/profiles and node.meta[\"autopar.key\"] are fine, as are "
        "src/autopar/api.py, tests/test_docs.py::test_x, autopar/api.py, profiling/store.py, "
        "`profiling.store`, autopar.compile and src/autopar/profiling/*.py."
    )
    assert _missing_paths(text) == ["src/autopar/no_such.py", "capture/gone.py"]
    assert _missing_links(doc, text) == ["no_such.md"]
    assert _missing_modules(text) == [
        "autopar.profiling.store.nope",
        "autopar.runtime.no_such_module",
    ]


def _benchmark_imports(path: pathlib.Path) -> list[str]:
    """``autopar`` names a benchmark script imports (``from m import n`` as ``m.n``), at any
    depth of the script (imports inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autopar"):
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("autopar")]
    return names


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmark_scripts_import_what_exists(script):
    """A benchmark left behind by a refactor fails here, not when someone runs it."""
    missing = [n for n in _benchmark_imports(script) if not resolves(n)]
    assert not missing, f"{script.name} imports what does not exist: {missing}"
