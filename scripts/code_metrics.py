"""The shape of tern's own code, as issue reviews measure it: functions over 50 lines, the largest
classes (lines and methods) and modules, in the three processes' packages (tests and scripts left
out). Reads the source with `ast`; imports and runs nothing.

    python scripts/code_metrics.py [--limit 50] [--top 10] [PACKAGE ...]

The subpackage import graph of frontend/ is scripts/import_graph.py's; duplicated blocks are the
workplace's `duplicates` tool's.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("frontend", "enginecore", "workers")


def _sources(packages: list[str]) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def measure(packages: list[str], limit: int) -> dict[str, list[tuple[int, str]]]:
    """Long functions, classes (lines, with their method count in the name) and modules."""
    long_functions, classes, modules = [], [], []
    for path in _sources(packages):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        modules.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > limit:
                long_functions.append((_span(node), f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.ClassDef):
                methods = sum(
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body
                )
                classes.append(
                    (_span(node), f"{rel}:{node.lineno} {node.name} ({methods} methods)")
                )
    return {
        f"functions over {limit} lines": sorted(long_functions, reverse=True),
        "largest classes": sorted(classes, reverse=True),
        "largest modules": sorted(modules, reverse=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(PACKAGES))
    parser.add_argument("--limit", type=int, default=50, help="a long function has more lines")
    parser.add_argument("--top", type=int, default=10, help="rows of each table")
    args = parser.parse_args()
    for title, rows in measure(args.packages, args.limit).items():
        count = f" ({len(rows)})" if title.startswith("functions") else ""
        print(f"{title}{count}:")
        for lines, where in rows[: args.top]:
            print(f"  {lines:5d}  {where}")


if __name__ == "__main__":
    main()
