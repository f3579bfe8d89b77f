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
