"""The suite's exactness check (tests/exactness.py) fails an exact comparison of computed floats that says not why,
and leaves alone what it should: a tolerance, a marked line, round values, integers, one computation's values
compared with themselves."""

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CASES = '''
import numpy as np
import pytest
import torch


def third(x):
    return x / 3.0


def test_unmarked_floats():
    assert [third(1.0), 2.0] == [1 / 3, 2.0]


def test_unmarked_array():
    assert np.array_equal(np.arange(4) / 3.0, np.arange(4) / 3.0)


def test_unmarked_tensor():
    assert torch.equal(torch.arange(4.0) / 3, torch.arange(4.0) / 3)


def test_marked():
    assert third(1.0) == 1 / 3  # exact: one division each
    # exact: one division each
    assert {"t": third(1.0)} == {
        "t": 1 / 3}


def test_fine():
    xs = [third(float(i)) for i in range(5)]
    assert xs == sorted(xs)  # one computation's values, in order
    assert third(1.0) == pytest.approx(1 / 3, rel=1e-12)
    assert [0.5, 1.25, 2.5e-05] == [1 / 2, 5 / 4, 0.000025]  # round values
    assert third(1.0) != 0.25 and [1, 2] == [1, 2]
    assert 0 < third(3.0) == 1.0 <= 1.0  # a chain whose every comparison holds


def test_plain_failure():
    assert [1, 2, 3] == [1, 2, 4]
'''


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("exactness")
    (folder / "exactness.py").write_text((HERE / "exactness.py").read_text())
    (folder / "conftest.py").write_text(
        "from exactness import install_equality_checks, install_quick_passing_explanations, pytest_assertion_pass, "
        "pytest_assertrepr_compare, pytest_runtest_call  # noqa: F401\n"
        "install_equality_checks()\ninstall_quick_passing_explanations()\n")
    (folder / "test_cases.py").write_text(CASES)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA", "-q",
                          "-o", "enable_assertion_pass_hook=true", "-o", "addopts=", "test_cases.py"],
                         cwd=folder, capture_output=True, text=True, timeout=300)
    results = {}
    for line in out.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED") and "::" in rest:
            results[rest.split("::")[1].split(" ")[0]] = word
    assert results, out.stdout[-3000:] + out.stderr[-2000:]
    return results | {"stdout": out.stdout}


@pytest.mark.parametrize("name", ["test_unmarked_floats", "test_unmarked_array", "test_unmarked_tensor"])
def test_an_unmarked_exact_comparison_of_computed_floats_fails(outcome, name):
    assert outcome[name] == "FAILED"
    assert "compares computed floats exactly" in outcome["stdout"]


@pytest.mark.parametrize("name", ["test_marked", "test_fine"])
def test_marked_lines_tolerances_and_round_values_pass(outcome, name):
    assert outcome[name] == "PASSED", outcome["stdout"][-3000:]


def test_a_failing_assertion_keeps_pytests_own_message(outcome):
    """Passing assertions skip building their explanation; a failing one still shows pytest's diff."""
    assert outcome["test_plain_failure"] == "FAILED"
    assert "At index 2 diff: 3 != 4" in outcome["stdout"]
