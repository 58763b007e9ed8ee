"""``flexmesh profile engine``: measure a local engine's iterations into an engine profile.

The engine is the one ``flexmesh serve run`` starts (:class:`flexmesh.serve.engine.engine.Engine`, the
same :class:`~flexmesh.serve.engine.config.EngineConfig`), run in this process without HTTP, and every
time comes from its own iteration log: an iteration is timed from scheduling to the tokens handed out,
so the engine's per-iteration overhead is in every sample. Scenarios, each run twice:

- prefill chunks: one request whose prompt is one chunk (8 tokens up to the token budget) or several
  (two and four budgets: chunks after a prefix);
- decode batches: ``b`` requests with prompts of ``c`` tokens, for ``b`` from 1
  to the engine's request cap and ``c`` over a grid of contexts (``b * c`` at most 8192 tokens, and what the
  KV cache holds), with
  outputs long enough that all ``b`` decode together at the end; their prefill iterations (several
  prompts in one budget, then decodes beside the last prompts' chunks) are samples too;
- mixed batches: ``b`` short requests decoding while a long prompt is prefilled in the budget left.

Every iteration is a sample ``(batch, seconds)``; identical batches (over repeats, scenarios and engines)
keep their median, which the fit (:func:`flexmesh.profile.iteration.fit_iterations`) is made from. The
seconds are the CPU time of the engine's thread over the iteration (``time.thread_time``), not its wall
time: on a machine other work shares, an iteration's wall time also holds the time the engine waited for a
core, which depends on that work, not on the engine; the CPU time keeps what the engine did, stalls on
memory included. On cores of its own an engine's wall time is its CPU time (97% of it, measured while
serving on a quiet machine), which is what the simulator prices. Profile with as many engines as will
serve side by side (``engines``): they share the machine's caches and memory bandwidth, and one alone runs
faster than one of two.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

from flexmesh.errors import ProfileError
from flexmesh.profile.format import produced_by, spec_hash
from flexmesh.profile.iteration import EngineProfile, fit_iterations
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.replay import prompt_ids

DECODE_TOKENS = 6  # decode iterations of a whole decode-scenario batch once every prompt is in
# A decode scenario's iterations grow as b x (b x c) (transformers' SDPA path: module doc of
# flexmesh.profile.iteration), so the grid keeps b x c within "batch_kv" tokens: minutes, not an hour.
FULL = {"batches": (1, 2, 4, 8, 16, 32, 64), "contexts": (16, 128, 512, 1024), "prefill": (8, 32, 64, 128),
        "mixed": (1, 4, 16), "repeats": 2, "batch_kv": 8192}
QUICK = {"batches": (1, 4, 16), "contexts": (16, 256), "prefill": (16, 64), "mixed": (4,), "repeats": 2,
         "batch_kv": 4096}


def scenarios(cfg: EngineConfig, quick: bool, max_position: int) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt lengths, output tokens) of every scenario the sweep runs for ``cfg``.

    >>> [s[0] for s in scenarios(EngineConfig(num_blocks=256, max_batch_tokens=64), True, 4096)][:4]
    ['prefill 16', 'prefill 64', 'prefill 128', 'prefill 256']
    """
    grid = QUICK if quick else FULL
    budget = cfg.max_batch_tokens
    room = int(cfg.kv_tokens * (1.0 - cfg.safety_margin))  # the FIFO scheduler admits no prefill beyond this
    out: list[tuple[str, list[int], list[int]]] = []
    for n in sorted({p for p in grid["prefill"] if p < budget} | {budget, 2 * budget, 4 * budget}):
        if n + 1 <= min(room, max_position):
            out.append((f"prefill {n}", [n], [1]))
    for b in grid["batches"]:
        for c in grid["contexts"]:
            # outputs outlast the prefill of the whole batch, so that all b requests decode together at the end
            n_out = -(-b * c // budget) + DECODE_TOKENS
            if (b <= cfg.max_requests_per_batch and b * (c + n_out) <= room and c + n_out <= max_position
                    and b * c <= grid["batch_kv"]):
                out.append((f"decode {b} x {c}", [c] * b, [n_out] * b))
    long = 2 * budget
    for b in grid["mixed"]:
        if b < cfg.max_requests_per_batch and b * 24 + long <= room and long < max_position:
            # short prompts finish prefill together first; they decode while the long prompt is chunked
            out.append((f"mixed {b} + {long}", [8] * b + [long], [16] * b + [1]))
    if not out:
        raise ProfileError(f"an engine of {cfg.num_blocks} blocks x {cfg.page_size} tokens holds no scenario of the "
                           "sweep; raise num_blocks")
    return out


def profile_engine(cfg: EngineConfig, quick: bool = False, engines: int = 1,
                   progress: Callable[[int, int, str], None] | None = None) -> EngineProfile:
    """Run the sweep on ``engines`` engines of ``cfg`` at once and fit it (see the module doc). With more than
    one, each runs the sweep in its own process at the same time, as ``flexmesh serve run`` runs that many
    engines side by side on this machine's cores, so their contention is in every sample (as the training
    profiles' ``--nproc``); the samples of all are pooled."""
    from flexmesh.serve.engine.model import engine_spec

    spec = engine_spec(cfg)
    if engines == 1:
        timed, plan, share = _sweep(cfg, quick, progress)
    else:
        import multiprocessing
        import os

        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # the engines' processes, as the fleet starts them
        if progress is not None:
            progress(0, 1, f"{engines} engines")
        with multiprocessing.get_context("spawn").Pool(engines) as pool:
            results = pool.starmap(_sweep, [(cfg, quick, None)] * engines)
        timed = defaultdict(list)
        for one, _, _ in results:
            for batch, secs in one.items():
                timed[batch].extend(secs)
        plan = results[0][1]
        share = statistics.mean(r[2] for r in results)
        if progress is not None:
            progress(1, 1, "fit")
    samples = [(list(batch), statistics.median(secs)) for batch, secs in sorted(timed.items())]
    fit = fit_iterations(samples)
    spec_dict = spec.to_dict()
    prof = EngineProfile(model={**spec_dict, "hash": spec_hash(spec_dict)}, engine=_engine_dict(cfg), fit=fit,
                         samples=samples, produced_by=produced_by(engines, device_type="cpu"))
    prof.produced_by["sweep"] = {"quick": quick, "repeats": (QUICK if quick else FULL)["repeats"], "scenarios": plan,
                                 "iterations": sum(len(v) for v in timed.values()), "cpu_share": share}
    return prof


def _sweep(cfg: EngineConfig, quick: bool, progress) -> tuple[dict[tuple, list[float]], list[str], float]:
    """Every scenario ``repeats`` times on one engine: the seconds of each batch it ran, the scenarios, and the
    share of a core the engine had while iterating (its CPU time over the iterations' wall time)."""
    from flexmesh.serve.engine.engine import Engine

    repeats = (QUICK if quick else FULL)["repeats"]
    timed: dict[tuple, list[float]] = defaultdict(list)
    wall = cpu = 0.0
    with Engine(cfg) as engine:
        plan = scenarios(cfg, quick, engine.max_position)
        engine.run([prompt_ids(1, 32, engine.vocab)] * 2, [4, 4])  # warm-up: first calls allocate
        total = len(plan) * repeats
        for r in range(repeats):
            for k, (name, lengths, outputs) in enumerate(plan):
                if progress is not None:
                    progress(r * len(plan) + k, total, name)
                engine.iterations.clear()
                prompts = [prompt_ids(1000 * r + i, n, engine.vocab) for i, n in enumerate(lengths)]
                engine.run(prompts, outputs)
                for it in list(engine.iterations):
                    timed[tuple(sorted(it.batch))].append(it.cpu_s)
                    wall += it.duration_s
                    cpu += it.cpu_s
        if progress is not None:
            progress(total, total, "fit")
    return dict(timed), [s[0] for s in plan], cpu / wall if wall > 0 else 1.0


def _engine_dict(cfg: EngineConfig) -> dict:
    import json

    return json.loads(cfg.to_json())
