"""The example outputs in docs/ are what the commands print now (docs/examples.py regenerates them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # every documented command, about 40 s: the full suite runs it, the quick pass does not
@pytest.mark.timeout(600)
def test_docs_examples_match_the_commands(monkeypatch, capsys):
    # The script's main() in this process (it runs each example's command in process either way): no child
    # interpreter importing flexmesh's commands again.
    monkeypatch.setattr(sys, "argv", ["examples.py", "--check", "--quick"])
    code = _examples().main()
    out, err = capsys.readouterr()
    assert code == 0, out + err


def _examples():
    """docs/examples.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("examples", ROOT / "docs" / "examples.py")
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    return examples


def test_the_check_finds_a_stale_example(tmp_path, monkeypatch, capsys, no_recommendation):
    """The script's check, rewrite and check again, by its main() in this process (the script runs each
    example's command in process either way: only the interpreter's start is saved)."""
    examples = _examples()

    def script(*argv: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["examples.py", *argv])
        code = examples.main()
        return code, capsys.readouterr().out

    doc = tmp_path / "doc.md"
    doc.write_text("<!-- example: flexmesh plan --model tiny --cluster 2xA100-80GB --seq-len 512 --global-batch 4 "
                   "--top 1 -->\n```\n$ flexmesh plan\nan output no command prints\n```\n<!-- /example -->\n")
    code, said = script("--check", str(doc))
    assert code == 1 and "stale example: doc.md" in said
    code, _ = script(str(doc))
    assert code == 0 and "best plans" in doc.read_text()
    code, said = script("--check", str(doc))
    assert code == 0, said


def test_the_check_ignores_where_a_longer_time_moves_a_title_but_not_a_changed_figure():
    examples = _examples()
    before = " plan: step 11.966 s (636 configurations;\n                search 3.89 s, baselines 0.57 s)"
    slow = "plan: step 11.966 s (636 configurations; search\n               10.38 s, baselines 1.02 s)"
    assert examples.masked(before) == examples.masked(slow)
    assert examples.masked(before) != examples.masked(before.replace("11.966", "11.967"))
