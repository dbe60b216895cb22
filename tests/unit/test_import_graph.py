"""frontend/'s rooms stay in their layers (docs/architecture.md "The rooms"): every subpackage
and top-level module is placed in scripts/import_graph.py's LAYERS, no import points up a layer or
sideways between API packages, and the graph has no cycle."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _load_script

ROOT = Path(__file__).resolve().parents[2]


def test_frontend_rooms_import_only_downward_and_without_cycles():
    graph = _load_script("import_graph").analyse(ROOT / "frontend")
    assert len(graph.subpackages) > 10 and graph.arrows
    assert graph.unplaced == []
    assert graph.upward == [], {a: sorted(graph.arrows[a]) for a in graph.upward}
    assert graph.cycles == []


def test_an_upward_import_is_reported(tmp_path: Path):
    # The check above could pass on a graph it failed to read: a planted upward arrow shows.
    package = tmp_path / "frontend"
    for room in ("common", "server"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "server" / "app.py").write_text("X = 1\n")
    (package / "common" / "errors.py").write_text("from frontend.server.app import X\n")
    graph = _load_script("import_graph").analyse(package)
    assert graph.upward == [("common", "server")]
    assert graph.cycles == [] and graph.unplaced == []
