"""A serving plan's replicas as engine processes on this machine (``flexmesh serve run --plan``).

Each replica of the plan (in the order :meth:`~flexmesh.serve.layout.plan.ServingPlan.placement` places them, the
order its routing table weighs them in) becomes one engine process with the replica's knobs, as transformers
names them: ``max_seqs`` -> the router's cap on requests sent at once and the engine's ``max_requests_per_batch``,
``max_batched_tokens`` -> ``max_batch_tokens``, ``block_tokens`` -> ``page_size``, ``kv_blocks`` -> ``num_blocks``
(else the engine's default), ``prefix_caching`` -> ``block_sharing``. Routing is the plan's table.

The plan names GPUs. Where this machine has them (CUDA devices whose driver names are the plan's device types, as
many as it needs), each tp-1 replica runs on its own GPU. Where it does not, the plan is refused in one line,
unless ``map_to_cpu`` asks to run every replica as a CPU engine here (timings then are this machine's, not the
GPUs': said in the notes; a replica wider than one device is then one CPU engine too). What transformers' engines
cannot be is refused in one line too: replicas wider than one GPU (tp or pp above 1), prefill/decode roles (no KV
transfer between transformers engines), several models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy, RoutingTable

CPU_WEIGHTS_GIB = 2.0  # the most weights one CPU engine of a mapped plan may hold (random weights, seconds to build)


@dataclass(frozen=True)
class LocalEngines:
    configs: tuple[EngineConfig, ...]  # one per engine, in the plan's placement order
    max_running: tuple[int, ...]
    table: RoutingTable
    routing: RoutingPolicy  # the plan's routing policy inside a bucket
    notes: tuple[str, ...]


def local_gpus() -> list[str]:
    """The device presets of this machine's CUDA devices, in index order (empty without CUDA)."""
    try:
        import torch
    except ModuleNotFoundError:
        return []
    if not torch.cuda.is_available():
        return []
    from flexmesh.spec.devices import preset_of_gpu

    return [preset_of_gpu(torch.cuda.get_device_name(i)) or torch.cuda.get_device_name(i)
            for i in range(torch.cuda.device_count())]


def plan_engines(plan, base: EngineConfig, model: str | None = None, map_to_cpu: bool = False,
                 gpus: list[str] | None = None) -> LocalEngines:
    """The engines that run ``plan`` here (see the module doc); ``base`` gives what the plan does not (the
    engine's KV blocks where the plan sizes them from GPU memory, threads, seed); ``model`` replaces the plan's."""
    if len(plan.models) > 1:
        raise ServeError(f"the plan serves {len(plan.models)} models; serve run starts engines of one model: run each "
                         "model's plan on its own, or export it (flexmesh serve export)")
    roles = sorted({g.role for g in plan.groups})
    if roles != [Role.AGGREGATED]:
        others = " and ".join(r for r in roles if r is not Role.AGGREGATED)
        raise ServeError(f"the plan has {others} replicas; transformers engines serve aggregated only (no KV transfer "
                         "between them): export it to vLLM (flexmesh serve export --engine vllm) or plan it aggregated")
    placed = plan.placement()
    need: dict[str, int] = {}
    for r in placed.replicas:
        need[r.device.name] = need.get(r.device.name, 0) + r.spec.devices
    have = local_gpus() if gpus is None else gpus
    notes: list[str] = []
    devices: list[str] = []
    if map_to_cpu:
        from flexmesh.cost.inference.memory import weight_bytes_on_device
        from flexmesh.spec.model import parse_model

        gib = weight_bytes_on_device(parse_model(model or plan.models[0]), 1, 1) / 2**30
        if gib > CPU_WEIGHTS_GIB:
            raise ServeError(f"{model or plan.models[0]} holds {gib:.1f} GiB of weights, too many for a CPU engine "
                             f"per replica here (at most {CPU_WEIGHTS_GIB:g} GiB); give a small --model (e.g. tiny) "
                             "to run the plan's layout with it")
        devices = ["cpu"] * len(placed.replicas)
        notes.append(f"the plan's {', '.join(f'{n} {d}' for d, n in sorted(need.items()))} mapped to "
                     f"{len(placed.replicas)} CPU engine(s) here (--map-to-cpu), one each whatever its tp x pp: "
                     "timings are this machine's, not the GPUs'")
    else:
        free = {d: [i for i, x in enumerate(have) if x == d] for d in need}
        short = {d: n - len(free[d]) for d, n in need.items() if len(free[d]) < n}
        if short:
            asked = ", ".join(f"{n} {d}" for d, n in sorted(need.items()))
            here = (", ".join(f"{have.count(d)} {d}" for d in sorted(set(have))) if have else "no GPU")
            raise ServeError(f"the plan needs {asked}; this machine has {here}: run it here as CPU engines with "
                             "--map-to-cpu (this machine's timings, not the GPUs'), or export it for the GPUs' "
                             "machines (flexmesh serve export)")
        wide = next((g for g in plan.groups if g.tp * g.pp > 1), None)
        if wide is not None:
            raise ServeError(f"the plan's {wide.label} replicas span {wide.tp * wide.pp} devices; a transformers "
                             "engine here runs on one: export the plan to vLLM (flexmesh serve export) for tp/pp, or "
                             "run its layout as CPU engines (--map-to-cpu)")
        for r in placed.replicas:
            devices.append(f"cuda:{free[r.device.name].pop(0)}")
    configs, caps = [], []
    for k, dev in zip(placed.knobs, devices):
        configs.append(replace(base, model=model or plan.models[0], device=dev, max_batch_tokens=k.max_batched_tokens,
                               max_requests_per_batch=k.max_seqs, page_size=k.block_tokens,
                               num_blocks=k.kv_blocks or base.num_blocks, block_sharing=k.prefix_caching))
        caps.append(k.max_seqs)
    if model and model != plan.models[0]:
        notes.append(f"model {model} in place of the plan's {plan.models[0]}")
    return LocalEngines(tuple(configs), tuple(caps), placed.table, plan.routing, tuple(notes))
