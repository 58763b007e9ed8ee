"""Code-health tools run with the tests: the import-linter layer contracts, ruff and mypy (all from
``.[dev]``, configured in pyproject.toml), and the size limit on modules."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 500


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


def test_no_module_over_limit():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "flexmesh").rglob("*.py")}
    big = {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them along their seams): {big}"
