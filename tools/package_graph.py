"""The package graph of ``treadle/``, read from the imports with ``ast``.

    python tools/package_graph.py            print the picture (a Mermaid flowchart)
    python tools/package_graph.py --write    replace the picture in docs/architecture.md

A unit is a package under ``treadle/`` (``treadle.core``) or a top-level module
(``treadle.config``). Every import counts: top-level, lazy inside a function, or for type
checking. The picture draws each unit once and an arrow ``a --> b`` where ``a`` imports ``b``,
leaving out arrows that a longer path already implies (the transitive reduction), so what is
left is the skeleton of the layering. ``tests/test_import_graph.py`` checks the layering itself
and that the picture in the docs is the one this script draws.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "treadle"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- package-graph:begin -->", "<!-- package-graph:end -->"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = modules()


def owner(name: str) -> str:
    """The longest module name that ``name`` (a module or a name inside one) starts with."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> set[str]:
    """The package's modules (and outside top-level packages) that ``module`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from pkg import sub" imports the submodule sub; "from mod import name", mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        out |= {owner(n) if n.split(".")[0] == "treadle" else n.split(".")[0] for n in names}
    out.discard(module)
    return out


def unit(module: str) -> str:
    """``treadle.core.scheduler`` -> ``treadle.core``; top-level modules are their own unit."""
    parts = module.split(".")
    return ".".join(parts[:2])


def unit_edges() -> dict[str, set[str]]:
    """Unit -> the other units it imports (the package root, which only re-exports, left out)."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        src = unit(module)
        if src == "treadle":
            continue
        targets = {unit(t) for t in imports(module) if t.startswith("treadle.")}
        edges.setdefault(src, set()).update(targets - {src, "treadle"})
    return edges


def reduce(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows no longer path implies (the graph must have no cycle)."""
    def reach(a: str, seen: set[str]) -> set[str]:
        for b in edges.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    return {a: {b for b in bs if not any(b in reach(c, set()) for c in bs - {b})} for a, bs in edges.items()}


def picture() -> str:
    """The Mermaid flowchart of the reduced unit graph, arrows pointing down to what is imported."""
    edges = reduce(unit_edges())
    lines = ["```mermaid", "flowchart TD"]
    for a in sorted(edges):
        short = a.removeprefix("treadle.")
        if not edges[a]:
            lines.append(f"    {short}")
        lines += [f"    {short} --> {b.removeprefix('treadle.')}" for b in sorted(edges[a])]
    return "\n".join([*lines, "```"])


def doc_picture(text: str) -> str:
    """The picture between the markers in ``text`` (empty when there are none)."""
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"replace the picture in {DOC.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    new = picture()
    if not args.write:
        print(new)
        return 0
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{new}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
