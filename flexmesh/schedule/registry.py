"""The per-step scheduling policies by name, and the one function that runs a named policy.

Every policy is a function ``(lengths, ctx, *, seed, **options) -> StepSchedule``; call them through
:func:`make_schedule`. All are deterministic: the same batch, context and seed give the same step
schedule (none draws random numbers today; ``seed`` is part of the signature so that a randomised
policy can keep that promise).

- the baselines, one static group size each (``Policy.is_baseline``): ``fixed`` (Megatron-LM /
  torchtitan with packing), ``padded`` (full-context slots), ``balanced`` (cost-aware LPT), in
  :mod:`flexmesh.schedule.static`, and ``wlb`` (WLB-LLM, outlier delay), in :mod:`flexmesh.schedule.wlb`;
- ``hdp`` (ByteScale): group sizes chosen per step, in :mod:`flexmesh.schedule.hdp`;
- ``milp`` (FlexSP): group sizes by mixed-integer programming, in :mod:`flexmesh.schedule.milp`;
- ``chunked`` (InfiniPipe): long sequences cut into equal-time slices run in order on one group, in
  :mod:`flexmesh.schedule.chunking`; the runtime carries the slices' keys and values, without
  pipelining only (on a pipeline its scheduler keeps sequences whole).

``flexmesh train`` offers every policy but ``padded``, and ``shares`` (each replica group of a plan its
planned share of the batch, flexmesh.schedule.groups): :data:`RUNTIME_POLICIES` lists them.

>>> from flexmesh.schedule.testing import tiny_context
>>> s = make_schedule("hdp", [900, 50, 60, 3000], tiny_context(num_ranks=4))
>>> s.validate(4); sorted(s.extra)[:3]
['group_sizes', 'imbalance', 'microbatches']
"""

from __future__ import annotations

from typing import Callable

from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.enums import Policy
from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.chunking import chunked_schedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.hdp import hdp
from flexmesh.schedule.milp import milp_schedule
from flexmesh.schedule.static import balanced, fixed, padded
from flexmesh.schedule.wlb import wlb

PolicyFn = Callable[..., StepSchedule]

POLICIES: dict[Policy, PolicyFn] = {
    Policy.FIXED: fixed,
    Policy.PADDED: padded,
    Policy.BALANCED: balanced,
    Policy.WLB: wlb,
    Policy.HDP: hdp,
    Policy.MILP: milp_schedule,
    Policy.CHUNKED: chunked_schedule,
}

# The policies `flexmesh train` offers (--policy, --fallback-policy). padded is simulated only: the
# runtime's packer never pads a micro-batch to a full slot, so "padded" would run as plain
# arrival-order packing, not as what it is named. The runtime runs wlb without its outlier delay and
# chunked's slices only where it can carry them (see flexmesh.schedule.scheduler.Scheduler).
RUNTIME_POLICIES: tuple[Policy, ...] = (Policy.FIXED, Policy.BALANCED, Policy.WLB, Policy.HDP, Policy.MILP,
                                        Policy.CHUNKED, Policy.SHARES)


def make_schedule(policy: Policy | str, lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0,
                  **options) -> StepSchedule:
    """Schedule one global batch with the named policy (options are the policy's keyword arguments)."""
    try:
        fn = POLICIES[Policy(policy)]
    except ValueError:
        raise ScheduleError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}") from None
    try:
        return fn(lengths, ctx, seed=seed, **options)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise ScheduleError(f"policy {str(policy)!r}: {e}; see {fn.__module__} for its options") from None
        raise
