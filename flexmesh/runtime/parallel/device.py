"""Which device each rank computes on: one rule, in one place, for every command that starts ranks.

:func:`choose_device` is a pure function of what the user asked (``--device auto|cpu|cuda``), the
rank's place on its node and the GPUs this node shows, so it is tested on a machine without any.
One process per GPU, as NCCL requires (two ranks on one GPU fail inside NCCL's first collective):

======================  =========================  ==========================================
asked                   GPUs visible vs processes  each rank gets
======================  =========================  ==========================================
``cpu``                 any                        the CPU, gloo
``auto``                none                       the CPU, gloo
``auto`` or ``cuda``    processes <= GPUs          GPU ``local_rank``, NCCL
``auto`` or ``cuda``    processes > GPUs           refused in one line: lower --nproc or --device cpu
``cuda``                none                       refused in one line
======================  =========================  ==========================================

>>> choose_device("auto", local_rank=1, local_world=2, visible_gpus=8)
DeviceChoice(type='cuda', index=1)
>>> choose_device("auto", local_rank=0, local_world=4, visible_gpus=0)
DeviceChoice(type='cpu', index=None)
>>> choose_device("auto", local_rank=0, local_world=4, visible_gpus=1)
Traceback (most recent call last):
...
flexmesh.errors.PlanError: 4 processes on this node but 1 GPU is visible: one process per GPU; use --nproc 1, \
or --device cpu to run all 4 on the CPU
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flexmesh.errors import PlanError

DEVICES = ("auto", "cpu", "cuda")  # what --device accepts


@dataclass(frozen=True)
class DeviceChoice:
    """The device of one rank: ``type`` "cpu" or "cuda", and the CUDA device ``index`` (None on CPU)."""

    type: str
    index: int | None = None

    @property
    def backend(self) -> str:
        """The process-group backend for this device: NCCL on GPUs, gloo on CPUs."""
        return "nccl" if self.type == "cuda" else "gloo"

    def torch_device(self):  # noqa: ANN201 - torch is imported only by the caller that needs it
        import torch

        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'} {'is' if n == 1 else 'are'}"


def choose_device(requested: str, local_rank: int, local_world: int, visible_gpus: int) -> DeviceChoice:
    """The device of the rank ``local_rank`` of ``local_world`` processes on a node showing
    ``visible_gpus`` GPUs, for ``--device requested`` (the table in the module doc)."""
    if requested not in DEVICES:
        raise PlanError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if not 0 <= local_rank < max(1, local_world):
        raise PlanError(f"local rank {local_rank} is outside the {local_world} processes of this node")
    if requested == "cpu" or (requested == "auto" and visible_gpus == 0):
        return DeviceChoice("cpu")
    if visible_gpus == 0:
        raise PlanError("--device cuda but no GPU is visible (no GPU, a torch build without CUDA, or "
                        "CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    if local_world > visible_gpus:
        raise PlanError(f"{local_world} processes on this node but {_gpus(visible_gpus)} visible: one process per "
                        f"GPU; use --nproc {visible_gpus}, or --device cpu to run all {local_world} on the CPU")
    return DeviceChoice("cuda", local_rank)


def visible_gpus() -> int:
    """GPUs this process may use (torch's count, which honours CUDA_VISIBLE_DEVICES); 0 without CUDA.

    A CPU build of torch (its version ends in ``+cpu``, as ``setup.sh`` installs) has none: said without
    importing torch where this process has not yet, since a launcher that only builds torchrun's command
    line would otherwise import it (seconds of CPU) for that one answer."""
    if "torch" not in sys.modules and _cpu_build():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_build() -> bool:
    """Whether the installed torch is a CPU build, read from its package version (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def rank_device(requested: str = "auto") -> DeviceChoice:
    """This process's :func:`choose_device` from torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (a world of
    one without them)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return choose_device(requested, local_rank, local_world, 0 if requested == "cpu" else visible_gpus())


def check_launch(requested: str, nproc: int) -> None:
    """Refuse, before torchrun starts anything, a launch of ``nproc`` processes on this node that
    :func:`choose_device` would refuse in every rank."""
    if requested != "cpu":
        choose_device(requested, 0, nproc, visible_gpus())


def device_name(choice: DeviceChoice) -> str:
    """What the device is called: the GPU's name, or "CPU (N cores)"."""
    if choice.type == "cuda":
        import torch

        return torch.cuda.get_device_name(choice.index)
    return f"CPU ({os.cpu_count()} cores)"


def check_memory(predicted_gib: float | None, requested: str, local_world: int) -> None:
    """Refuse, before anything is allocated, a plan whose peak per rank (``predicted_gib``, the cost
    model's estimate for the plan and model, flexmesh.commands.train_job.estimated_peak; None: a plan
    nothing prices, not checked) cannot fit this node: on GPUs one
    rank per GPU against the GPU's memory, on the CPU ``local_world`` ranks against the machine's RAM
    (MemTotal, the same figure on every rank, so every rank decides alike)."""
    if not predicted_gib:
        return
    choice = choose_device(requested, 0, local_world, 0 if requested == "cpu" else visible_gpus())
    if choice.type == "cuda":
        import torch

        have = torch.cuda.get_device_properties(0).total_memory / 2**30
        need, where = predicted_gib, f"{device_name(choice)} has {have:.1f} GiB"
    else:
        have = _ram_gib()
        need, where = predicted_gib * local_world, f"{local_world} rank(s) on this machine's {have:.1f} GiB of RAM"
    if have and need > have:
        raise PlanError(f"the plan needs a peak of {predicted_gib:.1f} GiB per rank (the cost model's estimate for "
                        f"this plan and model), {need:.1f} GiB here, but "
                        f"{where}: plan for this machine (flexmesh plan --cluster NxLOCAL, or a smaller --seq-len, "
                        "--global-batch or model)")


def _ram_gib() -> float:
    """This machine's RAM in GiB (Linux /proc/meminfo; 0 where it cannot be read: not checked)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return 0.0
