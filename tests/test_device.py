"""The device of each rank: one rule (flexmesh.runtime.parallel.device.choose_device), tested without a GPU
for 0, 1, 2, 4 and 8 visible GPUs against 1 to 8 processes per node, and its refusals on the CLI."""

from __future__ import annotations

import pytest

from flexmesh.errors import PlanError
from flexmesh.runtime.parallel import device as D
from flexmesh.runtime.parallel.device import DeviceChoice, choose_device


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("nproc", range(1, 9))
@pytest.mark.parametrize("asked", ["auto", "cuda", "cpu"])
def test_every_rank_gets_a_device_of_its_own_or_the_launch_is_refused(gpus, nproc, asked):
    if asked == "cpu" or (asked == "auto" and gpus == 0):
        assert {choose_device(asked, r, nproc, gpus) for r in range(nproc)} == {DeviceChoice("cpu")}
        assert choose_device(asked, 0, nproc, gpus).backend == "gloo"
        return
    if gpus == 0:
        with pytest.raises(PlanError, match="no GPU is visible.*--device cpu"):
            choose_device(asked, 0, nproc, gpus)
        return
    if nproc > gpus:
        with pytest.raises(PlanError) as e:
            choose_device(asked, 0, nproc, gpus)
        msg = str(e.value)
        assert f"{nproc} processes" in msg and f"--nproc {gpus}" in msg and "--device cpu" in msg
        assert "\n" not in msg  # one line
        return
    chosen = [choose_device(asked, r, nproc, gpus) for r in range(nproc)]
    assert [c.index for c in chosen] == list(range(nproc))  # one GPU per rank, none shared
    assert all(c.type == "cuda" and c.backend == "nccl" for c in chosen)


def test_bad_requests_are_refused():
    with pytest.raises(PlanError, match="--device must be one of auto, cpu, cuda"):
        choose_device("gpu", 0, 1, 1)
    with pytest.raises(PlanError, match="local rank 3 is outside the 2 processes"):
        choose_device("auto", 3, 2, 8)


def test_rank_device_reads_torchruns_variables(monkeypatch):
    monkeypatch.setattr(D, "visible_gpus", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert D.rank_device("auto") == DeviceChoice("cuda", 2)
    assert D.rank_device("cpu") == DeviceChoice("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(PlanError, match="8 processes on this node but 4 GPUs are visible"):
        D.rank_device("auto")


def test_launch_is_checked_before_anything_starts(monkeypatch):
    monkeypatch.setattr(D, "visible_gpus", lambda: 2)
    D.check_launch("auto", 2)
    D.check_launch("cpu", 8)  # the CPU takes any number of processes
    with pytest.raises(PlanError, match="4 processes on this node but 2 GPUs are visible"):
        D.check_launch("auto", 4)


def test_train_refuses_cuda_on_a_machine_without_gpus_in_one_line(tmp_path):
    """On this CPU machine --device cuda fails in the launcher, before torchrun, with one line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from helpers import flexmesh_here, write_inputs

    _, corpus, plan = write_inputs(tmp_path, world=2)
    proc = flexmesh_here("train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1", "--out",
                         str(tmp_path / "run"), "--nproc", "2", "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    assert "no GPU is visible" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_cpu_build_of_torch_counts_no_gpu_without_importing_torch():
    """A launcher (`train --nproc`, `profile --nproc`) asks how many GPUs there are before torchrun starts
    anything: under a CPU build of torch the answer is 0 without importing torch; under any other build,
    or once torch is imported, torch's own count."""
    import subprocess
    import sys

    probe = ("import sys; from flexmesh.runtime.parallel.device import visible_gpus, _cpu_build; "
             "n = visible_gpus(); print(n, 'torch' in sys.modules, _cpu_build())")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    count, imported, cpu_build = got.stdout.split()
    import torch

    assert int(count) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert cpu_build == str(torch.__version__.endswith("+cpu"))
    assert imported == str(cpu_build != "True")  # imported only where the build may have CUDA
    # torch already imported (tests, ranks): its count, whatever the build says
    assert D.visible_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_train_refuses_a_plan_of_another_size_in_the_launcher_in_one_line(tmp_path):
    """A plan of 2 ranks launched with --nproc 1 is refused before torchrun (each rank used to say it, then
    torchrun's traceback followed), and nothing is written."""
    from helpers import flexmesh_here, write_inputs

    _, corpus, plan = write_inputs(tmp_path, world=2)
    proc = flexmesh_here("train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1", "--out",
                         str(tmp_path / "run"), "--nproc", "1", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("is for 2 ranks but 1 were launched; use --nproc 2 (or torchrun "
                                        "--nproc-per-node 2), or re-plan") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
