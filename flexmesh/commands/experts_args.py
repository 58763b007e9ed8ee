"""Flags that say how a mixture of experts runs, for the commands that price one (plan, train)."""

from __future__ import annotations

import argparse

from flexmesh.commands.args import nonneg_float, positive_float, positive_int
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.errors import SpecError
from flexmesh.schedule.expert_placement import PLACEMENTS, read_trace, trace_imbalance
from flexmesh.search.space import divisors
from flexmesh.spec.model import ModelSpec

# Most steps of a routing trace a plan replays per layer (the latest): enough for a stable mean, few
# enough that a world of thousands of ranks replays in seconds.
TRACE_STEPS = 32


DEFAULT_LSH = "16x1"  # 32 buckets per (rank, expert): about a fifth of a 4k-token micro-batch's pairs (docs)


def lsh_setting(text: str) -> tuple[int, int]:
    """``DIM`` or ``DIMxHASHES`` (whole numbers >= 1) as (dim, hashes).

    >>> lsh_setting("16x1"), lsh_setting("8")
    ((16, 1), (8, 1))
    """
    dim, _, hashes = text.lower().partition("x")
    try:
        out = (int(dim), int(hashes or 1))
    except ValueError:
        out = (0, 0)
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give DIM or DIMxHASHES, whole numbers >= 1 (e.g. {DEFAULT_LSH})")
    return out


def add_expert_args(p: argparse.ArgumentParser, train: bool = False) -> None:
    """The flags of a command that prices a mixture of experts; with ``train``, also how the run places
    and balances them."""
    g = p.add_argument_group("mixtures of experts (docs/experts.md)")
    g.add_argument("--expert-placement", default="laer", choices=PLACEMENTS,
                   help="which data ranks run which experts: laer follows the last step's load (default), current "
                        "places every layer of every micro-batch from its own routing (a load that does not persist; "
                        "one all-reduce per layer), eplb the load averaged over 10 steps, re-planned every 10; static "
                        "never moves them" + ("" if train else "; baselines price their own"))
    g.add_argument("--expert-imbalance", type=positive_float, metavar="X",
                   help="price the most loaded data rank's routed tokens at X times the mean (default: measured: "
                        "LAER-MoE's per-placement figures, or --routing's)")
    g.add_argument("--routing", metavar="FILE",
                   help="a routing.jsonl of an earlier run (`flexmesh train` writes one): the placement replayed on "
                        "its loads gives the imbalance priced at every data-rank count")
    g.add_argument("--expert-lsh", nargs="?", const=DEFAULT_LSH, type=lsh_setting, metavar="DIMxHASHES",
                   help="compress the experts' token all-to-all (LSH-MoE): the tokens bound for one expert on one "
                        "rank clustered by cross-polytope hashing of DIM rotated dimensions, HASHES times "
                        "((2 DIM)^HASHES buckets), only centroids sent, each token corrected by its residual; "
                        f"default {DEFAULT_LSH} when given without a value (docs/experts.md#compressed-all-to-all)")
    if train:
        g.add_argument("--expert-slots", type=positive_int, metavar="N",
                       help="experts one data rank may run per layer (default: its static share plus one, for a "
                            "replica)")
        g.add_argument("--aux-loss", type=nonneg_float, default=0.0, metavar="COEF",
                       help="train with a load-balancing loss of this coefficient (Switch Transformer's, weighted by "
                            "the previous step's expert loads so that every layout trains the same; Mixtral's configs "
                            "say 0.02); 0 (default): none")
        g.add_argument("--balance-rate", type=nonneg_float, default=0.0, metavar="R",
                       help="aux-loss-free balancing: each step every expert's routing bias moves by R towards the "
                            "mean load (DeepSeek-V3 used 0.001); 0 (default): routing as the model routes")


def experts_of(model: ModelSpec, world: int, placement: str = "laer", imbalance: float | None = None,
               routing: str | None = None, slots: int | None = None,
               lsh: tuple[int, int] | None = None) -> ExpertParallel:
    """The :class:`~flexmesh.cost.training.experts.ExpertParallel` that ``--expert-placement``,
    ``--expert-imbalance``, ``--routing`` and ``--expert-slots`` describe for ``model`` on a world of
    ``world`` ranks: with a routing trace, every placement replayed on its latest :data:`TRACE_STEPS`
    steps at every data-rank count dividing the world (baselines price theirs)."""
    measured: tuple[tuple[str, int, float], ...] = ()
    if routing is not None:
        moe = model.moe
        rows = read_trace(routing)
        counts = {len(r["expert_tokens"]) for r in rows}
        if moe is None or counts != {moe.num_experts}:
            raise SpecError(f"routing trace {routing} routes to {sorted(counts)} experts but model "
                            f"{model.name!r} has {moe.num_experts if moe else 0}; give a trace of this model")
        steps = sorted({int(r.get("step", 0)) for r in rows})[-TRACE_STEPS:]
        rows = [r for r in rows if int(r.get("step", 0)) in steps]
        measured = tuple((p, n, trace_imbalance(rows, p, n)) for p in PLACEMENTS for n in divisors(world) if n > 1)
    return ExpertParallel(placement, imbalance=imbalance, slots=slots, measured=measured, lsh=lsh)


def check_lsh(args: argparse.Namespace, model: ModelSpec) -> None:
    """Refuse ``--expert-lsh`` in one line for a model without experts."""
    if getattr(args, "expert_lsh", None) is not None and not model.is_moe:
        raise SpecError(f"--expert-lsh compresses the experts' all-to-all, and model {model.name!r} has no experts; "
                        "drop --expert-lsh")
