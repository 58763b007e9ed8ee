"""What both profilers share: the process world (one process, or torchrun's), timing, progress.

Under torchrun every process runs the same sweep at the same time, in lockstep (a barrier before
each measurement), so contention for shared cores, memory bandwidth or links is in the numbers;
rank 0 takes the median over processes of each measurement and writes the profile.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist


class World:
    """This process's place among the profiling processes (a world of one without torchrun)."""

    def __init__(self, device: str = "auto") -> None:
        from flexmesh.runtime.parallel.device import rank_device

        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.owns_group = False
        choice = rank_device(device)  # the rule every command follows (flexmesh.runtime.parallel.device)
        if choice.type == "cuda":
            torch.cuda.set_device(choice.index)
        if self.size > 1 and not dist.is_initialized():
            dist.init_process_group(choice.backend)
            self.owns_group = True
        self.rank = dist.get_rank() if self.size > 1 else 0
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.size)))
        self.nodes = max(1, self.size // max(1, self.local_size))
        self.device = choice.torch_device()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def medians(self, values: list[float]) -> list[float]:
        """Element-wise median over processes of each process's ``values`` (same length everywhere)."""
        if self.size == 1:
            return list(values)
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, list(values))
        return [statistics.median(col) for col in zip(*gathered)]

    def maxes(self, values: list[float]) -> list[float]:
        """Element-wise maximum over processes (the slowest member of a group sets its pace)."""
        if self.size == 1:
            return list(values)
        return [max(col) for col in zip(*self.gather_objects(list(values)))]

    def gather_objects(self, obj) -> list:
        if self.size == 1:
            return [obj]
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def close(self) -> None:
        if self.owns_group:
            dist.barrier()
            dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@contextmanager
def progress(enabled: bool, description: str, total: int):
    """Progress on stderr (rank 0 only), a bar on a terminal and plain lines elsewhere; yields ``advance(label)``."""
    if not enabled:
        yield lambda label=None: None
        return
    from flexmesh.console import progress_steps

    with progress_steps(description, total) as advance:
        yield advance


def device_memory_bytes(device: torch.device, processes: int) -> float:
    """Memory one training process may use: the GPU's, or on CPU the machine's RAM shared by ``processes``."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(ram) / max(1, processes)
