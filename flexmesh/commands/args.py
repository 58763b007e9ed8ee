"""argparse ``type=`` checks shared by the commands: a bad value is one usage line from argparse
(``argument --top: must be a whole number >= 1, got '0'``), never a traceback or a silent default.

>>> positive_int("8"), nonneg_int("0"), positive_float("3e-4"), nonneg_float("0")
(8, 0, 0.0003, 0.0)
>>> positive_int("0")
Traceback (most recent call last):
argparse.ArgumentTypeError: must be a whole number >= 1, got '0'
>>> positive_float("nan")
Traceback (most recent call last):
argparse.ArgumentTypeError: must be a finite number > 0, got 'nan'
"""

from __future__ import annotations

import argparse
import errno
import math
import os
from collections.abc import Callable
from pathlib import Path

from flexmesh.layout.stack import ATTENTION_KERNELS, FRAMEWORKS, RUNTIME_STACK, Stack
from flexmesh.spec.limits import MAX_SEQ_LEN, MAX_SEQUENCES, MAX_STEPS, MAX_TOKENS
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet, load_tasks

# What `plan` and `simulate` assume when neither a plan nor the flag says: one meaning in both.
DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_SEQ_LEN, DEFAULT_GLOBAL_BATCH = "llama3-8b", "8xH100", 8192, 128
# simulate's --lengths and --policies; plan's policy recommendation draws its batches from these lengths too
DEFAULT_LENGTHS, DEFAULT_POLICIES = "wikipedia", "hdp"


def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,} (flexmesh's bound; give a realistic value), "
                                             f"got {text!r}")
        return value

    parse.__name__ = f"whole number >= {minimum}"  # what argparse names in "invalid ... value"
    return parse


def _float(minimum: float, strict: bool, maximum: float | None = None) -> Callable[[str], float]:
    rel = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not (value > minimum if strict else value >= minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {rel} {minimum:g}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}, got {text!r}")
        return value

    parse.__name__ = f"number {rel} {minimum:g}"
    return parse


positive_int = _int(1)
nonneg_int = _int(0)
# sizes a user types, bounded before any work (flexmesh.spec.limits)
sequences = _int(1, MAX_SEQUENCES)
tokens = _int(1, MAX_TOKENS)
seq_len = _int(1, MAX_SEQ_LEN)
steps = _int(1, MAX_STEPS)
positive_float = _float(0.0, strict=True)
nonneg_float = _float(0.0, strict=False)
learning_rate = _float(0.0, strict=True, maximum=1.0)  # no published LLM recipe comes near 1
seconds = _float(0.0, strict=True, maximum=7 * 86400.0)  # a week: past it, a timeout is never


def fraction(text: str) -> float:
    """A number in [0, 1] (a ratio such as the cosine floor of the learning rate)."""
    value = nonneg_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def positive_fraction(text: str) -> float:
    """A number in (0, 1]: a share that must be some of a whole, such as an SLO's attainment target."""
    value = fraction(text)
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def chunk_counts(text: str) -> tuple[int, ...]:
    """Comma-separated chunks per pipeline rank for the interleaved schedule, each >= 2.

    >>> chunk_counts("2,4,8")
    (2, 4, 8)
    >>> chunk_counts("1,2")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: chunks per rank must be whole numbers >= 2 (interleaved: two or more), got '1'
    """
    out = []
    for item in text.split(","):
        try:
            v = int(item.strip())
        except ValueError:
            v = 0
        if v < 2:
            raise argparse.ArgumentTypeError(
                f"chunks per rank must be whole numbers >= 2 (interleaved: two or more), got {item.strip()!r}")
        out.append(v)
    return tuple(dict.fromkeys(out))


def rank_factors(text: str) -> list[tuple[int, float]]:
    """``RANK=FACTOR[,RANK=FACTOR...]``: whole ranks >= 0 with factors in (0, 1] (whether a rank is in
    the run is checked where the world size is known).

    >>> rank_factors("1=0.5,3=0.25")
    [(1, 0.5), (3, 0.25)]
    >>> rank_factors("1=1.5")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: factor of rank 1 must be a number in (0, 1], got '1.5'
    """
    out = []
    for item in text.split(","):
        rank_text, sep, factor_text = item.strip().partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"must be RANK=FACTOR (e.g. 1=0.5), got {item.strip()!r}")
        try:
            rank = nonneg_int(rank_text.strip())
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"rank must be a whole number >= 0, got {rank_text.strip()!r}") from None
        try:
            factor = positive_float(factor_text.strip())
        except argparse.ArgumentTypeError:
            factor = math.nan
        if not 0.0 < factor <= 1.0:
            raise argparse.ArgumentTypeError(f"factor of rank {rank} must be a number in (0, 1], "
                                             f"got {factor_text.strip()!r}")
        out.append((rank, factor))
    return out


rank_factors.__name__ = "RANK=FACTOR list"

# One flag and one text for slow devices in plan, simulate and train (docs/cli.md#slow-devices)
SLOW_HELP = ("devices slower than the rest: RANK=FACTOR runs device (rank) RANK at FACTOR of its speed, FACTOR in "
             "(0, 1] (3=0.5: device 3 at half speed); repeatable or comma-separated. plan and simulate price it "
             "(compute stretched, communication not); train EMULATES it, for testing on one machine")


def given_flags(flags: dict[str, object]) -> list[str]:
    """The flags of ``{flag: value}`` that were given (a truthy value), in their order: for refusing flags that
    cannot go together, naming the first.

    >>> given_flags({"--rate": None, "--budget": 3.0, "--cascade": False, "--window": "1h"})
    ['--budget', '--window']
    """
    return [flag for flag, value in flags.items() if value]


def first_given(flags: dict[str, object]) -> str | None:
    """The first of :func:`given_flags`, or None where none was given.

    >>> first_given({"--plan": None, "--backend": ["a:8000"]}), first_given({"--plan": None})
    ('--backend', None)
    """
    return next(iter(given_flags(flags)), None)


def add_slow_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, dest: str = "slow", *old: str) -> None:
    """``--slow RANK=FACTOR,...`` (:func:`rank_factors`, a list of pairs in ``dest``; ``old``: former
    spellings kept working). Checked against the run's devices by flexmesh.spec.speeds.slow_devices.

    >>> p = argparse.ArgumentParser()
    >>> add_slow_arg(p)
    >>> p.parse_args(["--slow", "1=0.5,3=0.25", "--slow", "2=1"]).slow, p.parse_args([]).slow
    ([(1, 0.5), (3, 0.25), (2, 1.0)], [])
    """
    p.add_argument("--slow", dest=dest, type=rank_factors, action="extend", default=[], metavar="RANK=FACTOR,...",
                   help=SLOW_HELP)
    if old:
        old_names(p, *old, dest=dest, type=rank_factors, action="extend")


def new_file(text: str) -> str:
    """A file path to write: refused when it names an existing folder (the file would go nowhere)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a file, got an empty path")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path (e.g. {text.rstrip('/')}/plan.json)")
    return text


def folder(text: str) -> str:
    """A folder path to write into: refused when it names an existing file."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a folder, got an empty path")
    # The limits of Linux and macOS file systems (NAME_MAX, PATH_MAX), checked whether or not the
    # folders on the way exist yet: the kernel reports ENOENT for a missing one before a long name.
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in Path(text).parts)
    why = (f"a name in it is {longest} bytes, longer than the file system allows (255)" if longest > 255 else
           "it is longer than the file system allows (4095 bytes)" if len(os.fsencode(text)) > 4095 else None)
    try:
        os.stat(text)
    except FileNotFoundError:
        pass
    except OSError as e:  # a loop of links, a file where a folder goes: one line
        why = why or ("a part of it is a file, not a folder" if e.errno == errno.ENOTDIR else e.strerror or str(e))
    if why is not None:
        shown = text if len(text) <= 60 else f"{text[:28]}...{text[-28:]}"
        raise argparse.ArgumentTypeError(f"{shown!r} ({len(text)} characters) cannot be a folder: {why}; choose "
                                         "another path")
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is an existing file, not a folder; give a folder path")
    return text


def nonempty(text: str) -> str:
    """A value that must not be empty (``--cluster ""`` would otherwise fall back to a default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def old_names(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, dest: str, **kwargs) -> None:
    """Keep ``flags`` (a flag's former spellings) working for ``dest``, unlisted in ``--help``.

    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--seq-len", type=int, default=8)
    >>> old_names(p, "--max-len", dest="seq_len", type=int)
    >>> p.parse_args(["--max-len", "4"]).seq_len, p.parse_args([]).seq_len
    (4, 8)
    """
    p.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def examples(*lines: str) -> str:
    """A command's ``--help`` epilog: its examples, one per line, as they are typed."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, saying a default only where there is one to say: not for flags
    without a value (None, False, ""), nor where the help already names it; the description and the
    examples printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


TASKS_HELP = ("LoRA fine-tuning: a job file (TOML) of [[task]] tables, one adapter each, on the frozen base model "
              "(docs/adapters.md)")


def tasks_of(path: str | None, spec: ModelSpec) -> TaskSet | None:
    """The LoRA tasks of ``--tasks`` (the job file at ``path``) checked against model ``spec``; None without."""
    if path is None:
        return None
    tasks = load_tasks(path)
    tasks.check(spec)
    return tasks


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """``--attention``, ``--no-sequence-parallel``, ``--dropout``: price a stack other than flexmesh's runtime
    (flexmesh.layout.stack)."""
    g = p.add_argument_group("another training stack's layers (default: flexmesh's runtime)")
    g.add_argument("--attention", choices=ATTENTION_KERNELS, default=RUNTIME_STACK.attention,
                   help="flash2 (default, flexmesh's runtime): FlashAttention-2; fused: the fastest fused kernel "
                        "of the architecture (FlashAttention-3-class on Hopper, as Transformer Engine runs it); "
                        "unfused: separate kernels over the whole s x s scores, which are kept for backward "
                        "(Megatron-LM before flash attention)")
    g.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="tensor parallelism without sequence parallelism: norms, dropouts and the GEMM inputs "
                        "kept whole on every tp rank")
    g.add_argument("--dropout", action="store_true", help="the stack trains with dropout (a one-byte mask per "
                   "dropped element kept for backward)")
    g.add_argument("--fused-swiglu", action="store_true", help="the stack fuses SwiGLU and recomputes silu in "
                   "backward (Megatron-LM, Transformer Engine): 3 x ffn kept per token instead of 4")
    g.add_argument("--recompute-pointwise", dest="pointwise_recompute", action="store_true",
                   help="the stack recomputes norms, rotary and the MLP activation in backward (torch.compile's "
                        "partitioner): per token it keeps 4h + 2kv + 2ffn, no GEMM input of its own")
    g.add_argument("--fp32-grad-reduce", action="store_true",
                   help="the stack reduces fp16 gradients over the data-parallel ranks in fp32 (DeepSpeed's "
                        "fp32_allreduce, Megatron-LM's --accumulate-allreduce-grads-in-fp32): 4 bytes a parameter")
    g.add_argument("--framework", choices=sorted(FRAMEWORKS), default=RUNTIME_STACK.framework.name,
                   help="the stack's time above the kernels: flexmesh (default) and megatron price the same; "
                        "llm-foundry: Composer and PyTorch FSDP, eager, its GEMM share and eager cross entropy; "
                        "deepspeed-pipe: DeepSpeed's pipeline engine, gradients all-reduced after the backward "
                        "(docs/cost-model.md)")


def stack_of(args: argparse.Namespace) -> Stack:
    """The :class:`~flexmesh.layout.stack.Stack` of :func:`add_stack_args`' flags."""
    return Stack(attention=args.attention, sequence_parallel=args.sequence_parallel, dropout=args.dropout,
                 fused_swiglu=args.fused_swiglu, pointwise_recompute=args.pointwise_recompute,
                 fp32_grad_reduce=args.fp32_grad_reduce, framework=FRAMEWORKS[args.framework])
