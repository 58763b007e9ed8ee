"""Examples in docs/ are run, so the documentation stays true (docstring examples in the package run
through pytest's --doctest-modules, configured in pyproject.toml)."""

import doctest
from pathlib import Path

import pytest

DOCS = sorted(p.name for p in (Path(__file__).parent.parent / "docs").glob("*.md")
              if ">>> " in p.read_text())


@pytest.mark.parametrize("name", DOCS)
def test_doc_examples(name):
    path = Path(__file__).parent.parent / "docs" / name
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
