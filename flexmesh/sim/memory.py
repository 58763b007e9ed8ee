"""Saved activations per pipeline stage over a step: what the runtime's meter reads.

A stage holds the activations of every micro-batch forwarded and not yet backwarded there; which
those are follows from the step's order (flexmesh.layout.pipeline_order: the units of cut
documents, else 1F1B; without pipelining, a chain of linked micro-batches until its one backward).
Each micro-batch runs at the step's one shape under a pipeline (its padding saves activations too)
and keeps, per layer, the cost model's activation bytes for its tokens plus, for every piece that
continues a cut document, what the carry keeps (``carried_bytes``: the prefix's keys and values
and whatever the kernel saves for queries over the longer key range); the first stage adds the
embedding's bytes, the last the head's. The peak per stage is the largest sum over the sets of
micro-batches in flight together (flexmesh.schedule.recompute.in_flight_sets), what
:class:`flexmesh.runtime.observe.memory.SavedActivationMeter` measures as ``activation_peak_bytes``.
"""

from __future__ import annotations

import numpy as np

from flexmesh.cost import Work
from flexmesh.errors import ScheduleError
from flexmesh.layout.pipeline_order import chain_plan, pipeline_order, units_from_ends
from flexmesh.layout.step import Group, StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.recompute import in_flight_sets


def stage_activation_peaks(ctx: ScheduleContext, schedule: StepSchedule) -> np.ndarray:
    """Peak saved-activation bytes on each pipeline stage (one chunk per stage), the largest over the
    schedule's groups, for one device of a group."""
    if ctx.pp < 1:
        raise ScheduleError(f"pp must be >= 1, got {ctx.pp}")
    count = max(len(g.microbatches) for g in schedule.groups)
    peaks = np.zeros(ctx.pp)
    for g in schedule.groups:
        peaks = np.maximum(peaks, _group_peaks(ctx, g, count if ctx.in_lockstep else len(g.microbatches)))
    return peaks


def _group_peaks(ctx: ScheduleContext, g: Group, count: int) -> np.ndarray:
    cost, pp, layers = ctx.cost, ctx.pp, np.asarray(ctx.stage_layers, dtype=float)
    s = ctx.group_strategy(g.cp)
    sizes = [sum(p.end - p.start for p in mb) for mb in g.microbatches]
    shape = max(sizes, default=0) if pp > 1 else None
    per = []
    for k in range(count):
        mb = g.microbatches[k] if k < len(g.microbatches) else ()
        tokens = float(shape if shape is not None else (sizes[k] if k < len(sizes) else 0))
        if tokens == 0:
            per.append(np.zeros(pp))
            continue
        sq = float(sum(cost.attention_sq(p.start, p.end) for p in mb)) if mb else float(cost.attention_sq(0.0, tokens))
        layer = cost.layer(s, Work(tokens=tokens, sq_tokens=sq)).act
        carried = sum(cost.timing.carried_bytes(s, float(p.start), float(p.end - p.start)) for p in mb if p.start > 0)
        b = (layer + carried) * layers
        b[0] += cost.timing.embedding_activation_bytes(s, tokens)
        b[-1] += cost.timing.logit_bytes(s, tokens)
        per.append(b)
    ends = chain_plan(g)[1] + [True] * (count - len(g.microbatches))
    sets = in_flight_sets(pipeline_order(units_from_ends(ends), pp, pp), pp)
    return np.array([max((sum(per[j][st] for j in S) for S in sets[st]), default=0.0) for st in range(pp)])
