"""The flags of one real engine, shared by ``flexmesh serve run|bench`` and ``flexmesh profile engine``:
resolved once into an :class:`~flexmesh.serve.engine.config.EngineConfig` (docs/serving-engines.md); the
flags of a fleet of them behind the router."""

from __future__ import annotations

import argparse
import math

from flexmesh.commands.args import fraction, nonempty, nonneg_int, positive_float, positive_int, seconds
from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import SCHEDULERS, EngineConfig
from flexmesh.serve.engines import ENGINES
from flexmesh.serve.lengths import PREDICTORS
from flexmesh.serve.queues import QUEUES
from flexmesh.serve.router import ROUTERS

_DEFAULTS = EngineConfig()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (transformers' continuous batching, vLLM or SGLang; every size explicit)")
    here = [e.name for e in ENGINES.values() if e.runs_here]
    g.add_argument("--engine", choices=here, default="transformers",
                   help="the engine started on this machine: flexmesh's own (transformers), or vLLM / SGLang from "
                   "their own Python with the commands serve export writes")
    g.add_argument("--engine-python", metavar="PATH", help="the Python with vllm or sglang installed (default: "
                   "$FLEXMESH_VLLM_PYTHON / $FLEXMESH_SGLANG_PYTHON, .venvs/ENGINE/bin/python, or this one)")
    g.add_argument("--model-path", metavar="DIR", help="vLLM / SGLang: a Hugging Face model folder (default: the "
                   "--model's seeded random weights, written to a temporary folder; prompts are then token ids)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="vLLM / SGLang: one more word of each engine's command (repeat: --engine-arg=--enforce-eager)")
    g.add_argument("--model", type=nonempty, default=None,
                   help=f"preset, gpt:L:H:A or a config.json; random weights seeded by --seed (nothing downloads) "
                   f"(default: {_DEFAULTS.model}, or a plan's model)")
    g.add_argument("--seed", type=nonneg_int, default=_DEFAULTS.seed, help="seed of the model's weights")
    g.add_argument("--page-size", type=positive_int, default=_DEFAULTS.page_size, help="tokens per KV block")
    g.add_argument("--kv-blocks", type=positive_int, default=_DEFAULTS.num_blocks,
                   help="KV blocks per engine (KV capacity = blocks x page size tokens)")
    g.add_argument("--max-batch-tokens", type=positive_int, default=_DEFAULTS.max_batch_tokens,
                   help="new tokens per iteration: decode tokens and prefill chunks together")
    g.add_argument("--max-batch-requests", type=positive_int, default=_DEFAULTS.max_requests_per_batch,
                   help="requests per iteration")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=_DEFAULTS.scheduler,
                   help="transformers' scheduler: fifo puts decoding requests first")
    g.add_argument("--safety-margin", type=fraction, default=_DEFAULTS.safety_margin,
                   help="fraction of free KV blocks below which no new prefill is admitted beyond the first")
    g.add_argument("--threads", type=positive_int, default=_DEFAULTS.threads, help="torch threads per engine")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the flags describe; a model no transformers family builds is one SpecError line, now."""
    from flexmesh.spec.hf import to_hf_config
    from flexmesh.spec.model import parse_model

    if getattr(args, "engine", "transformers") == "transformers" and args.engine_arg:
        raise ServeError(f"--engine-arg adds words to a vLLM or SGLang command (--engine vllm|sglang); the "
                         f"transformers engine is sized by its own flags (--page-size, --kv-blocks, ...), got "
                         f"{' '.join(args.engine_arg)}")
    model = args.model or _DEFAULTS.model
    to_hf_config(parse_model(model))
    return EngineConfig(model=model, seed=args.seed, page_size=args.page_size, num_blocks=args.kv_blocks,
                        max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_batch_requests,
                        scheduler=args.scheduler, safety_margin=args.safety_margin, threads=args.threads)


def need_aiohttp() -> None:
    try:
        import aiohttp  # noqa: F401
    except ModuleNotFoundError:
        raise ServeError("serving needs aiohttp: pip install -e .[serve]") from None


# engine processes serve run / serve bench start without --engines (and without a plan, backends or router.json)
DEFAULT_ENGINES = 2


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=positive_int,
                   help=f"engine processes to start (one model each; default {DEFAULT_ENGINES}); not with --plan, "
                        "--backend or --router-config, which give the fleet")
    p.add_argument("--backend", metavar="URL,...", help="front engines already running at these URLs instead of "
                   "starting any (vLLM / SGLang servers with --engine vllm|sglang; flexmesh's own otherwise)")
    p.add_argument("--router-config", metavar="FILE", help="front the engines a router.json lists, with its routing "
                   "(flexmesh serve export --out DIR writes one; engines on other hosts)")
    g = p.add_argument_group("router (the simulator's routers and queue policies)")
    g.add_argument("--route", choices=ROUTERS, default=None,
                   help="how the router picks an engine for each request (default: round-robin; a plan's own)")
    g.add_argument("--weights", help="the weights router's weights, one per engine (2,1,1)")
    g.add_argument("--queue", choices=QUEUES, default="fcfs",
                   help="the order each engine's held requests are sent in: fcfs, sjf or tie")
    g.add_argument("--predictor", choices=PREDICTORS, default="oracle",
                   help="output lengths sjf, tie and long-to-kv read: oracle (max_tokens, which a replay sets to the "
                   "trace's length), noisy (the oracle's with log-normal noise) or prompt (a model on the prompt's "
                   "length fitted to --fit-trace)")
    g.add_argument("--predictor-noise", type=positive_float, default=0.5, metavar="SIGMA",
                   help="the noisy predictor's error (standard deviation of its log-length)")
    g.add_argument("--fit-trace", default="azure-conv", help="the trace the prompt predictor is fitted to (its "
                   "lengths scaled to the model's context)")
    g.add_argument("--max-running", type=positive_int,
                   help="requests sent to an engine at once, the rest held in its queue (default: the engine's "
                   "--max-batch-requests, or the plan's max_seqs)")
    g.add_argument("--health-interval", type=seconds, default=1.0, help="seconds between engine health checks")
    g.add_argument("--health-timeout", type=seconds, default=5.0,
                   help="seconds an engine has to answer a health check (two misses in a row: lost, its "
                   "requests re-sent)")
    g.add_argument("--request-timeout", type=seconds, default=600.0, help="seconds a request may wait; then 504")
    g.add_argument("--max-outstanding", type=positive_int, default=4096,
                   help="requests the router holds at once; more are answered 503")


def router_options(args: argparse.Namespace, model: str, engines: int) -> dict:
    """The Router's options the fleet flags describe (resolved once, here)."""
    from flexmesh.data.requests import load_trace, scale_to_context
    from flexmesh.serve.lengths import make_predictor
    from flexmesh.spec.model import parse_model

    context = parse_model(model).max_position
    opts: dict = {"queue": args.queue, "context": context,
                  "health_interval_s": args.health_interval, "health_timeout_s": args.health_timeout}
    if args.queue != "fcfs" or args.route == "long-to-kv":
        fit = scale_to_context(load_trace(args.fit_trace), context) if args.predictor == "prompt" else None
        opts["predictor"] = make_predictor(args.predictor, fit, args.predictor_noise)
    if args.weights:
        try:
            opts["weights"] = tuple(float(x) for x in args.weights.split(","))
        except ValueError:
            raise ServeError(f"--weights {args.weights!r}: give numbers, one per engine (2,1,1)") from None
        w = opts["weights"]
        if len(w) != engines or not all(math.isfinite(x) and x >= 0 for x in w) or not any(w):
            raise ServeError(f"--weights {args.weights!r}: give one finite weight >= 0 per engine ({engines} here), "
                             "not all 0 (e.g. " + ",".join(["1"] * engines) + ")")
        if args.route != "weights":
            raise ServeError("--weights weighs the weights router; add --route weights, or drop --weights")
    elif args.route == "weights":
        raise ServeError("--route weights needs --weights, one per engine (e.g. 2,1,1)")
    if args.max_running:
        opts["max_running"] = args.max_running
    return opts
