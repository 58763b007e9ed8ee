"""``profile_model``: time and memory of the runtime's own layers, measured and fitted.

Everything is measured on the modules the runtime trains (:mod:`flexmesh.runtime.model.transformer`), in the
dtype it trains in (fp32), one packed row (micro-batch) at a time:

- layer time: a :class:`~flexmesh.runtime.model.transformer.TransformerBlock` forward, backward, and backward
  under recomputation (``torch.utils.checkpoint``, non-reentrant, as the runtime's checkpoint
  wrapper) over rows of several lengths, each packed with one long document, with many short ones
  and with mixes, so that the fit ``c0 + c1 * tokens + c2 * sum(len^2) + c3 * tokens^2``
  (:class:`~flexmesh.profile.fit.LayerFit`) separates per-token work, per-document attention and
  whole-row attention;
- embedding and head (final norm + LM head + summed cross-entropy): forward and backward, linear in
  tokens;
- saved-activation bytes per token of one layer (:class:`~flexmesh.runtime.observe.memory.SavedActivationMeter`;
  measured by flexmesh.profile.activations),
  with and without recomputation, for each (tp, cp) degree. Shards are measured in one process by
  building the block with one rank's shapes -- heads / tp, kv heads / tp, ffn / tp -- on tokens / cp,
  and by replaying sequence parallelism around it: the norms run on the rank's 1/tp slice of the
  tokens, a concatenation stands for the all-gather before attention and the MLP (a new tensor of the
  whole slice, as the all-gather makes), and a slice of the output stands for the reduce-scatter
  (neither saves anything for backward, like the collectives). Bytes are fitted as ``a + b * tokens +
  m * (tokens / cp)^2`` over rows of three lengths: ``b`` is recorded per token of the micro-batch on
  each device of the tp x cp group; ``m`` is the dense attention mask the CPU kernel saves (measured
  once, at tp = cp = 1); ``a`` is what does not grow with tokens (recorded, not used);
- bytes per parameter of weights, gradients and AdamW states, and the AdamW step's seconds per
  parameter (``torch.optim.AdamW`` with its defaults, as the trainer);
- the whole model as the trainer runs it (:func:`_measure_whole`: the runtime's model with up to
  ``WHOLE_LAYERS`` layers, the trainer's summed cross-entropy, one forward and one backward per row)
  against the sum of its parts as fitted above: one factor per pass, ``measured = k * parts``
  (least squares in relative error). A layer timed alone runs again and again on the same weights
  and inputs (in cache, most likely), a model's layers in sequence do not, and the parts alone
  under-predict a micro-batch (``tiny`` on a 2-core machine: factors 1.16-1.17 forward, 1.02-1.06 backward); the
  cost model multiplies every pass by the factor (:class:`~flexmesh.profile.timing.ProfiledTiming`);
- the framework's fixed cost per pipeline chunk (:func:`_measure_stages`): the same model cut into
  1, 2 and 4 pipeline stages on one process, a step of short micro-batches through the runtime's
  interleaved schedule per cut, fitted linear in stages x micro-batches;
- with more than one process, the same layer timings under real process groups for every
  (tp, cp kind, cp) layout that divides the world (tp x cp up to the sweep's ``max_degree``), and
  the embedding and head under each tp
  (:func:`_measure_parallel`): what one process with divided shapes cannot see -- DTensor dispatch,
  Ulysses' permutes and copies, the ring kernel's dense blocks, the group's communication and
  contention -- is in these times.

Under torchrun all processes run the sweep at the same time; rank 0 writes the median of each timing
(the maximum for timings under real groups, which move at their slowest member's pace).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from flexmesh.cost.training.work import attention_sq
from flexmesh.errors import ProfileError
from flexmesh.profile.activations import measure_activations
from flexmesh.profile.fit import LayerFit, fit_layer_time, fit_linear, fit_whole
from flexmesh.profile.format import END_KEYS, ModelProfile, produced_by
from flexmesh.profile.modules import degrees, packed_row, parallel_layouts, rank_block
from flexmesh.profile.runner import World, median_time, progress, synchronize
from flexmesh.runtime.model.loss import summed_cross_entropy
from flexmesh.spec.model import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sweep(quick: bool, gpu: bool = False) -> dict:
    """Rows to time (each a list of document lengths), token counts for the ends, repetitions.

    On a GPU the rows are longer: there a layer over up to a few thousand tokens takes no longer
    than the host takes to launch its kernels (on an H200, TinyLlama's layer took 1.4 ms forward
    from 128 to 4096 tokens alike), so shorter rows time the host, and a fit over them prices an
    8,192-token micro-batch at the launch cost."""
    if gpu:
        rows_at = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192, 12288, 16384]
        ends = [1024, 2048, 4096] if quick else [2048, 4096, 8192, 16384]
    else:
        rows_at = [128, 256, 512, 1024, 2048] if quick else [128, 256, 512, 1024, 2048, 3072, 4096]
        ends = [128, 256, 512] if quick else [256, 512, 1024, 2048]
    rows = []
    for r in rows_at:
        rows.append([r])  # one document: sum(len^2) = tokens^2
        rows.append([r // 8] * 8)  # many short ones: sum(len^2) = tokens^2 / 8
        if not quick:
            rows.append([r // 2, r // 4, r // 8, r // 8])  # a mix
    return {"rows": rows, "reps": 2 if quick else 5, "end_tokens": ends,
            "act_tokens": [128, 256, 512] if quick else [256, 512, 1024], "max_degree": 2 if quick else 8,
            # rows of the layer sweep up to this many tokens are timed whole (_measure_whole)
            "whole_max_tokens": 8192 if gpu else 1024}


def _time_layer(block, row, local_tokens: int, reps: int, spec: ModelSpec, dtype,
                device, between=None) -> tuple[float, float, float]:
    """Median seconds of forward, backward and backward under recomputation of one row
    (``local_tokens``: the tokens of the row this process holds between layers). ``between`` runs,
    untimed, after each forward: a barrier there keeps a group member's backward from counting the
    time it waits for a slower member's forward (ring attention's ranks do unequal forward work)."""
    x = torch.randn(1, local_tokens, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    out: dict[str, list[float]] = {"fwd": [], "bwd": [], "rc": []}
    for i in range(reps + 1):  # the first run warms up
        for recompute in (False, True):
            t0 = time.perf_counter()
            y = checkpoint(block, x, row, use_reentrant=False) if recompute else block(x, row)
            synchronize(device)
            t1 = time.perf_counter()
            if between is not None:
                between()
            t2 = time.perf_counter()
            y.backward(grad)
            synchronize(device)
            t3 = time.perf_counter()
            del y
            if i:
                out["rc" if recompute else "bwd"].append(t3 - t2)
                if not recompute:
                    out["fwd"].append(t1 - t0)
    x.grad = None
    block.zero_grad(set_to_none=True)
    fwd, bwd, rc = (float(np.median(out[k])) for k in ("fwd", "bwd", "rc"))
    return fwd, bwd, rc


def _time_ends(spec: ModelSpec, tokens: list[int], reps: int, dtype, device, tp_mesh=None) -> dict[str, list[float]]:
    """Forward and backward seconds of the embedding and of norm + head + loss, per token count.

    The runtime's modules; with ``tp_mesh``, split over it as the runtime splits them (vocab-parallel
    embedding and head, sequence-parallel norm, logits gathered), so its collectives are timed too.
    """
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.parallelize import apply_tp

    model = build_model(replace(spec, num_layers=1, tie_embeddings=False), device, dtype)
    model.layers = torch.nn.ModuleDict()
    tp = 1
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
        tp = tp_mesh.size()
    emb, norm, head = model.tok_embeddings, model.norm, model.output
    assert emb is not None and norm is not None and head is not None  # a whole model holds both ends
    out: dict[str, list[float]] = {k: [] for k in END_KEYS}
    for n in tokens:
        ids = torch.randint(0, spec.vocab, (1, n), device=device)
        if tp_mesh is not None:  # the same ids on every rank of the group, as the runtime feeds them
            torch.distributed.broadcast(ids, src=torch.distributed.get_global_rank(tp_mesh.get_group(), 0),
                                        group=tp_mesh.get_group())
        h = torch.randn(1, n // tp, spec.hidden, device=device, dtype=dtype, requires_grad=True)  # the rank's slice
        g = torch.randn(1, n // tp, spec.hidden, device=device, dtype=dtype)
        state: dict = {}

        def emb_f():
            # under tp the output is an async reduce-scatter's result; using it waits for it, as the
            # first layer does in training
            state["e"] = emb(ids) * 1.0

        def emb_b():
            state["e"].backward(g)

        def head_f():
            logits = head(norm(h))
            state["loss"] = summed_cross_entropy(logits, ids) / n

        def head_b():
            state["loss"].backward()

        for name, fwd, bwd in (("embedding", emb_f, emb_b), ("head", head_f, head_b)):
            tf, tb = _time_passes(fwd, bwd, reps, device, warmup=1)
            out[f"{name}_forward"].append(tf)
            out[f"{name}_backward"].append(tb)
    return out


def _time_passes(fwd, bwd, reps: int, device, warmup: int = 0, before=None) -> tuple[float, float]:
    """Median seconds of ``fwd()`` and of ``bwd()``, run in turn ``warmup + reps`` times (the first
    ``warmup`` untimed); ``before``, untimed, ahead of each turn."""
    tf, tb = [], []
    for i in range(warmup + reps):
        if before is not None:
            before()
        f, b = median_time(fwd, 1, device, warmup=0), median_time(bwd, 1, device, warmup=0)
        if i >= warmup:
            tf.append(f)
            tb.append(b)
    return float(np.median(tf)), float(np.median(tb))


PASSES = ("forward", "backward", "backward_recompute")
# Layers of the model timed whole (_measure_whole): enough for layers to evict each other's weights
# and activations from the caches, few enough to build for any model the layer sweep can time.
WHOLE_LAYERS = 4


def _layer_sweep(block, rows: list[list[int]], cfg: dict, spec: ModelSpec, dtype, device, world: World, reduce,
                 tp: int = 1, cp: int = 1, cp_rank: int = 0, between=None, advance=None,
                 per_document: bool = True) -> tuple[dict, list]:
    """Time ``block`` over ``rows`` (the shortest once first, untimed, for the first calls' one-off costs: a
    long row warms up nothing more, and each row's own first run is untimed too), combine each timing over the
    processes with ``reduce`` (``world.medians`` or ``world.maxes``) and fit each pass.

    With ``tp`` / ``cp`` this process holds its cp slice (``cp_rank``) of each row's positions and
    its 1/tp slice of the hidden states. ``per_document`` off: fitted without a per-document term
    (:func:`~flexmesh.profile.fit.fit_layer_time`). Returns ({pass: LayerFit}, sample rows).
    """
    times = []
    for i, lengths in enumerate([min(rows, key=sum), *rows]):
        n = sum(lengths) // cp
        world.barrier()
        times.append(_time_layer(block, packed_row(spec, lengths, device, cp, cp_rank), n // tp,
                                 cfg["reps"] if i else 1, spec, dtype, device, between=between))
        if i and advance is not None:
            advance(f"layer, {sum(lengths)} tokens in {len(lengths)} documents")
    flat = reduce([x for t in times[1:] for x in t])
    times = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    tokens = [float(sum(r)) for r in rows]
    # The timed block is layer 0 (_block): its window decides the squared tokens it did, and the fit's
    # cost per squared token then prices every layer's windowed statistic (CostModel.attention_sq).
    sq = [float(sum(attention_sq(0, x, (spec.window_of(0),)) for x in r)) for r in rows]
    fits = {name: fit_layer_time(tokens, sq, [t[i] for t in times], per_document) for i, name in enumerate(PASSES)}
    samples = [{"lengths": r, **{f"{name}_s": t[i] for i, name in enumerate(PASSES)}} for r, t in zip(rows, times)]
    return fits, samples


def _ends_sweep(spec: ModelSpec, cfg: dict, dtype, device, reduce, tp_mesh=None) -> tuple[dict, dict]:
    """:func:`_time_ends` over ``cfg["end_tokens"]``, combined over processes with ``reduce`` and
    fitted linear in tokens. Returns ({END_KEYS key: LayerFit}, {key: seconds per token count})."""
    got = _time_ends(spec, cfg["end_tokens"], cfg["reps"], dtype, device, tp_mesh=tp_mesh)
    flat = reduce([x for k in END_KEYS for x in got[k]])
    n = len(cfg["end_tokens"])
    per_key = {k: flat[j * n:(j + 1) * n] for j, k in enumerate(END_KEYS)}
    return {k: LayerFit(*fit_linear(cfg["end_tokens"], v), 0.0) for k, v in per_key.items()}, per_key


def _model_batch(spec: ModelSpec, lengths: list[int], device) -> SimpleNamespace:
    """What the runtime's model reads of a PackedBatch for one packed row of documents of ``lengths``."""
    row = packed_row(spec, lengths, device)
    return SimpleNamespace(positions=torch.cat([torch.arange(x) for x in lengths])[None].to(device),
                           cu_seqlens=row.docs.cu, bounds=row.docs.bounds)


def _measure_whole(spec: ModelSpec, cfg: dict, layer: dict, ends: dict, dtype, device, world: World,
                   compile: bool = False) -> dict:
    """The runtime's model of ``min(num_layers, WHOLE_LAYERS)`` layers timed as the trainer runs a
    micro-batch (forward with the summed cross-entropy, then backward) over the layer sweep's rows
    of up to ``cfg["whole_max_tokens"]`` tokens, against the parts' fits (``layer``, ``ends``: layers x
    layer fit + embedding + head), fitted as ``measured = k * parts + fixed`` per direction (both
    >= 0; least squares in relative error); returns {"layers", "forward": k, "forward_fixed_s":
    fixed, "backward": k, "backward_fixed_s": fixed, "samples"}."""
    from flexmesh.runtime.model.transformer import build_model

    n_layers = min(spec.num_layers, WHOLE_LAYERS)
    model = build_model(replace(spec, num_layers=n_layers, tie_embeddings=False), device, dtype)
    for block in model.layers.values():
        _compiled(block, compile)
    rows = [r for r in cfg["rows"] if sum(r) <= cfg["whole_max_tokens"]]
    measured = []
    for lengths in [rows[-1], *rows]:  # the first, untimed, warms up
        n = sum(lengths)
        ids = torch.randint(0, spec.vocab, (1, n), device=device)
        batch = _model_batch(spec, lengths, device)
        state: dict = {}

        def fwd():
            logits = model(ids, batch)
            state["loss"] = summed_cross_entropy(logits, ids) / n

        def bwd():
            state.pop("loss").backward()

        measured.append(_time_passes(fwd, bwd, cfg["reps"], device, before=world.barrier))
        model.zero_grad(set_to_none=True)
    flat = world.medians([x for t in measured[1:] for x in t])
    out: dict = {"layers": n_layers, "samples": []}
    parts: dict[str, list[float]] = {"forward": [], "backward": []}
    for i, lengths in enumerate(rows):
        n = float(sum(lengths))
        sq = float(sum(attention_sq(0, x, (spec.window_of(0),)) for x in lengths))
        for direction in parts:
            parts[direction].append(float(n_layers * layer[direction].time(n, sq) + ends[f"embedding_{direction}"]
                                          .time(n, 0.0) + ends[f"head_{direction}"].time(n, 0.0)))
        out["samples"].append({"lengths": lengths, "forward_s": flat[2 * i], "backward_s": flat[2 * i + 1],
                               "parts_forward_s": parts["forward"][-1], "parts_backward_s": parts["backward"][-1]})
    for j, direction in enumerate(parts):
        out[direction], out[f"{direction}_fixed_s"] = fit_whole(parts[direction], flat[j::2])
    return out


# Pipeline stages the model is cut into on one process (:func:`_measure_stages`): each a torch.distributed.
# pipelining stage run by the runtime's interleaved schedule; enough chunk runs per step for a fraction
# of a millisecond each to stand clear of the step's noise.
PIPELINE_STAGES = (1, 2, 4)
PIPELINE_MICROBATCHES = 8
PIPELINE_TOKENS = 32  # a short row: the framework's work, not the kernels', is what grows with the stages


def _measure_stages(spec: ModelSpec, cfg: dict, dtype, device, world: World) -> dict:
    """The framework's fixed seconds per pipeline chunk per micro-batch (forward and backward together).

    The runtime's model of ``min(num_layers, WHOLE_LAYERS)`` layers is cut into 1, 2 and 4 pipeline
    stages (as many as it has layers; a stage may hold only the embedding), all on this process, and
    a step of :data:`PIPELINE_MICROBATCHES` rows of :data:`PIPELINE_TOKENS` tokens runs through
    torch.distributed.pipelining's interleaved schedule, as :mod:`flexmesh.runtime.parallel.pipeline` builds
    it (stages on one rank hand activations over in memory: no sends). The layers' work is the same
    whatever the cut, so the step time grows with the chunk runs (stages x micro-batches) by what
    each costs the framework: the schedule's actions, each stage's autograd call, the stage's input
    and gradient buffers. Fitted ``step = base + fixed x stages x micro-batches`` (both >= 0, least
    squares in relative error); returns {"stages", "microbatches", "tokens", "step_s", "stage_fixed_s"}.

    Each process measures alone (a process group of itself); rank 0 keeps the medians.
    """
    import copy

    import torch.distributed as dist

    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.pipeline import StageModule, build_pipeline_schedule, make_stages, split_stage

    own = not dist.is_initialized()
    if own:  # one process without torchrun: a group of one, in memory
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        alone = dist.group.WORLD if own else [dist.new_group([r]) for r in range(world.size)][world.rank]
        n_layers = min(spec.num_layers, WHOLE_LAYERS)
        base = build_model(replace(spec, num_layers=n_layers, tie_embeddings=False), device, dtype)
        counts = sorted({min(s, max(n_layers, 2)) for s in PIPELINE_STAGES})  # one layer: an embedding-only stage
        m, n = PIPELINE_MICROBATCHES, PIPELINE_TOKENS
        batch = _model_batch(spec, [n], device)
        ids = torch.randint(0, spec.vocab, (m, n), device=device)
        times = []
        for count in counts:
            cuts = [round(k * n_layers / count) for k in range(count + 1)]
            modules = [StageModule(split_stage(copy.deepcopy(base), cuts[k], cuts[k + 1], k == 0, k == count - 1))
                       for k in range(count)]
            stages = make_stages(modules, list(range(count)), count, device, alone, tokens=n, tp=1,
                                 hidden=spec.hidden, vocab=spec.vocab, dtype=dtype)
            for stage in stages:  # every neighbour is on this process: no link to warm up (torch <= 2.11's
                # schedules send a warm-up tensor to each neighbour stage, here to itself, which gloo refuses)
                stage._get_init_p2p_neighbors_ops = list
            sched = build_pipeline_schedule(stages, "interleaved", m, summed_cross_entropy)

            def step():
                for mod in modules:
                    mod.feed([batch] * m)
                sched.step(ids, target=ids, losses=[], return_outputs=False)

            world.barrier()
            times.append(median_time(step, cfg["reps"] + 1, device))
        times = world.medians(times)
    finally:
        if own:
            dist.destroy_process_group()
    _, fixed = fit_linear([c * m for c in counts], times)
    return {"stages": counts, "microbatches": m, "tokens": n, "step_s": times, "stage_fixed_s": fixed}


def _mesh(world: World, tp: int, cp: int):
    """All ranks in groups of tp x cp (tp innermost, as the runtime's mesh); every group runs at once."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, (world.size // (tp * cp), cp, tp), mesh_dim_names=("dp", "cp", "tp"))


def _parallel_block(spec: ModelSpec, mesh, kind: str, dtype, device):
    """One runtime layer split as the runtime splits it: TP + SP over ``mesh["tp"]``, context
    parallelism of ``kind`` over ``mesh["cp"]``."""
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.context import ContextParallelAttention, CPContext, apply_context_parallel
    from flexmesh.runtime.parallel.parallelize import apply_tp

    model = build_model(replace(spec, num_layers=1, tie_embeddings=False), device, dtype)
    model.tok_embeddings = model.norm = model.output = None
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    cp = mesh["cp"]
    if cp.size() > 1:
        apply_context_parallel(model, ContextParallelAttention(
            CPContext(kind=kind, group=cp.get_group(), rank=cp.get_local_rank(), size=cp.size())))
    return model.layers["0"]


def _measure_parallel(spec: ModelSpec, cfg: dict, world: World, dtype, device, advance, compile: bool = False) -> dict:
    """Layer times per (tp, cp kind, cp) and embedding/head times per tp, under real process groups.

    Each process holds what it holds in training: its cp slice of the row's positions (the global
    ``cu_seqlens``), its 1/tp sequence-parallel slice of the hidden states. A group waits for its
    slowest member, so each timing is the maximum over processes. Fits are in the micro-batch's
    tokens on the group, with the group's communication inside them.
    """
    layers, ends = [], []
    for tp, kind, cp in parallel_layouts(spec, world.size, cfg["max_degree"], cfg.get("groups")):
        mesh = _mesh(world, tp, cp)
        block = _compiled(_parallel_block(spec, mesh, kind, dtype, device), compile)
        rows = [r for r in cfg["rows"] if sum(r) % (tp * cp) == 0]
        # Ring attention computes dense blocks of the whole row whatever its documents: no per-document term
        # to fit, so rows of one document suffice (half the rows of the sweep's slowest layout)
        ring = kind == "ring"
        if ring:
            rows = [r for r in rows if len(r) == 1]
        fits, samples = _layer_sweep(block, rows, cfg, spec, dtype, device, world, world.maxes, tp=tp, cp=cp,
                                     cp_rank=mesh["cp"].get_local_rank(), between=world.barrier,
                                     per_document=not ring)
        layers.append({"tp": tp, "cp": cp, "cp_kind": kind, **fits, "samples": samples})
        advance(f"layer tp{tp} {kind} cp{cp}")
        if cp == 1:  # the embedding and the head split over tp only
            world.barrier()
            fits, per_key = _ends_sweep(spec, cfg, dtype, device, world.maxes, tp_mesh=mesh["tp"])
            ends.append({"tp": tp, **fits,
                         "samples": {"tokens": cfg["end_tokens"], **{f"{k}_s": v for k, v in per_key.items()}}})
    return {"world_size": world.size, "layers": layers, "ends": ends}


def _states(spec: ModelSpec, reps: int, dtype, device) -> dict:
    block = rank_block(spec, dtype, device)
    params = [p for p in block.parameters()]
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    step_s = median_time(opt.step, reps, device)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                      if torch.is_tensor(t) and k != "step")
    return {"weight_bytes_per_param": params[0].element_size(), "grad_bytes_per_param": params[0].grad.element_size(),
            "optimizer_bytes_per_param": state_bytes / n, "optimizer_step_s_per_param": step_s / n,
            "layer_params": n, "optimizer": "torch.optim.AdamW"}


def _compiled(block, compile: bool):
    """``block`` with its forward compiled as the runtime compiles it (``flexmesh train --compile``), or as is."""
    if compile:
        from flexmesh.runtime.parallel.parallelize import compile_block

        compile_block(block)
    return block


def profile_model(spec: ModelSpec, quick: bool = False, dtype: str = "fp32", show_progress: bool = True,
                  world: World | None = None, compile: bool | None = None,
                  max_group: int | None = None, degrees_only: Collection[tuple[int, int]] | None = None,
                  groups_only: Collection[tuple[int, str, int]] | None = None,
                  pipeline: bool = True) -> ModelProfile | None:
    """Measure ``spec`` with the runtime's modules; every process calls it, rank 0 gets the profile.

    ``compile``: time the layers and the whole model with compiled blocks, as the runtime runs them
    (default: on a GPU, as ``flexmesh train``'s default); saved activations are metered eagerly.
    ``max_group``: the largest tp x cp timed under real process groups (default the sweep's; 1: none).
    ``degrees_only``: measure saved activations of these (tp, cp) only (and of tp = cp = 1);
    ``groups_only``: time these (tp, cp kind, cp) under real process groups only; ``pipeline`` off: no
    pipeline stages (:func:`_measure_stages`; a plan without pp prices none).
    """
    from flexmesh.runtime.model.transformer import check_supported

    check_supported(spec)
    if dtype not in DTYPES:
        raise ProfileError(f"dtype {dtype!r} is not one flexmesh profiles; use one of {sorted(DTYPES)}")
    world = world or World()
    device, dt = world.device, DTYPES[dtype]
    compile = device.type == "cuda" if compile is None else compile
    cfg = sweep(quick, device.type == "cuda")
    if degrees_only is not None:
        cfg["degrees"] = [d for d in degrees(spec, cfg["max_degree"]) if d == (1, 1) or d in degrees_only]
    torch.manual_seed(0)
    n_deg = len(cfg.get("degrees") or degrees(spec, cfg["max_degree"]))  # saved activations, in one process
    if groups_only is not None:
        cfg["groups"] = set(groups_only)
    n_par = len(parallel_layouts(spec, world.size, max_group or cfg["max_degree"], cfg.get("groups")))
    with progress(show_progress and world.is_main, f"profiling {spec.name}",
                  len(cfg["rows"]) + 3 + pipeline + n_deg + n_par) as advance:
        layer, layer_rows = _layer_sweep(_compiled(rank_block(spec, dt, device), compile), cfg["rows"], cfg, spec, dt,
                                         device, world, world.medians, advance=advance)
        world.barrier()
        end_fits, ends = _ends_sweep(spec, cfg, dt, device, world.medians)
        advance("embedding and head")
        whole = _measure_whole(spec, cfg, layer, end_fits, dt, device, world, compile)
        advance(f"whole model ({whole['layers']} layers)")
        stages = _measure_stages(spec, cfg, dt, device, world) if pipeline else {}
        if stages:
            advance(f"pipeline stages ({', '.join(map(str, stages['stages']))})")
        states = _states(spec, cfg["reps"], dt, device)
        states["optimizer_step_s_per_param"] = world.medians([states["optimizer_step_s_per_param"]])[0]
        advance("optimizer")
        activations = measure_activations(spec, cfg, dt, device, advance)
        parallel = _measure_parallel(spec, {**cfg, "max_degree": max_group or cfg["max_degree"]}, world, dt, device,
                                     advance, compile) if world.size > 1 else {}
    if not world.is_main:
        return None
    samples = {"layer_rows": layer_rows, "end_tokens": cfg["end_tokens"], **{f"{k}_s": v for k, v in ends.items()}}
    return ModelProfile(model=spec.to_dict(), dtype=dtype, layer=layer,
                        embedding={"forward": end_fits["embedding_forward"],
                                   "backward": end_fits["embedding_backward"]},
                        head={"forward": end_fits["head_forward"], "backward": end_fits["head_backward"]},
                        activations=activations, states=states, parallel=parallel, whole_model=whole,
                        pipeline=stages,
                        produced_by=produced_by(processes=world.size, device_count=world.size,
                                                device_type=world.device.type),
                        samples=samples, name=f"model-{spec.name}")
