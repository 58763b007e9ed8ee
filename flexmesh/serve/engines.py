"""The serving engines flexmesh knows, one registry row each, read by the simulator (the scheduler it runs for
an engine's replicas), by ``serve export`` (how a replica of a plan is launched on it, and whose argument parser
checks the command) and by ``serve run`` (whether flexmesh starts it on this machine).

- ``vllm``: ``vllm serve``;
- ``sglang``: ``python -m sglang.launch_server``;
- ``trtllm``: TensorRT-LLM, simulated (the ``trtllm`` engine description) but not exported;
- ``distserve``: DistServe's own engine, simulated (the ``distserve`` description) but not exported (a plan for
  it exports as vLLM or SGLang commands with the flags matching its description);
- ``transformers``: transformers' continuous batching, flexmesh's own engine (:mod:`flexmesh.serve.engine`); not
  exported.

``serve run`` starts ``transformers``, ``vllm`` and ``sglang`` engines here (the latter two from their own Python,
through ``module``: :mod:`flexmesh.serve.engine.external`).

What a replica does is its plan's engine description (:mod:`flexmesh.serve.layout.engine`: the scheduler, CUDA
graphs, overlap): ``flags`` turns it into the launch command's flags where they differ from the engine's defaults
(the table below). Another engine is one :class:`EngineKind` given to :func:`register` (and, if it schedules
otherwise, a scheduler of its own registered in :mod:`flexmesh.serve.schedulers` that its description names).

The plan's knobs, by the engines' names:

=========================  ==================================  =========================================
plan (vLLM's names)        ``vllm serve``                      ``python -m sglang.launch_server``
=========================  ==================================  =========================================
tp, pp                     --tensor/--pipeline-parallel-size   --tp-size, --pp-size
max_seqs                   --max-num-seqs                      --max-running-requests
max_batched_tokens         --max-num-batched-tokens            --chunked-prefill-size
memory_fraction            --gpu-memory-utilization            --mem-fraction-static
block_tokens               --block-size                        --page-size
kv_blocks                  --num-gpu-blocks-override           --max-total-tokens (blocks x block size)
prefix_caching off         --no-enable-prefix-caching          --disable-radix-cache
role prefill / decode      --kv-transfer-config (NIXL,         --disaggregation-mode prefill / decode
                           kv_role kv_both)                    (--disaggregation-transfer-backend nixl)
no chunked prefill          --no-enable-chunked-prefill         --chunked-prefill-size -1
prompts mixed with decodes  (V1: always)                       --enable-mixed-chunk
no CUDA graphs             --enforce-eager                     --disable-cuda-graph
CPU work overlapped        (default; off: --no-async-scheduling) (default; off: --disable-overlap-schedule)
=========================  ==================================  =========================================

>>> sorted(ENGINES), [e.name for e in exported()]
(['distserve', 'sglang', 'transformers', 'trtllm', 'vllm'], ['vllm', 'sglang'])
>>> from flexmesh.serve.layout.knobs import EngineKnobs
>>> " ".join(engine("vllm").argv(EngineKnobs(64, 1024), 1, 1, Role.AGGREGATED, "/m", "127.0.0.1", 8100)[:6])
'vllm serve /m --tensor-parallel-size 1 --pipeline-parallel-size'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from flexmesh.errors import SpecError
from flexmesh.serve.layout.engine import EngineSpec
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.roles import Role

# vLLM's disaggregated prefill/decode through NIXL: both sides hold kv_role kv_both and a proxy (flexmesh's
# router) sends each request to a prefill engine, then to a decode engine (vLLM docs, "Disaggregated Prefilling").
VLLM_KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}

# A replica's launch command: (its knobs, tp, pp, role, model path, host, port) -> argv
Argv = Callable[[EngineKnobs, int, int, Role, str, str, int], list[str]]


@dataclass(frozen=True)
class ParserCheck:
    """How ``serve export`` checks an engine's commands with the engine's own argument parser: Python that builds
    ``parser`` and ``version``, and how many words of the command come before its arguments."""

    setup: str
    skip: int
    model_flag: str | None = None  # the parser's flag for a model given as the command's first argument


@dataclass(frozen=True)
class EngineKind:
    name: str
    title: str  # as people write it
    argv: Argv | None = None  # how a replica is launched on it (None: serve export does not write it)
    check: ParserCheck | None = None
    runs_here: bool = False  # serve run starts it on this machine
    module: str | None = None  # the Python module behind its command (serve run starts it from the engine's Python)
    flags: Callable[[EngineSpec], list[str]] | None = None  # what its launch adds for a description
    half: tuple[str, ...] = ()  # its flags serving bf16 weights as fp16 (a part without bf16: Volta, Turing)


ENGINES: dict[str, EngineKind] = {}


def register(e: EngineKind) -> EngineKind:
    ENGINES[e.name] = e
    return e


def engine(name: str) -> EngineKind:
    found = ENGINES.get(name)
    if found is None:
        raise SpecError(f"unknown engine {name!r}; engines: {', '.join(ENGINES)}")
    return found


def exported() -> list[EngineKind]:
    """The engines ``serve export`` writes launch commands for, in registry order."""
    return [e for e in ENGINES.values() if e.argv is not None]


def _vllm(k: EngineKnobs, tp: int, pp: int, role: Role, model: str, host: str, port: int) -> list[str]:
    argv = ["vllm", "serve", model, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--max-num-seqs", str(k.max_seqs), "--max-num-batched-tokens", str(k.max_batched_tokens),
            "--gpu-memory-utilization", f"{k.memory_fraction:g}", "--block-size", str(k.block_tokens),
            "--enable-prefix-caching" if k.prefix_caching else "--no-enable-prefix-caching",
            "--host", host, "--port", str(port)]
    if k.kv_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(k.kv_blocks)]
    if role != Role.AGGREGATED:
        argv += ["--kv-transfer-config", json.dumps(VLLM_KV_TRANSFER, separators=(",", ":"))]
    return argv


def _sglang(k: EngineKnobs, tp: int, pp: int, role: Role, model: str, host: str, port: int) -> list[str]:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(tp), "--pp-size", str(pp),
            "--max-running-requests", str(k.max_seqs), "--chunked-prefill-size", str(k.max_batched_tokens),
            "--mem-fraction-static", f"{k.memory_fraction:g}", "--page-size", str(k.block_tokens), "--host", host,
            "--port", str(port)]
    if k.kv_blocks is not None:
        argv += ["--max-total-tokens", str(k.kv_blocks * k.block_tokens)]
    if not k.prefix_caching:
        argv.append("--disable-radix-cache")
    if role != Role.AGGREGATED:
        argv += ["--disaggregation-mode", str(role), "--disaggregation-transfer-backend", "nixl"]
    return argv


# The engines' own default CUDA graph sizes (engines.toml's vllm and sglang presets' sources): export writes a flag
# only where a description's differs.
VLLM_CAPTURE, SGLANG_GRAPH_BATCH = 512, 160


def _vllm_flags(e: EngineSpec) -> list[str]:
    out = [] if e.chunked_prefill else ["--no-enable-chunked-prefill"]
    if not e.cuda_graphs:
        out.append("--enforce-eager")
    elif max(e.graphs) != VLLM_CAPTURE:  # one capture size, decode-only and mixed batches alike
        out += ["--max-cudagraph-capture-size", str(max(e.graphs))]
    if e.all_reduce == "nccl":
        out.append("--disable-custom-all-reduce")
    if not e.cpu_overlap:  # async scheduling is vLLM's default
        out.append("--no-async-scheduling")
    return out


def _sglang_flags(e: EngineSpec) -> list[str]:
    out = [] if e.chunked_prefill else ["--chunked-prefill-size", "-1"]
    if not e.prefill_first:
        out.append("--enable-mixed-chunk")
    if not e.cuda_graphs:
        out.append("--disable-cuda-graph")
    elif e.graph_batch != SGLANG_GRAPH_BATCH:
        out += ["--cuda-graph-max-bs", str(e.graph_batch)]
    if e.all_reduce == "nccl":
        out.append("--disable-custom-all-reduce")
    if not e.cpu_overlap:
        out.append("--disable-overlap-schedule")
    return out


register(EngineKind("vllm", "vLLM", flags=_vllm_flags, half=("--dtype", "half"), argv=_vllm, runs_here=True,
                    module="vllm.entrypoints.openai.api_server", check=ParserCheck(
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = make_arg_parser(FlexibleArgumentParser())\n"
    "import vllm\nversion = vllm.__version__\n", 2, model_flag="--model")))  # argv after 'vllm serve'
register(EngineKind("sglang", "SGLang", flags=_sglang_flags, half=("--dtype", "half"), argv=_sglang, runs_here=True,
                    module="sglang.launch_server", check=ParserCheck(
    "from sglang.srt.server_args import ServerArgs\nimport argparse\n"
    "parser = argparse.ArgumentParser()\nServerArgs.add_cli_args(parser)\n"
    "import sglang\nversion = sglang.__version__\n", 3)))  # argv after 'python -m sglang.launch_server'
register(EngineKind("trtllm", "TensorRT-LLM"))
register(EngineKind("distserve", "DistServe"))
register(EngineKind("transformers", "transformers' continuous batching", runs_here=True))
