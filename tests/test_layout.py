"""The layout's rules, read from the code: layers point one way and the turn pipeline
runs without Ray or vLLM."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_turn_pipeline_imports_neither_ray_nor_vllm():
    code = (
        "import sys, app.turn.turns, app.turn.legs, app.turn.placement, app.turn.pacing;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'torch'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_layers_point_one_way():
    """connector/ never imports app/ or bench/; app/ never imports bench/; packages in
    app/ import no entry module but config and errors."""
    for path in (ROOT / "connector").rglob("*.py"):
        assert not {m for m in _imports(path) if m.split(".")[0] in ("app", "bench")}, path
    for path in (ROOT / "app").rglob("*.py"):
        mods = _imports(path)
        assert not {m for m in mods if m.split(".")[0] == "bench"}, path
        if path.parent != ROOT / "app":
            assert "app.builder" not in mods, path


def test_the_app_top_level_holds_packages_and_entry_modules():
    modules = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert modules == ["__init__.py", "builder.py", "errors.py"], modules
    packages = sorted(p.parent.name for p in (ROOT / "app").glob("*/__init__.py"))
    assert packages == ["api", "config", "engines", "fleet", "turn"], packages


def _module_graph() -> dict[str, set[str]]:
    """Every module of app/ and connector/ and the project modules it imports (deferred
    imports too; a package's own `__init__` excluded)."""
    paths = {}
    for path in [*ROOT.glob("app/**/*.py"), *ROOT.glob("connector/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        paths[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                edges |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {e for e in edges if e in paths and e != name and not name.startswith(e + ".")}
    return graph


def test_no_import_circle_in_app_or_connector():
    graph = _module_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_module_over_450_lines():
    big = {
        str(p.relative_to(ROOT)): n
        for p in [*ROOT.glob("app/**/*.py"), *ROOT.glob("connector/**/*.py")]
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert not big, big
