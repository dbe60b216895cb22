"""Print the frontend's subpackage import graph, the arrows that run upward, and any cycles.

Usage: python scripts/import_graph.py [--package frontend] [--modules]

A node is a subpackage of the package (`frontend/openai/`, ...) or, for its top-level modules
(`frontend/model_prep.py`, ...), the module itself. An arrow A -> B means some module in A imports a
module in B (module-level and function-level imports alike; `TYPE_CHECKING` imports too). Every
node has a layer (LAYERS, bottom to top); an arrow is upward when it points at a layer above its
own or, outside the layers whose members may import each other, sideways into the same layer (the
API packages never import each other). With --modules, each arrow lists the module pairs behind it.

This script knows nothing about what the modules do: only the `import` statements in their source.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Bottom to top. A node not named here is reported as unplaced.
LAYERS: list[tuple[str, ...]] = [
    # The engine-core client: the process boundary, speaks enginecore's messages and token ids;
    # imports no room, and every room that needs the engine (metrics, serving, control) sits above.
    ("engine",),
    # The floor: errors, HTTP helpers, metrics counters, shared protocol types, request decoding.
    ("common",),
    ("text",),  # tokenizer, detokenizer, chat options and parsers, structured outputs, logprobs
    # Inputs beside the text: images and video (policy, fetching, processors); the KV-transfer
    # fields and bootstrap of prefill/decode disaggregation.
    ("media", "disagg"),
    ("audio",),  # audio decoding, response formats, Whisper's prompts (audio URLs: media's policy)
    ("serving",),  # request -> engine requests, generation streams, what the chat routes share
    ("openai", "anthropic", "sglang", "lmdeploy", "pooling", "control"),  # the API packages
    # Launch configuration: the CLI and the model preparation it runs; server/ reads the config.
    ("cli", "gguf_model", "model_prep"),
    ("server",),  # the roof: app, routes, middleware (imported only by the entry point)
    # The entry point, and the client library a trainer runs on the other side of the wire
    # (client/ imports no room and no room imports it).
    ("__main__", "client"),
    # tern inside Ray Serve: the server's app as a Serve ingress, so above the roof.
    ("ray_serve",),
    ("rl",),  # RL frameworks' rollout interfaces, over the client or a Ray Serve replica
]
# Layers whose members may import each other (cli -> gguf_model -> model_prep).
SIDEWAYS_OK: set[int] = {LAYERS.index(("cli", "gguf_model", "model_prep"))}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from frontend.openai import protocol` imports the module frontend.openai.protocol.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def node_of(module: str, package: str, modules: set[str]) -> str | None:
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2 or module not in modules:
        return None
    return parts[1]


@dataclass
class Graph:
    nodes: set[str]
    subpackages: list[str]
    arrows: dict[tuple[str, str], set[tuple[str, str]]]  # (src, dst) -> the module pairs
    unplaced: list[str]  # nodes in no layer
    upward: list[tuple[str, str]]
    cycles: list[list[str]]


def analyse(root: Path) -> Graph:
    """The import graph of the package at `root` (a folder named as the package)."""
    package = root.name
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    nodes = {node_of(m, package, modules) for m in modules} - {None}
    layer = {n: i for i, names in enumerate(LAYERS) for n in names}

    arrows: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for name, path in files.items():
        src = node_of(name, package, modules)
        for target in imported_modules(path, name):
            dst = node_of(target, package, modules)
            if src and dst and src != dst:
                arrows[(src, dst)].add((name, target))

    def is_upward(src: str, dst: str) -> bool:
        if src not in layer or dst not in layer:
            return False
        return layer[dst] > layer[src] or (
            layer[dst] == layer[src] and layer[src] not in SIDEWAYS_OK
        )

    return Graph(
        nodes=nodes,
        subpackages=sorted(n for n in nodes if (root / n).is_dir()),
        arrows=arrows,
        unplaced=sorted(n for n in nodes if n not in layer),
        upward=sorted(a for a in arrows if is_upward(*a)),
        cycles=find_cycles(nodes, set(arrows)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="frontend")
    parser.add_argument("--modules", action="store_true", help="list the imports behind each arrow")
    args = parser.parse_args()
    graph = analyse(Path(args.package))
    arrows, subpackages = graph.arrows, graph.subpackages
    print(f"nodes: {len(graph.nodes)} ({len(subpackages)} subpackages: {', '.join(subpackages)})")
    if graph.unplaced:
        print(f"unplaced: {', '.join(graph.unplaced)}")
    sub_arrows = {a for a in arrows if a[0] in subpackages and a[1] in subpackages}
    print(f"arrows: {len(arrows)} ({len(sub_arrows)} between subpackages)")
    for src, dst in sorted(arrows):
        mark = "  UPWARD" if (src, dst) in graph.upward else ""
        print(f"  {src} -> {dst}{mark}")
        if args.modules:
            for a, b in sorted(arrows[(src, dst)]):
                print(f"      {a} -> {b}")
    sub_upward = [a for a in graph.upward if a in sub_arrows]
    print(f"upward: {len(graph.upward)} ({len(sub_upward)} between subpackages)")
    for src, dst in graph.upward:
        print(f"  {src} -> {dst}: " + ", ".join(sorted({a for a, _ in arrows[(src, dst)]})))
    print(f"cycles (strongly connected groups): {len(graph.cycles)}")
    for group in graph.cycles:
        print("  " + " <-> ".join(group))


def find_cycles(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(groups)


if __name__ == "__main__":
    main()
