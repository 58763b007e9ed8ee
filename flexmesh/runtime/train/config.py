"""What a training run is told (TrainConfig), its learning-rate schedule, and what each step reports.

Torch-free: the launcher builds a TrainConfig before any process group exists, and the metrics a
step returns are plain numbers (fields and units in docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    checkpoint_every: int = 0  # steps; 0: only at the end when out_dir is set
    # the checkpoint_every ones written by a thread while later steps train; the last one is written before fit returns
    async_checkpoint: bool = False
    out_dir: str | None = None  # metrics.jsonl and checkpoints/ go here
    resume: bool = True  # continue from out_dir/checkpoints when one exists
    progress: bool = True  # live progress line on rank 0
    # compute dtype (docs/precision.md): bf16 computes in bfloat16 with fp32 master weights, optimizer
    # states, gradient reductions and loss; fp32 computes in float32
    dtype: str = "fp32"
    # Emulated slow ranks, for testing on one machine (flexmesh.runtime.train.stragglers): (global rank,
    # factor in (0, 1]) pairs; that rank's micro-batch compute is stretched to 1/factor of its time.
    emulate_speed: tuple[tuple[int, float], ...] = ()
    # The checkpoint folder name (``step_NNNNNN``) a migrated run may resume from under another plan
    # (DCP reshards the state); every other resume needs the checkpoint's own plan (flexmesh.runtime.state.checkpoint).
    reshard_from: str | None = None
    # Speed options; None: chosen for the device (:func:`for_device`).
    compile: bool | None = None  # torch.compile each block (flexmesh.runtime.parallel.parallelize.apply_compile)
    chunked_loss: bool | None = None  # cross-entropy chunk by chunk, no full logits (flexmesh.runtime.model.loss)
    # Steps between measurements of saved activations (the first step is always measured): the meter's
    # Python hook on every saved tensor costs little next to a CPU step, more next to a GPU's.
    meter_every: int | None = None
    # Mixtures of experts (flexmesh.runtime.train.expert_training): the placement policy of the experts over
    # data ranks (flexmesh.schedule.expert_placement.PLACEMENTS), the experts one rank may run per layer
    # (None: its static share plus one), and the rate of aux-loss-free balancing (0: off).
    expert_placement: str = "laer"
    expert_slots: int | None = None
    balance_rate: float = 0.0
    aux_loss: float = 0.0  # the load-balancing loss's coefficient (flexmesh.runtime.model.moe); 0: none
    # The token all-to-all compressed by cross-polytope LSH (dim, hashes) (flexmesh.runtime.parallel.lsh); None: not
    expert_lsh: tuple[int, int] | None = None
    # Loss-based sample reweighting (flexmesh.data.reweighting): the strategy (None: off) and its delta
    reweight: str | None = None
    reweight_delta: float = 1.0
    # TensorBoard event files of rank 0's scalars (flexmesh.runtime.train.scalars); None: none written
    tensorboard_dir: str | None = None


# Activations are measured on the first step and then every this many steps on a GPU (every step on CPU).
METER_EVERY_CUDA = 25


def for_device(config: TrainConfig, device_type: str) -> TrainConfig:
    """``config`` with its automatic speed options chosen for ``device_type``: compiled blocks and the
    chunked loss on CUDA, neither on CPU (where they do not pay: a CPU step is bound by the matmuls,
    and compiling takes tens of seconds); activations metered every step on CPU, every
    :data:`METER_EVERY_CUDA` steps on CUDA.

    >>> c = for_device(TrainConfig(max_steps=1), "cuda")
    >>> c.compile, c.chunked_loss, c.meter_every
    (True, True, 25)
    >>> for_device(TrainConfig(max_steps=1, compile=True), "cpu").compile
    True
    """
    from dataclasses import replace

    cuda = device_type == "cuda"
    return replace(config, compile=cuda if config.compile is None else config.compile,
                   chunked_loss=cuda if config.chunked_loss is None else config.chunked_loss,
                   meter_every=(METER_EVERY_CUDA if cuda else 1) if config.meter_every is None else config.meter_every)


def lr_schedule_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimiser step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` then a half cosine down to ``min_ratio`` at ``max_steps``.

    >>> [round(lr_schedule_factor(s, 2, 6, 0.1), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.868, 0.55, 0.232]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class StepMetrics:
    """What one step did and how long it took (fields and units in docs/metrics.md).

    Lists are indexed by global rank; every rank gets the same lists (gathered once per step).
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # real (unpadded) tokens of the global batch
    label_tokens: int
    padded_tokens: int  # tokens this rank's data group ran, padding included
    microbatches: int
    step_time_s: float  # the slowest rank's wall time, packing to optimiser step
    tokens_per_s: float
    peak_memory_gib: float | None  # this rank's allocator peak (GPU) or resident set (CPU)
    policy: str = ""  # policy of the schedule that ran
    requested_policy: str = ""  # policy asked for; differs from ``policy`` after a fallback
    fallback: bool = False  # the background scheduler was late and the fallback schedule ran
    scheduler_s: float = 0.0  # seconds the schedule that ran took to compute
    predicted_step_time_s: float | None = None  # the schedule's prediction, None when it has none
    predicted_busy_s: tuple[float, ...] = ()  # per rank: its group's predicted time
    busy_s: tuple[float, ...] = ()  # per rank: step start until its own micro-batches were done
    activation_peak_bytes: tuple[int, ...] = ()  # per rank: peak bytes saved for backward; () on unmetered steps
    dtype: str = "fp32"  # compute dtype of the step (TrainConfig.dtype)
    attention_kernel: str = ""  # the local attention kernels this rank has run ("+"-joined; attention_kernels.py)
    microbatch_tokens: int | None = None  # the plan's token budget of one micro-batch on one data rank
    cut_documents: int = 0  # documents of the step cut over micro-batches (StepSchedule.cut_sequences)
    # Speeds and stragglers (flexmesh.runtime.train.stragglers), per rank unless said otherwise:
    compute_s: tuple[float, ...] = ()  # seconds computing its own micro-batches' forwards and backwards
    speed: tuple[float | None, ...] = ()  # measured, relative to the fastest rank (None: no work this step)
    assumed_speed: tuple[float, ...] = ()  # the speed the step's schedule was made for
    emulated_speed: tuple[float, ...] = ()  # --emulate-speed factors (emulation, not measured); () without
    pace: float | None = None  # the fastest rank's speed against the cost model (1.0: as profiled)
    # The simulator's step time with each data rank at its median speed against the cost model over the
    # latest earlier steps (flexmesh.runtime.train.stragglers.PACE_STEPS): the prediction at measured speeds.
    paced_step_time_s: float | None = None
    events: tuple[dict, ...] = ()  # straggler events decided after this step (straggler_detected, replanned, ...)
    # LoRA tasks (docs/adapters.md), by task slot: names, each task's own mean loss and its label tokens
    tasks: tuple[str, ...] = ()
    task_loss: tuple[float, ...] = ()
    task_tokens: tuple[int, ...] = ()
    task_lr: tuple[float, ...] = ()  # the learning rate each task's adapters stepped with (``lr``: the first's)
    # Data mixtures (docs/mixtures.md), by domain slot: names, each domain's mean training loss over its label
    # tokens of the step (None: none drawn), its label tokens, and the weights the next batches draw from
    domains: tuple[str, ...] = ()
    domain_loss: tuple[float | None, ...] = ()
    domain_tokens: tuple[int, ...] = ()
    domain_weight: tuple[float, ...] = ()
    # --reweight (flexmesh.data.reweighting): the step's smallest and largest token weight (() without it)
    doc_weight: tuple[float, ...] = ()
    # Mixtures of experts: the most loaded data rank over the mean, worst MoE layer (None: no experts),
    # and per MoE layer the step's routing, written to routing.jsonl rather than metrics.jsonl
    # (flexmesh.runtime.train.expert_training.ExpertTraining.after_step)
    expert_imbalance: float | None = None
    routing: tuple[dict, ...] = ()
    aux_loss: float | None = None  # the step's load-balancing loss term (not in ``loss``); None: none
    # rows the step's expert all-to-alls carried over the routed pairs (1.0 uncompressed; below with --expert-lsh);
    # None: no experts sharded over ranks
    expert_a2a_ratio: float | None = None
    # Held-out evaluation after this step (flexmesh.runtime.train.evaluate): the mean token cross-entropy
    # of the held-out documents and its exponential; None on steps not evaluated
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_domain_loss: tuple[float, ...] = ()  # with domains' held-out sets: each one's (eval_loss: their mean)

    def to_dict(self) -> dict:
        """The metrics.jsonl row (routing goes to routing.jsonl)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in ((k, getattr(self, k)) for k in self.__dataclass_fields__) if k != "routing"}
