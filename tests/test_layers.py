"""The package's layers as an import graph: the arrows pyproject's import-linter contracts
forbid stay absent (`lint-imports` checks those in CI), and no module reaches itself
through its imports, counting imports made only for type checking."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph, root: str = "helexa") -> list[list[str]]:
    """Strongly connected groups of more than one module under `root` (Tarjan)."""
    mods = sorted(m for m in graph.modules if m.startswith(root))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if not w.startswith(root):
                continue
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

    for m in mods:
        if m not in index:
            visit(m)
    return groups


def test_no_module_imports_itself_through_others_type_only_imports_included():
    graph = grimp.build_graph("helexa", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import cyc.b\n"
    )
    (pkg / "b.py").write_text("import cyc.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyc", exclude_type_checking_imports=False)
    assert _cycles(graph, "cyc") == [["cyc.a", "cyc.b"]]
