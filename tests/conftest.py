import os
import sys
from pathlib import Path

import pytest

# One intra-op thread per process: multi-process tests put up to four ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# flexmesh's cache (token stores, tokenizers, this machine's kept profiles) in a folder of this test
# session, inherited by every child process: tests never write into the user's ~/.cache/flexmesh.
if "FLEXMESH_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["FLEXMESH_CACHE"] = tempfile.mkdtemp(prefix="flexmesh-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FLEXMESH_CACHE"], ignore_errors=True)

# Test files import what they share from tests/helpers.py as `helpers`, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.register_assert_rewrite("helpers")  # its assertions explained and checked as the test files' are

# No exact comparison of computed floats without a reason (tests/exactness.py): the hooks, and the array
# equality functions wrapped.
from exactness import (  # noqa: E402, F401
    install_equality_checks,
    install_quick_passing_explanations,
    pytest_assertion_pass,
    pytest_assertrepr_compare,
    pytest_runtest_call,
)

install_equality_checks()
install_quick_passing_explanations()

# Scripts that run on the commit before the plan types merged (their docstrings say how), not here.
collect_ignore = ["golden/record_losses.py", "golden/make_old_runs.py"]


@pytest.fixture
def no_recommendation(monkeypatch):
    """`flexmesh plan` (in this process) without its policy recommendation: the simulated steps behind its
    "recommended:" line, most of a plan's time on small models and much of it on big ones. For tests that
    check the plans and baselines, not that line: tests/test_plan_recommendation.py checks what it says and
    tests/test_docs_examples.py the line of each documented command."""
    from flexmesh.commands import plan as plan_command

    monkeypatch.setattr(plan_command, "_recommended", lambda plan, job, work, asked: plan_command.Recommended(None, ""))


# The files that take longest on the CI machine (2 cores, no GPU), longest first: whole suite, then
# what is left of each under `-m "not slow"` (a file whose every test is slow is not collected there).
# A file long as a whole is started early, so that it does not run alone at the end while the other
# worker has nothing left; the rest follows in the order below.
LONGEST_FILES = ["test_demo.py", "test_failures.py", "test_adaptive_runtime.py", "test_vllm_export.py",
                 "test_bench_gpu.py", "test_profile_cli.py", "test_search.py", "test_docs_examples.py", "test_tools.py"]
LONGEST_QUICK_FILES = ["test_cut_documents.py", "test_mixed_plan.py", "test_simulate_cli.py"]


def _file_order(items) -> dict:
    """File -> its place: the listed longest files in their order, then the other files holding slow
    tests, then the rest (collection order within each)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    longest = LONGEST_FILES if slow_files else LONGEST_QUICK_FILES
    rank = {name: i for i, name in enumerate(longest)}
    return {item.path: (rank.get(item.path.name, len(rank)), item.path not in slow_files) for item in items}


@pytest.hookimpl(trylast=True)  # after `-m` deselected what it leaves out
def pytest_collection_modifyitems(config, items):
    """Files in the order of :func:`_file_order` (pyproject.toml gives each file whole to one of two
    workers, in this order: the long ones start early and the many short ones fill in at the end);
    tests marked ``cuda`` need a GPU: skipped, with the reason, where torch sees none."""
    order = _file_order(items)
    items.sort(key=lambda item: order[item.path])  # stable: the order within each file stays
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
