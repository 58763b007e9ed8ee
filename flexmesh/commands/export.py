"""``flexmesh export``: a training checkpoint as a Hugging Face folder (see docs/cli-export.md).

``flexmesh export --checkpoint RUN/checkpoints/step_000100 --out hf/`` writes
``config.json``, sharded safetensors and ``model.safetensors.index.json`` that
``transformers.AutoModelForCausalLM.from_pretrained("hf/")`` loads, from a checkpoint of any layout,
and the run's tokenizer (``tokenizer.json``, ``tokenizer_config.json``) that ``AutoTokenizer`` loads.
"""

from __future__ import annotations

import argparse
import re
import sys

from flexmesh.commands.args import folder, nonempty

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes of ``text``: a number of bytes or one with a unit, as transformers' ``max_shard_size``
    takes them (``5GB`` is 5 * 10**9, ``2GiB`` 2 * 2**30).

    >>> parse_size("2GiB"), parse_size("500MB"), parse_size("1024")
    (2147483648, 500000000, 1024)
    """
    m = _SIZE.fullmatch(text.strip())
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()]) if m else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least one byte; give bytes or e.g. 500MB, "
                                         "2GiB, 5GB")
    return size


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a training checkpoint as a Hugging Face model folder",
                              description="Write a flexmesh training checkpoint (any layout) as config.json and "
                                          "sharded safetensors that transformers loads.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint folder RUN/checkpoints/step_NNNNNN, or a run folder RUN for its latest")
    p.add_argument("--out", required=True, type=folder, help="folder to write the Hugging Face model into")
    p.add_argument("--model", type=nonempty,
                   help="model preset or config.json the run trained (default: the --plan's model, "
                   "else the one the checkpoint's manifest records)")
    p.add_argument("--plan", help="the plan.json the run trained with; its model is the default --model")
    p.add_argument("--tokenizer", help="the tokenizer.json (or a folder holding one) to write beside the model "
                                       "(default: the one the run recorded in RUN/tokenizer/)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="dtype of the written weights (default: the checkpoint's, fp32 master weights)")
    p.add_argument("--max-shard-size", type=parse_size, default="2GiB",
                   help="largest safetensors shard, in bytes or with a unit: 500MB, 2GiB, 5GB (default 2GiB)")
    p.add_argument("--expert-layout", choices=("fused", "per-expert"),
                   help="experts of a mixture of experts: fused (transformers 5) or one key per expert (transformers "
                        "4); default: the layout of the weights the run started from, else fused")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from flexmesh.console import plain_console
    from flexmesh.runtime.state.export import checkpoint_spec, export_checkpoint

    spec = checkpoint_spec(args.checkpoint, model=args.model, plan=args.plan)
    report = export_checkpoint(args.checkpoint, args.out, spec, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                               overwrite=args.overwrite, tokenizer=args.tokenizer, expert_layout=args.expert_layout)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    plain_console().print(report.summary(), highlight=False)
    return 0
