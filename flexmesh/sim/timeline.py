"""The timeline of one training step: a StepSchedule played out on a plan's ranks.

Every duration comes from the cost model (:meth:`flexmesh.cost.CostModel.microbatch_phases`,
:meth:`~flexmesh.cost.CostModel.pipeline_p2p`, :meth:`~flexmesh.cost.CostModel.step_grad_sync`);
what this module adds is the ordering of events:

1. each group runs its micro-batches back to back (``pp == 1``) or through its pipeline in the plan's
   schedule (:mod:`flexmesh.sim.pipeline`); a group moves at its slowest member's speed;
2. at the end of the step every rank of a pipeline stage waits for the slowest one (the gradient
   collective is a barrier); the gradient sync over all data ranks hides partly under the slowest
   rank's last backward (:meth:`~flexmesh.cost.CostModel.exposed_sync`), its exposed rest follows,
   then the optimizer.

A *lane* is one data rank on one pipeline stage: ``tp`` devices that always do the same thing.
Lane ``l = stage * num_ranks + data_rank`` holds global ranks ``l * tp ... l * tp + tp - 1`` (the
rank order of :func:`flexmesh.layout.mesh.rank_coords` with the data axis = dp x cp merged).

Speed factors scale compute only (a throttled or older GPU computes slower; NVLink and the NICs do
not slow down with it): a micro-batch on a group whose slowest member has speed 0.5 computes twice as
long and communicates as long as before. Time at the optimizer is compute too.

Example: two data ranks, ``pp = 1``; rank 0 runs micro-batches of 2 s and 1 s, rank 1 one of 1 s;
the exposed gradient sync takes 0.2 s and the optimizer 0.1 s::

    rank 0: [compute 0-2][compute 2-3]            [comm 3-3.2][compute 3.2-3.3]   step 3.3 s
    rank 1: [compute 0-1][wait 1-3               ][comm 3-3.2][compute 3.2-3.3]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.pipeline_order import chain_ends, units_from_ends
from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.assemble import lockstep_padding
from flexmesh.schedule.context import ScheduleContext
from flexmesh.sim.pipeline import run_pipeline
from flexmesh.spec.cluster import ClusterSpec

KINDS = ("compute", "comm", "bubble", "wait")


@dataclass(frozen=True)
class Segment:
    """One stretch of one lane's step: what it did from ``start`` to ``end``."""

    start: float  # s from the start of the step
    end: float
    kind: str  # one of KINDS
    label: str  # e.g. "mb3", "F2 c0", "grad sync", "optimizer"


@dataclass(frozen=True)
class StepTimeline:
    """What every lane did during one step; per-lane arrays are indexed by lane (see module doc).

    ``compute + comm + bubble + wait == step_time`` on every lane.
    """

    step_time: float
    num_ranks: int
    pp: int
    compute: np.ndarray  # s per lane, including the optimizer step
    comm: np.ndarray  # exposed communication per lane (micro-batches, pipeline p2p, gradient sync)
    bubble: np.ndarray  # idle inside the pipeline (only with pp > 1)
    wait: np.ndarray  # idle at the end-of-step barrier
    work_end: np.ndarray  # when each lane ends its last micro-batch
    tokens: np.ndarray  # tokens each data rank holds this step (its group's tokens / cp)
    sync_time: float  # exposed part of the gradient collective, after the last backward (slowest stage)
    tail_busy: np.ndarray  # per lane: gradient sync + optimizer, s (part of comm and compute)
    segments: tuple[tuple[Segment, ...], ...] | None = None  # per lane, when simulated with detail

    @property
    def num_lanes(self) -> int:
        """Lanes: one per data rank and pipeline stage."""
        return self.num_ranks * self.pp

    @property
    def busy(self) -> np.ndarray:
        """Seconds each lane computes or communicates."""
        return self.compute + self.comm

    @property
    def utilisation(self) -> np.ndarray:
        """Fraction of the step each lane spends computing, in [0, 1]."""
        return self.compute / self.step_time if self.step_time > 0 else np.zeros_like(self.compute)

    @property
    def imbalance(self) -> float:
        """Slowest lane's micro-batch phase over the mean of its stage (1.0 = perfect balance), worst stage."""
        end = self.work_end.reshape(self.pp, self.num_ranks)
        mean = end.mean(axis=1)
        ok = mean > 0
        return float((end.max(axis=1)[ok] / mean[ok]).max()) if ok.any() else 1.0

    @property
    def tail(self) -> float:
        """Seconds after the last micro-batch ends: gradient sync and optimizer on the critical path."""
        return self.step_time - float(self.work_end.max())

    def lane_label(self, lane: int) -> str:
        """Short name of a lane on a chart: ``r3``, or ``r3 s1`` with pipeline stages."""
        stage, rank = divmod(lane, self.num_ranks)
        return f"r{rank}" if self.pp == 1 else f"r{rank} s{stage}"


def lane_speeds(cluster: ClusterSpec, tp: int, pp: int) -> np.ndarray:
    """Speed of each lane, shape ``(pp, num_ranks)``: the slowest of its ``tp`` devices.

    >>> from dataclasses import replace
    >>> from flexmesh.spec import parse_cluster
    >>> c = replace(parse_cluster("4xA100-80GB"), speed_factors=(1.0, 0.5, 1.0, 1.0))
    >>> lane_speeds(c, tp=2, pp=1).tolist()
    [[0.5, 1.0]]
    """
    world = cluster.world_size
    if world % (tp * pp):
        raise ScheduleError(f"world size {world} is not divisible by tp {tp} x pp {pp}; change --tp or --pp")
    f = np.asarray(cluster.speed_factors or [1.0] * world, dtype=float)
    return f.reshape(pp, world // (tp * pp), tp).min(axis=2)


def _speeds(ctx: ScheduleContext, speed: ArrayLike | None) -> np.ndarray:
    if speed is None:
        speed = ctx.speed or np.ones(ctx.num_ranks)
    a = np.asarray(speed, dtype=float)
    if a.ndim == 1:
        a = np.broadcast_to(a, (ctx.pp, a.shape[0]))
    if a.shape != (ctx.pp, ctx.num_ranks):
        raise ScheduleError(
            f"speed factors have shape {a.shape}; give one per data rank ({ctx.num_ranks}) "
            f"or one per data rank and stage ({ctx.pp}, {ctx.num_ranks})"
        )
    if (a <= 0).any():
        raise ScheduleError("speed factors must be positive (1.0 = nominal speed)")
    return a


@dataclass(frozen=True)
class _MicroBatches:
    """All micro-batches of a step, flattened: which group, tokens and squared-token work."""

    group: np.ndarray
    index: np.ndarray  # position within its group
    tokens: np.ndarray
    sq: np.ndarray


def _flatten(schedule: StepSchedule, ctx: ScheduleContext) -> _MicroBatches:
    # A piece [a, b) of a causal sequence attends to its whole prefix: (b^2 - a^2) squared tokens,
    # which is s^2 for a whole sequence and splits that total exactly over its pieces (with a sliding
    # window, the windowed count: CostModel.attention_sq, which also splits exactly over pieces).
    sq_of = ctx.cost.attention_sq
    group, index, tokens, sq = [], [], [], []
    for g, grp in enumerate(schedule.groups):
        for j, mb in enumerate(grp.microbatches):
            group.append(g)
            index.append(j)
            tokens.append(sum(p.end - p.start for p in mb))
            sq.append(sum(sq_of(p.start, p.end) for p in mb))
    return _MicroBatches(np.asarray(group, dtype=int), np.asarray(index, dtype=int),
                         np.asarray(tokens, dtype=float), np.asarray(sq, dtype=float))


def simulate_step(ctx: ScheduleContext, schedule: StepSchedule, *, virtual_stages: int = 1,
                  speed: ArrayLike | None = None, slot_tokens: int | None = None,
                  detail: bool = False) -> StepTimeline:
    """Play ``schedule`` out on the plan described by ``ctx``.

    ``speed``: per data rank ``(num_ranks,)`` or per lane ``(pp, num_ranks)``; default ``ctx.speed``
    or nominal. ``slot_tokens``: every micro-batch is a fixed-shape slot of at least this many tokens
    (the ``fixed`` policy), so its padding costs linear-layer time; padding attends to nothing.
    ``detail`` also builds the per-lane segment lists (for plots; slower).
    """
    if ctx.pp == 1 and virtual_stages != 1:
        raise ScheduleError("virtual stages need pp > 1; set virtual_stages=1")
    sp = _speeds(ctx, speed)
    rank_group = _rank_groups(schedule, ctx.num_ranks)
    n_groups = len(schedule.groups)
    cp = np.array([g.cp for g in schedule.groups], dtype=int)
    # Groups are runs of consecutive ranks, so a reduceat over their first ranks gives each group's
    # slowest member per stage.
    first = np.array([g.ranks[0] for g in schedule.groups], dtype=int)
    order = np.argsort(first)
    gspeed = np.empty((ctx.pp, n_groups))
    gspeed[:, order] = np.minimum.reduceat(sp, first[order], axis=1)
    mbs = _flatten(schedule, ctx)
    tokens = np.bincount(mbs.group, weights=mbs.tokens, minlength=n_groups)[rank_group] / cp[rank_group]
    if slot_tokens is not None:
        mbs = _MicroBatches(mbs.group, mbs.index, np.maximum(mbs.tokens, float(slot_tokens)), mbs.sq)
    mbs = _lockstep(ctx, mbs, cp)
    ph = _phases(ctx, mbs, cp)
    if ctx.pp == 1:
        lanes = _no_pipeline(ctx, mbs, ph, gspeed[0], rank_group, n_groups, detail)
    else:
        lanes = _pipelines(ctx, schedule, mbs, ph, cp, gspeed, rank_group, virtual_stages, detail)
    return _finish(ctx, sp, tokens, lanes)


def _lockstep(ctx: ScheduleContext, mbs: _MicroBatches, cp: np.ndarray) -> _MicroBatches:
    """The micro-batches as the runtime runs them in lockstep (ZeRO-3, pipelines; see lockstep_padding).

    Every group gets empty micro-batches up to the step's count, after its own; with ``pp > 1``
    every micro-batch of a group takes the group's one shape (padding attends to nothing).
    """
    n = len(cp)
    counts = np.bincount(mbs.group, minlength=n)
    longest = np.zeros(n)
    np.maximum.at(longest, mbs.group, mbs.tokens)
    n_pad, shape = lockstep_padding(ctx, cp, counts.tolist(), longest)
    if not n_pad.any() and not (ctx.pp > 1 and ctx.in_lockstep):
        return mbs
    tokens = np.maximum(mbs.tokens, shape[mbs.group]) if ctx.pp > 1 else mbs.tokens
    g_pad = np.repeat(np.arange(n), n_pad)
    i_pad = np.concatenate([np.arange(counts[g], counts[g] + n_pad[g]) for g in range(n)]) if n else g_pad
    sq_pad = np.array([ctx.cost.attention_sq(0.0, float(shape[g])) for g in g_pad])  # one document each
    return _MicroBatches(np.concatenate([mbs.group, g_pad]), np.concatenate([mbs.index, i_pad]).astype(int),
                         np.concatenate([tokens, shape[g_pad]]), np.concatenate([mbs.sq, sq_pad]))


def _rank_groups(schedule: StepSchedule, num_ranks: int) -> np.ndarray:
    """Group index of each data rank; every rank must belong to exactly one group."""
    rank_group = np.full(num_ranks, -1)
    for g, grp in enumerate(schedule.groups):
        r = np.asarray(grp.ranks)
        if len(r) == 0 or r.min() < 0 or r.max() >= num_ranks or (rank_group[r] >= 0).any() \
                or (np.diff(r) != 1).any():
            raise ScheduleError(
                f"group {g} has ranks {grp.ranks}: groups must be runs of consecutive data ranks in "
                f"0..{num_ranks - 1}, each rank in one group; schedule the batch for this plan's tp/pp"
            )
        rank_group[r] = g
    if (rank_group < 0).any():
        raise ScheduleError(
            f"schedule covers {int((rank_group >= 0).sum())} of the plan's {num_ranks} data ranks; "
            f"schedule the batch for this plan's tp/pp"
        )
    return rank_group


def _phases(ctx: ScheduleContext, mbs: _MicroBatches, cp: np.ndarray) -> dict[str, np.ndarray]:
    """Per micro-batch: fwd/bwd compute and exposed comm of one layer, of the LM head and of the embedding.

    The embedding is priced as the scheduler and the lower bound price it (ScheduleContext.microbatch_time
    includes it): a model profile gives it a time, the analytic timing none.
    """
    d = cp[mbs.group]
    out = {k: np.zeros(len(d)) for k in ("fwd", "bwd", "comm_fwd", "comm_bwd", "head_fwd", "head_bwd",
                                         "emb_fwd", "emb_bwd")}
    for size in np.unique(d):
        sel = d == size
        s = ctx.group_strategy(int(size))
        layer = ctx.cost.microbatch_phases(s, mbs.tokens[sel], mbs.sq[sel], layers=1, head=False)
        head = ctx.cost.microbatch_phases(s, mbs.tokens[sel], mbs.sq[sel], layers=0, head=True)
        emb = ctx.cost.microbatch_phases(s, mbs.tokens[sel], mbs.sq[sel], layers=0, head=False, embed=True)
        # Given arrays of tokens, the cost model's phases are arrays of the same length.
        for k in ("fwd", "bwd", "comm_fwd", "comm_bwd"):
            out[k][sel] = np.asarray(getattr(layer, k))
        out["head_fwd"][sel] = np.asarray(head.fwd)
        out["head_bwd"][sel] = np.asarray(head.bwd)
        out["emb_fwd"][sel] = np.asarray(emb.fwd)
        out["emb_bwd"][sel] = np.asarray(emb.bwd)
    return out


@dataclass
class _Lanes:
    """Per-lane results of the micro-batch phase, before the end-of-step barrier."""

    compute: np.ndarray
    comm: np.ndarray
    bubble: np.ndarray
    work_end: np.ndarray
    last_bwd: np.ndarray  # per lane: compute of its last backward pass, under which the gradient sync hides
    segments: list[list[Segment]] | None


def _no_pipeline(ctx, mbs, ph, gspeed, rank_group, n_groups, detail) -> _Lanes:
    """pp == 1: a rank's timeline is its group's micro-batches back to back (vectorised)."""
    L = ctx.layers_per_stage
    comp = ((ph["fwd"] + ph["bwd"]) * L + ph["head_fwd"] + ph["head_bwd"] + ph["emb_fwd"] + ph["emb_bwd"]) \
        / gspeed[mbs.group]
    comm = (ph["comm_fwd"] + ph["comm_bwd"]) * L
    bwd = (ph["bwd"] * L + ph["head_bwd"] + ph["emb_bwd"]) / gspeed[mbs.group]
    last_bwd = np.zeros(n_groups)
    if len(mbs.group):
        order = np.lexsort((mbs.index, mbs.group))
        last = order[np.r_[mbs.group[order][1:] != mbs.group[order][:-1], True]]
        last_bwd[mbs.group[last]] = bwd[last]
    g_comp = np.bincount(mbs.group, weights=comp, minlength=n_groups)
    g_comm = np.bincount(mbs.group, weights=comm, minlength=n_groups)
    segments = None
    if detail:
        per_group: list[list[Segment]] = [[] for _ in range(n_groups)]
        clock = np.zeros(n_groups)
        for g, j, c, k in zip(mbs.group, mbs.index, comp, comm, strict=True):
            t = clock[g]
            t, c, k = float(t), float(c), float(k)
            per_group[g].append(Segment(t, t + c, "compute", f"mb{j}"))
            if k > 0:
                per_group[g].append(Segment(t + c, t + c + k, "comm", f"mb{j} comm"))
            clock[g] = t + c + k
        segments = [list(per_group[g]) for g in rank_group]
    return _Lanes(compute=g_comp[rank_group], comm=g_comm[rank_group], bubble=np.zeros(len(rank_group)),
                  work_end=(g_comp + g_comm)[rank_group], last_bwd=last_bwd[rank_group], segments=segments)


def _pipelines(ctx, schedule, mbs, ph, cp, gspeed, rank_group, v, detail) -> _Lanes:
    """pp > 1: each group is a pipeline; simulate it once and copy it to the group's lanes."""
    pp, n = ctx.pp, ctx.num_ranks
    n_vs = pp * v
    per_chunk = ctx.layers_per_chunk(v)[:, None]  # the plan's split (or the context's even estimate)
    compute = np.zeros((pp, n))
    comm = np.zeros((pp, n))
    bubble = np.zeros((pp, n))
    work_end = np.zeros((pp, n))
    last_bwd = np.zeros((pp, n))
    segments: list[list[Segment]] | None = [[] for _ in range(pp * n)] if detail else None
    for g, grp in enumerate(schedule.groups):
        sel = np.flatnonzero(mbs.group == g)
        if len(sel) == 0:
            continue
        s = ctx.group_strategy(grp.cp)
        # Boundary activations out and gradients back, split evenly over the two passes; a rank whose
        # sends stay inside its node pays its node's links (virtual stage c * pp + r lives on rank r).
        # A micro-batch's tokens are one data rank's: as s.dp sequences across the stage, one each.
        crossings = np.tile(ctx.cost.pipeline_crossings(pp, v), v)[:, None]
        sends = [np.array([ctx.cost.pipeline_p2p(s, s.dp, float(t), pp, crosses) / 2 for t in mbs.tokens[sel]])
                 for crosses in (False, True)]
        p2p = np.where(crossings, sends[1][None, :], sends[0][None, :])
        is_last = (np.arange(n_vs) == n_vs - 1)[:, None]
        speed_vs = np.tile(gspeed[:, g], v)[:, None]  # virtual stage c * pp + r lives on rank r
        is_first = (np.arange(n_vs) == 0)[:, None]  # the embedding lives on the first virtual stage
        f_comp = (ph["fwd"][sel] * per_chunk + is_last * ph["head_fwd"][sel] + is_first * ph["emb_fwd"][sel]) \
            / speed_vs
        b_comp = (ph["bwd"][sel] * per_chunk + is_last * ph["head_bwd"][sel] + is_first * ph["emb_bwd"][sel]) \
            / speed_vs
        f_comm = np.broadcast_to(ph["comm_fwd"][sel] * per_chunk + p2p, f_comp.shape)
        b_comm = np.broadcast_to(ph["comm_bwd"][sel] * per_chunk + p2p, b_comp.shape)
        units = units_from_ends(chain_ends([grp], len(sel)))  # cut documents: the runtime's unit order
        run = run_pipeline(ctx.pipeline_schedule, f_comp + f_comm, b_comp + b_comm, v, units)
        finish = run.finish
        comp_r = (f_comp + b_comp).reshape(v, pp, -1).sum(axis=(0, 2))
        comm_r = (f_comm + b_comm).reshape(v, pp, -1).sum(axis=(0, 2))
        ranks = list(grp.ranks)
        compute[:, ranks] = comp_r[:, None]
        comm[:, ranks] = comm_r[:, None]
        work_end[:, ranks] = finish[:, None]
        last_bwd[:, ranks] = b_comp[:pp, -1][:, None]  # each rank ends on the last micro-batch's first chunk
        bubble[:, ranks] = (finish - comp_r - comm_r)[:, None]
        if segments is not None:  # detail
            comps = np.stack([f_comp, b_comp])
            for r in range(pp):
                lane_segs = _pipeline_segments(run, r, pp, comps)
                for d in ranks:
                    segments[r * n + d] = list(lane_segs)
    return _Lanes(compute=compute.ravel(), comm=comm.ravel(), bubble=bubble.ravel(), work_end=work_end.ravel(),
                  last_bwd=last_bwd.ravel(), segments=segments)


def _pipeline_segments(run, r: int, pp: int, comps: np.ndarray) -> list[Segment]:
    out: list[Segment] = []
    clock = 0.0
    for p in run.orders[r]:
        b, vs = int(p.backward), p.chunk * pp + r
        s, e = float(run.start[b, vs, p.mb]), float(run.end[b, vs, p.mb])
        if s > clock:
            out.append(Segment(clock, s, "bubble", "bubble"))
        name = f"{'B' if p.backward else 'F'}{p.mb}" + (f" c{p.chunk}" if run.start.shape[1] > pp else "")
        c = float(comps[b, vs, p.mb])
        out.append(Segment(s, s + c, "compute", name))
        if e > s + c:
            out.append(Segment(s + c, e, "comm", name + " comm"))
        clock = e
    return out


def _finish(ctx: ScheduleContext, sp: np.ndarray, tokens: np.ndarray, lanes: _Lanes) -> StepTimeline:
    """End of step: per stage, wait for the slowest lane, sync gradients, step the optimizer."""
    pp, n = ctx.pp, ctx.num_ranks
    work_end = lanes.work_end.reshape(pp, n)
    barrier = work_end.max(axis=1)
    sync = np.zeros(pp)
    optim = np.zeros(pp)
    for r in range(pp):
        sync[r], optim[r] = ctx.cost.step_grad_sync(ctx.base, n, layers=ctx.stage_layers[r],
                                                    embed=r == 0, head=r == pp - 1)
    # The sync hides under the last backward of the stage's slowest lane (the collective cannot run
    # ahead of it); the cost model's rule decides how much.
    slowest = work_end.argmax(axis=1)
    last_bwd = lanes.last_bwd.reshape(pp, n)[np.arange(pp), slowest]
    sync = np.array([ctx.cost.exposed_sync(float(sync[r]), float(last_bwd[r]), ctx.stage_layers[r])
                     for r in range(pp)])
    opt_lane = optim[:, None] / sp
    done = barrier[:, None] + sync[:, None] + opt_lane
    step = float(done.max())
    wait = (barrier[:, None] - work_end) + (step - done)
    compute = lanes.compute + opt_lane.ravel()
    comm = lanes.comm + np.repeat(sync, n)
    segments: tuple[tuple[Segment, ...], ...] | None = None
    if lanes.segments is not None:
        per_lane: list[tuple[Segment, ...]] = []
        for lane, segs in enumerate(lanes.segments):
            r, d = divmod(lane, n)
            t_end, t_bar = float(work_end[r, d]), float(barrier[r])
            extra = []
            if t_bar > t_end:
                extra.append(Segment(t_end, t_bar, "wait", "wait at gradient sync"))
            t = t_bar + float(sync[r])
            if sync[r] > 0:
                extra.append(Segment(t_bar, t, "comm", "grad sync"))
            extra.append(Segment(t, t + float(opt_lane[r, d]), "compute", "optimizer"))
            if step > float(done[r, d]):
                extra.append(Segment(float(done[r, d]), step, "wait", "wait for step end"))
            per_lane.append(tuple(segs) + tuple(extra))
        segments = tuple(per_lane)
    return StepTimeline(step_time=step, num_ranks=n, pp=pp, compute=compute, comm=comm, bubble=lanes.bubble,
                        wait=wait.ravel(), work_end=lanes.work_end, tokens=tokens, sync_time=float(sync.max()),
                        tail_busy=np.repeat(sync, n) + opt_lane.ravel(), segments=segments)
