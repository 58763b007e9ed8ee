"""The best plans: the search's candidates ranked beside the uniform baselines, or why nothing fits.

Uniform baselines (flexmesh.search.uniform_baselines) lie inside the search's space; ranking their best plans
with the searched ones makes the result never worse than them, and ``origin`` says which one won. A baseline
the runtime does not run as priced (a mixture of experts under Megatron-LM's whole-expert parallelism) is shown
beside the result, never ranked into it.
This module sits on top of flexmesh.search.driver and flexmesh.search.uniform_baselines, which do not know each
other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from flexmesh.errors import PlanError
from flexmesh.layout.strategy import Recompute
from flexmesh.search.driver import Progress, SearchOutcome, search
from flexmesh.search.space import FULL_SPACE, Candidate, SearchRequest, batches_near
from flexmesh.search.uniform_baselines import Misses, runtime_runs
from flexmesh.search.uniform_baselines import baselines as uniform_baselines


@dataclass
class SearchResult:
    """What ``flexmesh plan`` prints: the best plans, how the search ran, and each baseline's best."""

    plans: list[Candidate]  # best first; every one fits in memory
    search_seconds: float
    mode: str  # "exact" or "fast"
    configurations: int  # (pp, schedule, m, mesh, split) combinations examined
    baselines: dict[str, Candidate | None] = field(default_factory=dict)
    # why each baseline that is None has no layout (flexmesh.search.uniform_baselines.Misses.reason)
    baseline_misses: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        return self.plans[0]


def best_plans(request: SearchRequest, *, with_baselines: bool = True, explain_no_fit: bool = True,
               progress: Progress | None = None, searched: SearchOutcome | None = None) -> SearchResult:
    """Find the fastest plans that fit, best first, at most ``request.top``; raise PlanError when none fits.

    ``with_baselines`` ranks the best Megatron-3D and ZeRO-3 + Ulysses plans beside the searched
    ones; ``explain_no_fit`` makes the no-fit error name the smallest change that fits (it searches
    again, so inner retries turn it off); ``progress(done, total)`` is called per configuration.
    ``searched``: the outcome of :func:`~flexmesh.search.driver.search` on this very request, where a
    caller already ran it (flexmesh.search.mixed_types asks one question twice, with and without the
    baselines); it is used as it is, and ``search_seconds`` then counts only the baselines.
    """
    t0 = time.perf_counter()
    request = request.resolved()  # one cost model for the search and the baselines
    outcome = searched if searched is not None else search(request, progress)
    results = list(outcome.candidates)
    seen = {c.plan.layout for c in results}
    misses: dict[str, Misses] = {}
    base: dict[str, Candidate | None] = uniform_baselines(request, misses) if with_baselines else {}
    device = request.cluster.device
    why = {name: misses[name].reason(request.global_batch, f"{device.name} ({device.memory_gib:g} GiB)")
           for name, b in base.items() if b is None}
    for name, b in base.items():  # those the runtime runs as priced: what `train` can take
        if b is not None and b.plan.layout not in seen and runtime_runs(name, request.model):
            results.append(replace(b, origin=name))
            seen.add(b.plan.layout)
    results.sort(key=lambda c: c.evaluation.step_time)
    if not results:
        if not explain_no_fit:
            raise PlanError(f"no plan fits on {request.cluster.label} at seq len {request.seq_len}")
        if not with_baselines:  # the families' grids count why layouts are left out
            uniform_baselines(request, misses)
        every = Misses()
        for m in misses.values():
            every.add(m)
        raise PlanError(no_fit_message(request, every))
    return SearchResult(plans=results[:request.top], search_seconds=time.perf_counter() - t0, mode=outcome.mode,
                        configurations=outcome.configurations, baselines=base, baseline_misses=why)


def no_fit_message(request: SearchRequest, misses: Misses | None = None) -> str:
    """Why nothing fits, in one line that leads with what binds, and the smallest change that makes a plan fit.

    ``misses``: why the uniform families' layouts were left out (flexmesh.search.uniform_baselines), counted
    again when not given. Where the batch ruled layouts out (a data-parallel degree that does not divide
    it), the counts nearest it that those degrees divide are tried first: a batch of 1,953 sequences on
    128 x 8 devices divides over no power-of-two degree, and 1,952 is the change to make, not more memory.
    Else memory leads (the least peak against the usable bytes) and the usual relaxations are tried:
    recomputation if it was off, one mesh per layer if ``--same-mesh``, twice the devices, half the
    sequence length.
    """
    model, cluster, seq_len, space = request.model, request.cluster, request.seq_len, request.space
    if misses is None:
        misses = Misses()
        for m in _family_misses(request).values():
            misses.add(m)
    batch = request.global_batch
    device = f"{cluster.device.name} ({cluster.device.memory_gib:g} GiB)"
    # Each retry is a quick fast-mode search for one plan, priced by the preset cost model.
    retry = replace(request, cost=None, top=1, mode="fast")
    if misses.batch:
        for nearer in batches_near(batch, misses.dp):
            try:
                r = best_plans(replace(retry, global_batch=nearer), with_baselines=False, explain_no_fit=False)
            except PlanError:
                continue
            return (f"no plan of {model.name} fits on {cluster.label} at seq len {seq_len}: "
                    f"{misses.reason(batch, device, first='batch')}; try --global-batch {nearer} "
                    f"(best plan then: {r.best.plan.layout})")
    head = (f"no plan of {model.name} fits on {cluster.label} at seq len {seq_len}, global batch {batch}: "
            f"{misses.reason(batch, device, first='memory')}")
    tries: list[tuple[str, SearchRequest]] = []
    if Recompute.FULL not in space.recompute_modes:
        tries.append(("enable recomputation (drop --no-recompute)",
                      replace(retry, space=replace(space, recompute=FULL_SPACE.recompute))))
    if space.same_mesh:
        tries.append(("let layers use different meshes (drop --same-mesh)",
                      replace(retry, space=replace(space, same_mesh=False))))
    bigger = cluster.with_devices(cluster.nodes * 2, cluster.devices_per_node)
    tries.append((f"use twice the devices (--cluster {bigger.label})", replace(retry, cluster=bigger)))
    if seq_len > 1:
        tries.append((f"halve the sequence length (--seq-len {seq_len // 2})", replace(retry, seq_len=seq_len // 2)))
    for what, attempt in tries:
        try:
            r = best_plans(attempt, with_baselines=False, explain_no_fit=False)
        except PlanError:
            continue
        return f"{head}; smallest change that fits: {what} (best plan then: {r.best.plan.layout})"
    return (f"{head}; even with twice the devices or half the sequence length nothing fits: use a larger device or "
            "a smaller model")


def _family_misses(request: SearchRequest) -> dict[str, Misses]:
    misses: dict[str, Misses] = {}
    uniform_baselines(request.resolved(), misses)
    return misses
