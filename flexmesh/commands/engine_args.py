"""The flags of one real engine, shared by ``flexmesh serve run|bench`` and ``flexmesh profile engine``:
resolved once into an :class:`~flexmesh.serve.engine.config.EngineConfig` (docs/serving-engines.md); the
flags of a fleet of them behind the router."""

from __future__ import annotations

import argparse

from flexmesh.commands.args import fraction, nonneg_int, positive_int, seconds
from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import SCHEDULERS, EngineConfig

_DEFAULTS = EngineConfig()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (transformers' continuous batching; every size explicit)")
    g.add_argument("--model", default=_DEFAULTS.model,
                   help="preset, gpt:L:H:A or a config.json; random weights seeded by --seed (nothing downloads)")
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

    to_hf_config(parse_model(args.model))
    return EngineConfig(model=args.model, seed=args.seed, page_size=args.page_size, num_blocks=args.kv_blocks,
                        max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_batch_requests,
                        scheduler=args.scheduler, safety_margin=args.safety_margin, threads=args.threads)


def need_aiohttp() -> None:
    try:
        import aiohttp  # noqa: F401
    except ModuleNotFoundError:
        raise ServeError("serving needs aiohttp: pip install -e .[serve]") from None


def add_fleet_args(p: argparse.ArgumentParser, engines_default: int | None) -> None:
    p.add_argument("--engines", type=positive_int, default=engines_default,
                   help="engine processes to start (one model each)")
    p.add_argument("--route", choices=("round-robin", "least-outstanding"), default="round-robin",
                   help="how the router picks an engine for each request")
    p.add_argument("--request-timeout", type=seconds, default=600.0, help="seconds a request may wait; then 504")
    p.add_argument("--max-outstanding", type=positive_int, default=4096,
                   help="requests the router holds at once; more are answered 503")
