"""Validate a (possibly hand-edited) Plan against a model and a cluster, then evaluate it: a layout over
a uniform cluster (:func:`check_plan`) or replica groups on a mixed one (:func:`check_groups`), both by
the same rules (:func:`check_layout`) before their pricing.

Every failure raises :class:`PlanError` with a message saying what to change.
"""

from __future__ import annotations

from flexmesh.cost import CostModel, Evaluation
from flexmesh.cost.training.mixed import GroupsEvaluation, MixedCosts, evaluate_groups
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan
from flexmesh.layout.plan_model import model_shape, recorded_model, shape_diff
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


def check_plan(plan: Plan, model: ModelSpec, cluster: ClusterSpec, cost: CostModel | None = None) -> Evaluation:
    """Raise PlanError on the first problem (:func:`check_layout`, then memory); return the cost model's
    evaluation when the plan of one group over every rank is valid."""
    cost = cost or CostModel(model, cluster)
    check_layout(plan, model, MixedCluster((cluster,)))
    ev = cost.evaluate(plan)
    for r, mem in enumerate(ev.memory):
        if mem["total"] > ev.budget:
            raise PlanError(f"plan needs {mem['total'] / GIB:.1f} GiB on stage {r} but the device has "
                            f"{ev.budget / GIB:.1f} GiB usable; raise pp or enable recompute (add '-ac') "
                            "or ZeRO-3 on that stage's layers")
    return ev


def check_layout(plan: Plan, model: ModelSpec, cluster: MixedCluster) -> None:
    """What every plan, of one replica group or several, must meet on ``model`` and ``cluster`` beyond its
    own rules (checked when it is made: flexmesh.layout.group): it was made for the model, its world and
    layers are the cluster's and the model's, every tensor-parallel group (a run of tp ranks of its stage's
    block: its data ranks may span nodes) on one device type and inside one node, tp divides the heads
    (and suits the KV heads), Ulysses splits the heads over tp x cp, and, in a plan of one group, dp
    divides the sequences of a micro-batch (the groups of a plan of several take each step's sequences from
    the dispatch, a micro-batch's tokens over their replicas: flexmesh.search.replicas may give a group
    micro-batches of fewer sequences than replicas). PlanError names the first fault and what to change."""
    check_model(plan, model)
    if plan.world_size != cluster.world_size:
        raise PlanError(f"plan is for {plan.world_size} devices but {cluster.label} has {cluster.world_size}; "
                        "re-plan for this cluster or pass the cluster the plan was made for")
    if plan.num_layers != model.num_layers:
        raise PlanError(f"plan covers {plan.num_layers} layers but {model.name} has {model.num_layers}; "
                        f"make the stages' layer ranges cover 0..{model.num_layers}")
    for i, g in enumerate(plan.groups):
        mbs = g.microbatch_size
        for j, st in enumerate(g.stages):
            block = g.blocks[j % g.pp]
            at = f"stage {j}" if len(plan.groups) == 1 else f"replica group {i} stage {j}"
            for k, s in enumerate(st.strategies):
                where = f"{at}, layer {st.start + k} ({s})"
                check_tp_heads(model, s.tp, where)
                for run in (block[t:t + s.tp] for t in range(0, len(block), s.tp)):  # its TP groups (tp innermost)
                    types = sorted({cluster.group_of(d) for d in run})
                    if len(types) > 1:
                        names = ", ".join(cluster.groups[x].device.name for x in types)
                        raise PlanError(f"{where}: its TP group on devices {list(run)} mixes device groups {types} "
                                        f"({names}); a TP group runs on one device type: take its devices from one "
                                        "group")
                    nodes = sorted({cluster.node_of(d) for d in run})
                    if len(nodes) > 1:
                        per_node = cluster.groups[types[0]].devices_per_node
                        raise PlanError(f"{where}: its TP group on devices {list(run)} spans nodes {nodes}; keep "
                                        f"each TP group inside one node ({per_node} devices per node): lower tp")
                if s.cp_kind == "ulysses" and model.num_heads % (s.tp * s.cp):
                    raise PlanError(f"{where}: Ulysses needs the {model.num_heads} heads to split over tp x cp = "
                                    f"{s.tp * s.cp}; lower cp or use ring ('r{s.cp}')")
                if len(plan.groups) == 1 and mbs % s.dp:
                    raise PlanError(f"{where}: dp {s.dp} does not divide the {mbs} sequences of a micro-batch "
                                    f"(share {g.share} / {g.num_microbatches} micro-batches); change "
                                    "num_microbatches or dp")


def check_tp_heads(model: ModelSpec, tp: int, where: str) -> None:
    """Raise PlanError unless tensor parallelism of degree ``tp`` splits the attention heads and
    divides, or is a multiple of, the KV heads (which are then repeated)."""
    if model.num_heads % tp:
        raise PlanError(f"{where}: tp {tp} does not divide the {model.num_heads} attention heads; "
                        "use a tp that divides them")
    if not (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0):
        raise PlanError(f"{where}: tp {tp} and the {model.num_kv_heads} KV heads do not divide each "
                        "other; use a tp that divides them or a multiple of them")

def check_model(plan: Plan, model: ModelSpec, by_name: bool = True) -> None:
    """The plan records the model it was made for; refuse another model, even one with as many layers
    (its widths, heads and memory differ), and a config.json under the recorded name whose shape is not
    the recorded model's. A different name of the same shape (a preset and its config.json) is the
    same model. Where the recorded model cannot be read here (no preset, and a config.json that is
    not here or has changed: flexmesh.layout.plan_model.recorded_model), only the name tells:
    ``by_name`` False then accepts the model (training with ``--model config.json`` of a plan made
    from another copy of that file)."""
    recorded = recorded_model(plan)
    if recorded is None and (plan.model == model.name or not by_name):
        return
    if recorded is not None and model_shape(recorded) == model_shape(model):
        return
    diff = f" ({shape_diff(recorded, model)})" if recorded is not None else ""
    source = plan.model_config.path if plan.model_config is not None else plan.model
    raise PlanError(f"plan was made for model {plan.model!r}, not {model.name!r}{diff}; pass --model {source} "
                    f"or re-plan for {model.name}")


def overlap_warnings(plan: Plan) -> list[str]:
    """What the runtime will run differently from the plan's overlap options (warnings, not errors).

    The runtime (FSDP2, DTensor TP) runs :data:`flexmesh.layout.overlap.RUNTIME`: no TP communication
    overlap (TransformerEngine's userbuffers need CUDA; CPU/gloo has none), ZeRO-3 gathers prefetched,
    gradients reduced once in the last micro-batch's backward.

    >>> from flexmesh.layout.overlap import Overlap
    >>> from flexmesh.layout.plan import StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy as S
    >>> p = Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 2, 128, 4, (StagePlan(0, 1, (S(tp=2),)),),
    ...          overlap=Overlap(tp_comm=True, grad_reduce="last"))
    >>> overlap_warnings(p)  # doctest: +ELLIPSIS
    ['plan assumes tensor-parallel communication overlap (tp_comm=true), which the runtime does not run...']
    """
    from flexmesh.layout.overlap import RUNTIME

    out = []
    o = plan.overlap
    strategies = [s for g in plan.groups for s in g.layer_strategies()]
    if o.tp_comm and any(s.tp > 1 for s in strategies):
        out.append("plan assumes tensor-parallel communication overlap (tp_comm=true), which the runtime does not "
                   "run (it needs TransformerEngine userbuffers on CUDA): TP collectives will be exposed and steps "
                   "slower than predicted")
    zeros = {s.zero for s in strategies}
    if any(g.num_microbatches > 1 for g in plan.groups) and o.grad_reduce != RUNTIME.grad_reduce and zeros & {2, 3}:
        out.append(f"plan assumes grad_reduce={o.grad_reduce!r}; the runtime reduces gradients once, in the last "
                   "micro-batch's backward (grad_reduce='last'): less communication, unsharded gradients")
    if not o.zero3_prefetch and 3 in zeros:
        out.append("plan assumes ZeRO-3 gathers without prefetch; the runtime's FSDP2 prefetches them")
    return out


def check_groups(plan: Plan, model: ModelSpec, cluster: MixedCluster, costs: MixedCosts | None = None
                 ) -> GroupsEvaluation:
    """Validate a plan of replica groups against ``model`` and a mixed ``cluster`` (:func:`check_layout`,
    the same rules as a plan of one group), then every stage against its own device's memory; raise
    PlanError on the first problem, else return its evaluation (flexmesh.cost.training.mixed)."""
    check_layout(plan, model, cluster)
    costs = costs or MixedCosts(model, cluster)
    ev = evaluate_groups(plan, costs)
    for i, j, s in ev.over_budget():
        g = plan.groups[i]
        st = g.stages[j]
        over = (s.memory["total"] - s.budget) / GIB
        hint = "enable recompute ('full')" if str(s.recompute) != "full" else "move layers to another stage"
        raise PlanError(f"replica group {i} stage {j} (layers [{st.start}, {st.end}) on {s.device} devices "
                        f"{list(g.blocks[j])}) needs {s.memory['total'] / GIB:.1f} GiB but the device has "
                        f"{s.budget / GIB:.1f} GiB usable, {over:.1f} GiB over; {hint}, give the stage fewer "
                        "layers or a larger TP group, or use smaller micro-batches (more num_microbatches)")
    return ev
