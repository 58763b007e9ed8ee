"""Validate a (possibly hand-edited) Plan against a model and a cluster, then evaluate it.

Every failure raises :class:`PlanError` with a message saying what to change.
"""

from __future__ import annotations

from flexmesh.cost import CostModel, Evaluation
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


def check_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, cost: CostModel | None = None) -> Evaluation:
    """Raise PlanError on the first problem; return the cost model's evaluation when the plan is valid."""
    cost = cost or CostModel(model, cluster)
    if plan.world_size != cluster.world_size:
        raise PlanError(f"plan is for {plan.world_size} devices but {cluster.label} has {cluster.world_size}; "
                        f"re-plan for this cluster or pass the cluster the plan was made for")
    if plan.num_layers != model.num_layers:
        raise PlanError(f"plan covers {plan.num_layers} layers but {model.name} has {model.num_layers}; "
                        f"make the stages' layer ranges cover 0..{model.num_layers}")
    expect = 0
    for i, st in enumerate(plan.stages):
        if st.start != expect:
            raise PlanError(f"stage {i} starts at layer {st.start} but the previous stage ends at {expect}; "
                            "stages must cover consecutive layers in order")
        if st.num_layers == 0:
            raise PlanError(f"stage {i} has no layers; give every stage at least one layer or lower pp")
        expect = st.end
    D = plan.stage_devices
    mbs = plan.microbatch_size
    for i, st in enumerate(plan.stages):
        for j, s in enumerate(st.strategies):
            where = f"stage {i}, layer {st.start + j} ({s})"
            if s.devices != D:
                raise PlanError(f"{where} uses tp x cp x dp = {s.devices} devices but each of the {plan.pp} "
                                f"pipeline stages has {D}; make tp*cp*dp equal {D}")
            if model.num_heads % s.tp:
                raise PlanError(f"{where}: tp {s.tp} does not divide the {model.num_heads} attention heads; "
                                "use a tp that divides them")
            if not (model.num_kv_heads % s.tp == 0 or s.tp % model.num_kv_heads == 0):
                raise PlanError(f"{where}: tp {s.tp} and the {model.num_kv_heads} KV heads do not divide each "
                                "other; use a tp that divides them or a multiple of them")
            if s.tp > cluster.devices_per_node:
                raise PlanError(f"{where}: tp {s.tp} spans more than one node of {cluster.devices_per_node} "
                                "devices; keep tp within a node")
            if s.cp_kind == "ulysses" and model.num_heads % (s.tp * s.cp):
                raise PlanError(f"{where}: Ulysses needs the {model.num_heads} heads to split over tp x cp = "
                                f"{s.tp * s.cp}; lower cp or use ring ('r{s.cp}')")
            if mbs % s.dp:
                raise PlanError(f"{where}: dp {s.dp} does not divide the {mbs} sequences of a micro-batch "
                                f"(global batch {plan.global_batch} / {plan.num_microbatches} micro-batches); "
                                "change num_microbatches or dp")
    ev = cost.evaluate(plan)
    for r, mem in enumerate(ev.memory):
        if mem["total"] > ev.budget:
            raise PlanError(f"plan needs {mem['total'] / GIB:.1f} GiB on stage {r} but the device has "
                            f"{ev.budget / GIB:.1f} GiB usable; raise pp or enable recompute (add '-ac') "
                            "or ZeRO-3 on that stage's layers")
    return ev
