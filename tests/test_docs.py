"""Examples in docstrings and docs/ are run, so the documentation stays true."""

import doctest
import importlib
from pathlib import Path

import pytest

MODULES = ["flexmesh.spec.model", "flexmesh.layout.strategy", "flexmesh.cost.model", "flexmesh.cost.hardware"]
DOCS = sorted(p.name for p in (Path(__file__).parent.parent / "docs").glob("*.md")
              if ">>> " in p.read_text())


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.parametrize("name", DOCS)
def test_doc_examples(name):
    path = Path(__file__).parent.parent / "docs" / name
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
