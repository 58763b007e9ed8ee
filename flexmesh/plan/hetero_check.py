"""Validate a HeteroPlan (plan format version 3) against a model and a mixed cluster, then price it.

The plan's own invariants (contiguous stages, every device placed once, batches adding up) are
checked when it is read (flexmesh.layout.hetero); this adds what needs the model and the cluster.
Every failure raises :class:`PlanError` with a message saying what to change.
"""

from __future__ import annotations

from flexmesh.errors import PlanError
from flexmesh.layout.hetero import HeteroPlan
from flexmesh.plan.check import check_model, check_tp_heads
from flexmesh.plan.hetero_cost import HeteroEvaluation, MixedCosts, evaluate_hetero
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


def check_hetero_plan(plan: HeteroPlan, model: ModelSpec, cluster: MixedCluster,
                      costs: MixedCosts | None = None) -> HeteroEvaluation:
    """Raise PlanError on the first problem; return the plan's evaluation when it is valid."""
    check_model(plan, model)
    if plan.world_size != cluster.world_size:
        raise PlanError(f"plan is for {plan.world_size} devices but {cluster.label} has {cluster.world_size}; "
                        "re-plan for this cluster or pass the cluster the plan was made for")
    if plan.num_layers != model.num_layers:
        raise PlanError(f"plan covers {plan.num_layers} layers but {model.name} has {model.num_layers}; "
                        f"make every replica's stages cover 0..{model.num_layers}")
    costs = costs or MixedCosts(model, cluster)
    for i, r in enumerate(plan.replicas):
        for j, st in enumerate(r.stages):
            where = f"replica {i} stage {j} (layers [{st.start}, {st.end}) on devices {list(st.devices)})"
            groups = sorted({costs.group_of[d] for d in st.devices})
            if len(groups) > 1:
                names = ", ".join(cluster.groups[g].device.name for g in groups)
                raise PlanError(f"{where} mixes device groups {groups} ({names}); a TP group runs on one device "
                                "type: take its devices from one group")
            nodes = sorted({costs.node_of[d] for d in st.devices})
            if len(nodes) > 1:
                raise PlanError(f"{where} spans nodes {nodes}; a TP group stays inside one node: take devices "
                                f"of one node (its group has {cluster.groups[groups[0]].devices_per_node} per node)")
            check_tp_heads(model, st.tp, where)
    ev = evaluate_hetero(plan, costs)
    for i, j, s in ev.over_budget():
        st = plan.replicas[i].stages[j]
        over = (s.memory["total"] - s.budget) / GIB
        hint = "enable recompute ('full')" if st.recompute != "full" else "move layers to another stage"
        raise PlanError(f"replica {i} stage {j} (layers [{st.start}, {st.end}) on {s.device} devices "
                        f"{list(st.devices)}) needs {s.memory['total'] / GIB:.1f} GiB but the device has "
                        f"{s.budget / GIB:.1f} GiB usable, {over:.1f} GiB over; {hint}, give the stage fewer "
                        "layers or a larger TP group, or use smaller micro-batches (more num_microbatches)")
    return ev
