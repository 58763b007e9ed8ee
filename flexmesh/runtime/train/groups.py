"""What the trainer needs to run a plan of any number of replica groups: the checks that a plan can run
here, ``--emulate-speed`` on its ranks, and the chunks of a rank under the whole model's names."""

from __future__ import annotations

import torch

from flexmesh.errors import PlanError
from flexmesh.layout.mesh import group_layout, rank_place
from flexmesh.layout.plan import Plan
from flexmesh.runtime.model.transformer import Transformer
from flexmesh.runtime.parallel.parallelize import check_model_fits_layout
from flexmesh.runtime.parallel.pipeline import check_partition
from flexmesh.runtime.train.stragglers import parse_emulation
from flexmesh.spec.model import ModelSpec


class Chunks(torch.nn.Module):
    """A rank's model chunks under the whole model's names (``layers.N``, ``tok_embeddings``, ``norm``,
    ``output``): the same modules, registered once more."""

    def __init__(self, chunks: list[Transformer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({k: v for c in chunks for k, v in c.layers.items()})
        for end in ("tok_embeddings", "norm", "output"):
            held = [getattr(c, end) for c in chunks if getattr(c, end) is not None]
            if held:
                setattr(self, end, held[0])


def check_runnable(plan: Plan, spec: ModelSpec) -> None:
    """Raise PlanError unless every replica group of ``plan`` can run ``spec`` on this runtime."""
    if plan.num_layers != spec.num_layers:
        raise PlanError(f"plan covers {plan.num_layers} layers but model {spec.name!r} has {spec.num_layers}; "
                        "plan for this model")
    for g in plan.groups:
        check_partition(g, spec.num_layers)
        check_model_fits_layout(spec, group_layout(g))
        if str(plan.pipeline_schedule) == "interleaved" and g.pp > 1:
            for index in range(len(g.blocks[0])):
                ranks = [block[index] for block in g.blocks]
                if ranks != sorted(ranks):
                    raise PlanError(f"an interleaved pipeline runs its stages on rising ranks, but one of this plan "
                                    f"runs on ranks {ranks}; order the replica group's stages by rank")


def check_emulation(plan: Plan, pairs) -> dict[int, float]:  # noqa: ANN001
    """``--slow`` pairs as {rank: factor}, refused on a rank of a pipelined replica group (whose
    forwards and backwards run inside torch's pipeline schedule, not timed per piece) or an unused one."""
    emulated = parse_emulation(pairs, plan.world_size)
    for rank in emulated:
        place = rank_place(plan, rank)
        if place is None:
            raise PlanError(f"--slow names rank {rank}, which the plan leaves unused")
        if plan.groups[place.group].pp > 1:
            raise PlanError("--slow needs ranks of replica groups without pipeline stages (pp 1): a "
                            "pipeline's forwards and backwards run inside torch's pipeline schedule, where they "
                            "are not timed")
    return emulated
