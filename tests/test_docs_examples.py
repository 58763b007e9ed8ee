"""The example outputs in docs/ are what the commands print now (docs/examples.py regenerates them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_docs_examples_match_the_commands():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "examples.py"), "--check", "--quick"],
                          capture_output=True, text=True, timeout=550)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_finds_a_stale_example(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- example: flexmesh plan --model tiny --cluster 2xA100-80GB --seq-len 512 --global-batch 4 "
                   "--top 1 -->\n```\n$ flexmesh plan\nan output no command prints\n```\n<!-- /example -->\n")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "examples.py"), "--check", str(doc)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "stale example: doc.md" in done.stdout
    fixed = subprocess.run([sys.executable, str(ROOT / "docs" / "examples.py"), str(doc)], capture_output=True,
                           text=True, timeout=300)
    assert fixed.returncode == 0 and "best plans" in doc.read_text()
    again = subprocess.run([sys.executable, str(ROOT / "docs" / "examples.py"), "--check", str(doc)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout


def test_the_check_ignores_where_a_longer_time_moves_a_title_but_not_a_changed_figure():
    import importlib.util

    spec = importlib.util.spec_from_file_location("examples", ROOT / "docs" / "examples.py")
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    before = " plan: step 11.966 s (636 configurations;\n                search 3.89 s, baselines 0.57 s)"
    slow = "plan: step 11.966 s (636 configurations; search\n               10.38 s, baselines 1.02 s)"
    assert examples.masked(before) == examples.masked(slow)
    assert examples.masked(before) != examples.masked(before.replace("11.966", "11.967"))
