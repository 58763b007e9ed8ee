"""Code-health tools run with the tests: the import-linter layer contracts, ruff and mypy (all from
``.[dev]``, configured in pyproject.toml), the length limit on functions and one name per class."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A function longer than this holds more than one idea: split it along its seams (a module holds as many
# functions as its one idea needs: no limit on module length, which only invites trimming to a count).
MAX_FUNCTION_LINES = 100
# The named exceptions, each a sequence read top to bottom that splitting would scatter.
LONG_FUNCTIONS = {
    "flexmesh/runtime/train/loop.py:fit": "the training loop: one step's phases in their order",
    "flexmesh/commands/train_args.py:add_arguments": "the flags of flexmesh train, one add_argument each",
    "flexmesh/commands/demo.py:run": "the demo's steps in order, each a few lines",
    "flexmesh/commands/plan.py:run": "flexmesh plan: resolve, search, print and write, in order",
}


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _tool(name: str) -> str:
    """The console script next to this Python (the one `pip install -e .[dev]` put there)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; run `bash setup.sh` (it installs .[dev])")
    return found


def test_import_layers():
    out = _run([_tool("lint-imports"), "--no-cache"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff():
    out = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "flexmesh", "tests", "bench"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.slow  # a whole-tree check of about 50 s in a fresh clone: the full suite runs it, the quick pass does not
def test_mypy():
    out = _run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def _definitions():
    """(``path:name``, lines) of every function and (``path``, name) of every class in flexmesh/."""
    functions, classes = {}, []
    for path in sorted((ROOT / "flexmesh").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{rel}:{node.name}"] = max(functions.get(f"{rel}:{node.name}", 0),
                                                      node.end_lineno - node.lineno + 1)
            elif isinstance(node, ast.ClassDef):
                classes.append((rel, node.name))
    return functions, classes


def test_no_function_over_limit_outside_the_named_exceptions():
    functions, _ = _definitions()
    long = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES and f not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them along their seams): {long}"
    gone = [f for f in LONG_FUNCTIONS if functions.get(f, 0) <= MAX_FUNCTION_LINES]
    assert not gone, f"named as long but no longer are (take them off LONG_FUNCTIONS): {gone}"


def test_every_class_name_is_defined_once():
    _, classes = _definitions()
    where: dict[str, list[str]] = {}
    for path, name in classes:
        where.setdefault(name, []).append(path)
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"class names defined more than once (one name per concept): {twice}"
