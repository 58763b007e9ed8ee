"""``flexmesh plan --lengths`` and ``--tokens-per-batch``: plan for the data's real length mix.

The search ranks layouts by the cost model at one sequence length, ``--seq-len``. With ``--lengths``
(a shipped distribution or a file of lengths, as ``flexmesh simulate --lengths``) that length is the
cap: :data:`STEPS` batches are drawn with seed :data:`SEED` (``flexmesh simulate --steps 4 --seed 0``
draws the same), longer sequences truncated to the cap; the best :data:`RESCORED` plans of the
search, and every baseline, are then scored by their expected step on them
(:func:`flexmesh.sim.expected.expected_step`: the simulator's mean under the plan's default
per-step policy, on the cluster as given) and ranked by it. ``--tokens-per-batch`` counts a step in
tokens rather than sequences: the batches hold that many tokens, and the search plans for as many
``--seq-len`` sequences as hold them, moved by up to 2% to the count that splits over the most
data-parallel ranks (:func:`flexmesh.search.space.factoring_batch`; ``--global-batch`` stays exact).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from flexmesh.commands.args import DEFAULT_GLOBAL_BATCH, DEFAULT_LENGTHS
from flexmesh.cost import CostModel
from flexmesh.cost.training.mixed import GroupsEvaluation, MixedCosts
from flexmesh.errors import FlexmeshError, PlanError, ScheduleError
from flexmesh.layout.plan import Plan
from flexmesh.search import SearchResult
from flexmesh.search.baselines import BaselinePlans
from flexmesh.search.mixed import MixedResult
from flexmesh.search.space import BATCH_TOLERANCE, factoring_batch
from flexmesh.sim.expected import Expected, expected_step
from flexmesh.sim.simulation import SimulationConfig, sample_batches
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec

STEPS = 4  # batches drawn: enough to average the mix, few enough to score several plans in seconds
SEED = 0
RESCORED = 8  # plans of the search re-scored on the batches (beside every baseline)


@dataclass
class PlanWorkload:
    """One step's size and, with ``--lengths``, the batches drawn from the distribution."""

    seq_len: int  # --seq-len: every sequence's length, or with --lengths the cap
    global_batch: int  # sequences per step the search plans for (and the plan file holds)
    tokens_per_batch: int | None = None  # --tokens-per-batch, when given
    world: int = 1  # devices the step is split over
    exact_batch: int | None = None  # --tokens-per-batch: the --seq-len sequences it holds, before factoring
    lengths: str | None = None  # --lengths
    batches: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0  # spent scoring plans on the batches

    def describe(self) -> str:
        """The line ``plan`` prints: which batch size and which lengths it planned for."""
        if self.tokens_per_batch is None:
            size = f"{self.global_batch} sequences per step"
        else:
            size = f"{self.tokens_per_batch:,} tokens per step"
        if self.lengths is None:
            held = "" if self.tokens_per_batch is None else f" ({self.global_batch} sequences of {self.seq_len})"
            return f"planned for {size}{held}, every sequence {self.seq_len} tokens"
        seqs = np.mean([len(b) for b in self.batches])
        tokens = np.mean([int(b.sum()) for b in self.batches])
        return (f"planned for {size} of lengths from {self.lengths}, capped at {self.seq_len} tokens: {STEPS} steps "
                f"drawn with seed {SEED} ({seqs:.0f} sequences, {tokens:,.0f} tokens per step on average); "
                f"each plan ranked by its expected step (mean of the steps simulated under its default policy, "
                f"scored in {self.seconds:.2f} s), the search's figure at {self.seq_len} tokens beside it")

    def factoring(self) -> str | None:
        """The line ``plan`` prints where ``--tokens-per-batch`` moved the sequence count off the exact one
        (:func:`~flexmesh.search.space.factoring_batch`), else None."""
        exact, gb = self.exact_batch, self.global_batch
        if exact is None or exact == gb:
            return None
        return (f"{self.tokens_per_batch:,} tokens per step -> {gb:,} sequences of {self.seq_len:,}, not {exact:,}: "
                f"{gb:,} splits over up to {math.gcd(gb, self.world):,} data-parallel ranks of the {self.world:,} "
                f"devices, {exact:,} over {math.gcd(exact, self.world):,} (the most of the counts within "
                f"{BATCH_TOLERANCE:.0%}; --global-batch {exact} keeps the exact count)")

    def to_dict(self) -> dict:
        d: dict = {"seq_len": self.seq_len, "global_batch": self.global_batch,
                   "tokens_per_batch": self.tokens_per_batch, "lengths": self.lengths}
        if self.exact_batch is not None:
            d["exact_global_batch"] = self.exact_batch  # tokens / --seq-len, before factoring_batch
        if self.lengths is not None:
            d.update(steps=STEPS, seed=SEED,
                     mean_sequences_per_step=float(np.mean([len(b) for b in self.batches])),
                     mean_tokens_per_step=float(np.mean([int(b.sum()) for b in self.batches])),
                     scoring_seconds=self.seconds)
        return d


def workload(seq: int, global_batch: int | None, tokens: int | None, lengths: str | None, world: int,
             mixed: bool = False) -> PlanWorkload:
    """The step ``--seq-len`` (``seq``), ``--global-batch``, ``--tokens-per-batch`` and ``--lengths``
    describe on ``world`` devices (batches drawn); PlanError (DataError for a bad lengths file) with what
    to change. ``--tokens-per-batch`` becomes the count of ``--seq-len`` sequences near it that splits over
    the most data-parallel ranks (:func:`~flexmesh.search.space.factoring_batch`)."""
    if tokens is not None and mixed and lengths:
        raise PlanError("--tokens-per-batch with --lengths varies the sequences per step, but a plan of replica "
                        "groups gives each group a fixed share of the sequences; give --global-batch")
    if tokens is None:
        gb = DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch
    elif tokens < seq and not lengths:
        raise PlanError(f"--tokens-per-batch {tokens} holds no sequence of --seq-len {seq} tokens; give at least "
                        f"{seq} tokens, or a shorter --seq-len")
    exact = None
    if tokens is not None:
        exact = max(1, tokens // seq)  # the tokens as --seq-len sequences: what the micro-batches are sized for
        gb = factoring_batch(exact, world)
    work = PlanWorkload(seq, gb, tokens, lengths=lengths, world=world, exact_batch=exact)
    if lengths:
        cfg = SimulationConfig(policies=(), context=seq, lengths=lengths, steps=STEPS, seed=SEED,
                               seqs_per_batch=None if tokens else gb, tokens_per_batch=tokens)
        try:
            work.batches = sample_batches(cfg)
        except FlexmeshError as e:  # an unknown name, or a file's name and what is wrong in it
            raise type(e)(f"--lengths: {e}") from None
    return work


def recommendation_batches(work: PlanWorkload) -> tuple[list[np.ndarray], str]:
    """The batches ``plan`` recommends a policy on, and the lengths they come from: ``--lengths``' draws, else
    :data:`STEPS` drawn with seed :data:`SEED` from simulate's default lengths (its ``--steps 4`` draws the same)."""
    if work.lengths:
        return work.batches, work.lengths
    cfg = SimulationConfig(policies=(), context=work.seq_len, lengths=DEFAULT_LENGTHS, steps=STEPS, seed=SEED,
                           seqs_per_batch=None if work.tokens_per_batch else work.global_batch,
                           tokens_per_batch=work.tokens_per_batch)
    return sample_batches(cfg), DEFAULT_LENGTHS


def score_plan(plan: Plan, model: ModelSpec, costs: MixedCosts, work: PlanWorkload) -> Expected | None:
    """``plan``'s expected step on the batches, None where its default policy cannot schedule them or the
    runtime's scheduler cannot take its layout (layers of one group on different meshes: the search may
    price such a mix, flexmesh.layout.mesh.group_layout refuses to run it)."""
    try:
        return expected_step(plan, model, costs, work.batches, SEED)
    except (ScheduleError, PlanError):
        return None


def expected_dict(e: Expected) -> dict:
    """What the plan file's ``predicted.lengths`` and ``--json`` say of an expected step."""
    return {"policy": e.policy, "steps": e.steps, "step_time_s": e.step_time, "tokens_per_s": e.tokens_per_s,
            "step_times_s": list(e.step_times)}


def with_expected(plan: Plan, e: Expected, work: PlanWorkload) -> Plan:
    """``plan`` with its expected step recorded under ``predicted.lengths`` (beside the cost model's)."""
    return replace(plan, predicted={**plan.predicted, "lengths": {**work.to_dict(), **expected_dict(e)}})


def score_uniform(result: SearchResult, cost: CostModel, work: PlanWorkload, top: int
                  ) -> tuple[SearchResult, dict[str, Expected]]:
    """The search's best :data:`RESCORED` plans ranked by their expected step (``top`` kept), and the
    expected step of each of them and of every baseline, by layout."""
    t0 = time.perf_counter()
    costs = MixedCosts(cost.model, MixedCluster((cost.cluster,)), groups=[cost])
    expected: dict[str, Expected] = {}
    for c in [*result.plans[:RESCORED], *(b for b in result.baselines.values() if b is not None)]:
        if c.plan.layout not in expected:
            e = score_plan(c.plan, cost.model, costs, work)
            if e is not None:
                expected[c.plan.layout] = e
    ranked = sorted((c for c in result.plans[:RESCORED] if c.plan.layout in expected),
                    key=lambda c: expected[c.plan.layout].step_time)
    if not ranked:
        raise PlanError(f"none of the best plans at --seq-len {work.seq_len} can schedule the batches drawn from "
                        f"{work.lengths}; lower --seq-len (the cap)")
    work.seconds = time.perf_counter() - t0
    return replace(result, plans=ranked[:top]), expected


def score_mixed(result: MixedResult, model: ModelSpec, costs: MixedCosts, work: PlanWorkload
                ) -> tuple[Plan, GroupsEvaluation, Expected]:
    """The mixed search's best :data:`RESCORED` plans' fastest by expected step, with its figures."""
    t0 = time.perf_counter()
    scored = []
    for i, (plan, ev) in enumerate(result.candidates[:RESCORED]):
        e = score_plan(plan, model, costs, work)
        if e is not None:
            scored.append((e.step_time, i, plan, ev, e))
    if not scored:
        raise PlanError(f"none of the best plans at --seq-len {work.seq_len} can schedule the batches drawn from "
                        f"{work.lengths}; lower --seq-len (the cap)")
    _, _, plan, ev, e = min(scored, key=lambda x: x[:2])
    work.seconds += time.perf_counter() - t0
    return with_expected(plan, e, work), ev, e


def score_baselines(baselines: dict, plans: BaselinePlans, model: ModelSpec, costs: MixedCosts,
                    work: PlanWorkload) -> None:
    """Each mixed-cluster baseline's figures (in place) as expected on the batches: its plan(s) scored
    as the plan is (``sum_of_parts``: each part's, throughputs added); the cost model's figures at the
    cap stay beside them as ``fixed_length_*``."""
    t0 = time.perf_counter()
    for name, row in baselines.items():
        if not row or name not in plans:
            continue
        parts = row.get("parts", [row])
        for part, planned in zip(parts, plans[name]):
            if planned is None:  # a part where nothing fits: 0 tokens/s whatever the lengths
                continue
            plan, cluster = planned
            own = costs if cluster == costs.cluster else MixedCosts(model, cluster)
            _rescored(part, score_plan(plan, model, own, work))
        if "parts" in row:
            _rescored(row, None, sum(p["tokens_per_s"] for p in parts))
    work.seconds += time.perf_counter() - t0


def _rescored(row: dict, e: Expected | None, tokens_per_s: float | None = None) -> None:
    row["fixed_length_tokens_per_s"] = row.get("tokens_per_s")
    if "step_time_s" in row:
        row["fixed_length_step_time_s"] = row["step_time_s"]
    if e is not None:
        row.update(step_time_s=e.step_time, tokens_per_s=e.tokens_per_s, policy=e.policy)
    elif tokens_per_s is not None:
        row["tokens_per_s"] = tokens_per_s
    else:
        row.update(step_time_s=float("inf"), tokens_per_s=0.0, note="its default policy cannot schedule the batches")
