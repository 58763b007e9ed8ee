import os
import sys
from pathlib import Path

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

# Scripts that run on the commit before the plan types merged (their docstrings say how), not here.
collect_ignore = ["golden/record_losses.py", "golden/make_old_runs.py"]


def pytest_collection_modifyitems(config, items):
    """Files holding slow tests first (pyproject.toml gives each file whole to one of two workers, in
    this order: the long ones start early and the many short ones fill in at the end); tests marked
    ``cuda`` need a GPU: skipped, with the reason, where torch sees none."""
    import pytest

    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each file stays
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
