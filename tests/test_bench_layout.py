"""bench/ as one package: no import circle among its modules (lazy imports inside
functions included), none of its modules over 450 lines, and app/ and connector/ never
import it (tests/test_layout.py)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
MAX_LINES = 450


def _module(path: Path) -> str:
    parts = path.relative_to(BENCH.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in BENCH.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                edges.add(node.module)
                # `from bench import report`: the submodule, when there is one
                edges |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def test_no_import_circle_in_bench():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            assert state.get(nxt) != 1, " -> ".join(path + [name, nxt])
            if nxt not in state:
                visit(nxt, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_bench_modules_stay_small():
    sizes = {str(p.relative_to(BENCH.parent)): len(p.read_text().splitlines()) for p in BENCH.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > MAX_LINES}
