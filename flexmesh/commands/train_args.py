"""``flexmesh train``'s flags (the command itself: flexmesh.commands.train)."""

from __future__ import annotations

import argparse

from flexmesh.commands.args import (
    add_slow_arg,
    folder,
    fraction,
    learning_rate,
    nonempty,
    nonneg_float,
    nonneg_int,
    old_names,
    positive_float,
    positive_int,
    seconds,
    seq_len,
    sequences,
    tokens,
)
from flexmesh.commands.experts_args import add_expert_args
from flexmesh.data.mixture import MIXTURES
from flexmesh.data.reweighting import STRATEGIES as REWEIGHT_STRATEGIES
from flexmesh.runtime.endpoint import RDZV_WAIT_S
from flexmesh.runtime.launch import DEFAULT_RUN_ID
from flexmesh.runtime.parallel.device import DEVICES
from flexmesh.runtime.parallel.precision import TRAIN_DTYPES
from flexmesh.schedule.registry import RUNTIME_POLICIES

POLICY_NAMES = tuple(str(p) for p in RUNTIME_POLICIES)  # plain strings: argparse prints choices with repr


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``flexmesh train``'s flags; ``--seq-len``, ``--global-batch`` and ``--slow`` mean what they mean in
    ``plan`` and ``simulate`` (old spellings: ``--max-len``, ``--emulate-speed``)."""
    p.add_argument("--plan", help="plan.json written by `flexmesh plan` (default: plan for the devices this run "
                                  "trains on, written to OUT/plan.json; docs/cli-train.md#without-a-plan)")
    p.add_argument("--cluster", help="without --plan: plan for this cluster rather than this machine's devices")
    p.add_argument("--tp", type=positive_int, help="without --plan: the tensor-parallel degree the plan must use")
    p.add_argument("--pp", type=positive_int, help="without --plan: the pipeline-parallel degree the plan must use")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="without --plan: the ZeRO stage the plan must use")
    p.add_argument("--corpus", help="folder of text files, a .jsonl file with a text field, or 'stdlib' (this "
                                    "Python's standard-library sources); with --tasks each task names its own")
    p.add_argument("--tasks", metavar="FILE",
                   help="LoRA fine-tuning: a job file (TOML) of [[task]] tables, one adapter each, trained together "
                        "on the frozen base model (docs/adapters.md)")
    p.add_argument("--domains", metavar="PATH",
                   help="a corpus of named domains drawn per step by --mixture: a manifest .json (each domain's name, "
                        "corpus, optional weight and held-out eval corpus) or a folder of one sub-folder per domain "
                        "(docs/mixtures.md)")
    p.add_argument("--mixture", choices=MIXTURES, default="static",
                   help="with --domains, how the domain weights move: static (the manifest's weights, else each "
                        "domain's share of the tokens), doremi (excess loss over --mixture-reference's), odm (a bandit "
                        "rewarded by each domain's loss); default static")
    p.add_argument("--mixture-reference", metavar="RUN",
                   help="with --mixture doremi: the folder of a --mixture static run of the same --domains, whose "
                        "per-domain losses are the reference")
    p.add_argument("--reweight", choices=REWEIGHT_STRATEGIES,
                   help="weigh each step's documents by their loss (Sow et al., ICLR 2025), scored by a forward "
                        "before the step: linupper (easy documents count less), quadratic (the middle more), "
                        "extremes (both ends more); default off (docs/mixtures.md)")
    p.add_argument("--reweight-delta", type=float, default=1.0, metavar="DELTA",
                   help="with --reweight: the losses are mapped onto [-DELTA, DELTA] before the softmax; larger "
                        "spreads the weights (linupper: up to e^DELTA); default 1")
    p.add_argument("--max-steps", type=positive_int, required=True,
                   help="optimizer steps to run (in total, across resumes)")
    p.add_argument("--out", required=True, type=folder, help="output folder: metrics.jsonl and checkpoints/")
    p.add_argument("--model", type=nonempty,
                   help="model preset or config.json (default: the plan's model: the config.json it "
                   "records, else its preset)")
    p.add_argument("--tokenizer", help="a tokenizer.json; default: with --weights the tokenizer.json beside them, else "
                                       "train a byte-level BPE of the model's vocab, cached (either way recorded in "
                                       "--out/tokenizer/ for `flexmesh export`)")
    p.add_argument("--weights", help="Hugging Face safetensors file or *.safetensors.index.json to start from")
    p.add_argument("--nproc", type=positive_int, help="launch torchrun with this many processes on this node")
    p.add_argument("--policy", choices=POLICY_NAMES,
                   help="per-step scheduling policy (default: fixed for a plan of one replica group; for several, "
                        "the one the simulator recommends on the run's first batches, else shares -- each group its "
                        "planned share; the run says which and why)")
    p.add_argument("--adaptive", action="store_true",
                   help="never wait for a late schedule: run --fallback-policy's for that step instead")
    p.add_argument("--fallback-policy", default="hdp", choices=POLICY_NAMES,
                   help="policy of a step whose --policy schedule is late, with --adaptive (default: hdp)")
    p.add_argument("--cp", type=positive_int, help="static context-parallel group size for fixed and balanced; "
                                                   "without --plan also the largest cp the plan may use "
                                          "(default: the plan's cp when above 1, else the smallest that fits)")
    p.add_argument("--hardware-profile", metavar="PATH",
                   help="price schedules with this `flexmesh profile hardware` file "
                        "(default: the plan's cluster preset)")
    p.add_argument("--model-profile", metavar="PATH", help="price schedules with this `flexmesh profile model` file")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--global-batch", type=sequences, help="documents per step (default: the plan's global_batch)")
    size.add_argument("--tokens-per-step", type=tokens, metavar="TOKENS",
                      help="a step's batch in tokens, as torchtitan and Megatron-LM count it: whole documents (each "
                           "up to --seq-len) until that many tokens, so documents per step vary and tokens do not")
    p.add_argument("--seq-len", type=seq_len,
                   help="the longest sequence, in tokens; longer documents are truncated to it (default: the plan's)")
    old_names(p, "--max-len", dest="seq_len", type=seq_len)
    p.add_argument("--lr", type=learning_rate, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--warmup", type=nonneg_int, default=0, help="linear warmup steps (default 0)")
    p.add_argument("--min-lr-ratio", type=fraction, default=0.1,
                   help="cosine floor as a fraction of --lr (default 0.1)")
    p.add_argument("--weight-decay", type=nonneg_float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="max gradient norm; 0 disables (default 1.0)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the initial weights and the data order")
    p.add_argument("--dtype", default=None, choices=TRAIN_DTYPES,
                   help="compute dtype: bf16 computes in bfloat16 with fp32 master weights, optimizer states, "
                        "gradient reductions and loss (default: bf16 on GPUs, as torchtitan trains, fp32 on the "
                        "CPU; docs/precision.md)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where each rank computes: auto takes one GPU per process when there are enough, else the "
                        "CPU (default auto; docs/cli-train.md#devices)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each transformer block (default: on for GPUs, off on CPU)")
    p.add_argument("--checkpoint-every", type=nonneg_int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write the --checkpoint-every checkpoints in the background while training goes on "
                        "(DCP's async_save: the state is copied to host memory first); the last one is written "
                        "before the run ends")
    p.add_argument("--no-resume", action="store_true",
                   help="start over instead of resuming; refused when --out holds a run, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: move its contents into --out/previous-<time>/")
    p.add_argument("--new-tokenizer", action="store_true",
                   help="resume under another tokenizer than the run recorded (refused without it: the "
                        "checkpoints so far were trained under the recorded one)")
    p.add_argument("--new-corpus", action="store_true",
                   help="resume under another corpus than the run recorded in --out/corpus.json (refused "
                        "without it: the steps so far and the data position were drawn from the recorded one)")
    p.add_argument("--end-of-text", action=argparse.BooleanOptionalAction, default=None,
                   help="put the tokenizer's end-of-text token (its eos, the one an export names) after each "
                        "document, as torchtitan and Megatron-LM do, so the model learns where a text ends and "
                        "generation stops (default on, and on a resume as --out/corpus.json records the run was "
                        "fed)")
    p.add_argument("--collective-timeout", type=seconds, default=600.0, metavar="SECONDS",
                   help="how long a collective waits for a stopped, hung or dead rank before the run fails "
                        "naming it (default 600; start-up, joining and building the model, waits at least 300)")
    p.add_argument("--cache-dir", help="where tokenizers and token stores are cached")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    v = p.add_argument_group("evaluation and logging (docs/cli-train.md#evaluation-and-logging)")
    v.add_argument("--eval-corpus", metavar="CORPUS",
                   help="held-out documents (a folder, a .jsonl file or 'stdlib'), tokenized with the run's tokenizer: "
                        "their mean loss and perplexity every --eval-every steps and at the last step")
    v.add_argument("--eval-every", type=positive_int, default=100, metavar="N",
                   help="steps between held-out evaluations, with --eval-corpus (default 100)")
    v.add_argument("--eval-docs", type=positive_int, default=64, metavar="K",
                   help="the held-out set: the first K documents of --eval-corpus, each up to --seq-len (default 64)")
    v.add_argument("--tensorboard", nargs="?", const="", metavar="DIR",
                   help="write loss, lr, grad_norm, tokens_per_s and eval_loss as TensorBoard scalars to DIR "
                        "(default OUT/tensorboard); needs `pip install tensorboard`")
    s = p.add_argument_group("stragglers (docs/cli-train.md#stragglers)")
    s.add_argument("--no-replan", action="store_true",
                   help="measure each rank's speed and report stragglers, but keep the schedules as they are")
    s.add_argument("--straggler-threshold", type=positive_float, default=0.25, metavar="FRACTION",
                   help="a rank deviates when its measured speed differs from its schedule's by more than this, "
                        "in (0, 1) (default 0.25)")
    s.add_argument("--straggler-steps", type=positive_int, default=2, metavar="K",
                   help="consecutive deviating steps before a speed change counts (default 2)")
    s.add_argument("--migrate", action="store_true",
                   help="after a sustained slowdown, move to a new layout when the planner predicts it pays for "
                        "its migration (checkpoint, relaunch, DCP reshard); needs --nproc on one node")
    add_slow_arg(s, "emulate_speed", "--emulate-speed")
    add_expert_args(p, train=True)
    e = p.add_argument_group("restarts and several nodes (with --nproc; docs/failures.md)")
    e.add_argument("--max-restarts", type=int, metavar="K",
                   help="restart the worker group up to K times after a worker fails; it resumes from the last "
                        "checkpoint (default 0)")
    e.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes of the run, one launcher each (default 1)")
    e.add_argument("--node-rank", type=int, metavar="R", help="this launcher's node: 0 holds --out, 1.. the others")
    e.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the launchers meet (c10d), the same on "
                                                                 "every node")
    e.add_argument("--rdzv-wait", type=seconds, metavar="SECONDS",
                   help="on a node whose --rdzv-endpoint is another host's: how long to wait for it to answer before "
                        f"saying what to check (default {RDZV_WAIT_S:g})")
    e.add_argument("--rdzv-id", metavar="ID",
                   help=f"the run's name at the endpoint, the same on every node (default {DEFAULT_RUN_ID!r} with "
                        "several nodes)")


def run_dtype(args: argparse.Namespace) -> str:
    """The compute dtype of the run: ``--dtype``, else bf16 where this rank computes on a GPU (fp32 master
    weights and reductions, as torchtitan) and fp32 on the CPU, by the device rule of
    flexmesh.runtime.parallel.device."""
    if args.dtype is not None:
        return args.dtype
    import os

    from flexmesh.runtime.parallel.device import choose_device, visible_gpus

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc or 1))
    choice = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")), local_world, visible_gpus())
    return "bf16" if choice.type == "cuda" else "fp32"
