"""LoRA adapters in PEFT's folder format, out (``flexmesh export``) and in (a task's ``init``).

One folder per task, as ``PeftModel.save_pretrained`` writes it and ``PeftModel.from_pretrained``
loads it on the Hugging Face base model::

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, lora_dropout, use_rslora
    adapter_model.safetensors    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight [r, in]
                                 base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight [out, r]

flexmesh keeps task slot ``i``'s tensors as ``layers.3.attention.adapters.wq.lora_A.<i>`` (same shapes,
flexmesh.runtime.model.lora); the key maps through the base projection's Hugging Face name
(flexmesh.runtime.state.weights.hf_name). Each file is written atomically, ``adapter_config.json`` last, so
a folder with a config is a whole adapter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch
from torch import nn

from flexmesh.errors import CheckpointError
from flexmesh.files import make_folder, plain_name, write_atomic, write_atomic_with
from flexmesh.inputs import load_json
from flexmesh.runtime.model.lora import adapter_slot
from flexmesh.runtime.model.params import canonical_name, copy_full_, is_adapter
from flexmesh.runtime.state.weights import hf_name
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import Task, TaskSet

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_key(name: str) -> str:
    """PEFT's key of flexmesh adapter tensor ``name`` (its slot dropped).

    >>> peft_key("layers.3.attention.adapters.wq.lora_A.2")
    'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight'
    """
    place, _ = canonical_name(name).rsplit(".", 1)
    owner, _, rest = place.partition(".adapters.")
    proj, which = rest.split(".")
    base = hf_name(f"{owner}.{proj}.weight").removesuffix(".weight")
    return f"{PREFIX}{base}.{which}.weight"


def peft_config(task: Task, base: str) -> dict:
    """``adapter_config.json`` of ``task`` on base model ``base`` (its name or path)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": task.rank,
            "lora_alpha": task.alpha, "target_modules": list(task.targets), "lora_dropout": task.dropout,
            "use_rslora": task.rslora, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}}


def write_adapters(out: Path, tasks: TaskSet, tensors: Mapping[str, torch.Tensor], base: str) -> list[Path]:
    """One PEFT folder per task under ``out/adapters/<name>/`` from ``tensors`` (flexmesh name -> full
    tensor, every slot's); returns the folders."""
    from safetensors.torch import save_file

    folders = []
    for slot, task in enumerate(tasks):
        named = {peft_key(n): t.contiguous() for n, t in tensors.items() if is_adapter(n) and adapter_slot(n) == slot}
        if not named:
            raise CheckpointError(f"the checkpoint holds no adapter of task {task.name!r}; it is not this run's")
        folder = make_folder(out / "adapters" / plain_name(task.name, "task name", CheckpointError), root=out)
        (folder / CONFIG).unlink(missing_ok=True)  # until the new adapter is whole, the folder loads nowhere
        write_atomic_with(folder / WEIGHTS, partial(save_file, named, metadata={"format": "pt"}))
        write_atomic(folder / CONFIG, json.dumps(peft_config(task, base), indent=2) + "\n")
        folders.append(folder)
    return folders


def read_adapter(folder: str | Path, task: Task, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors of PEFT adapter ``folder`` for ``task`` on ``spec``, by PEFT key, after checking that
    it is a LoRA adapter of the task's rank and targets whose tensors fit the model."""
    from safetensors import safe_open

    from flexmesh.spec.tasks import projection_shape

    folder = Path(folder)
    where = f"task {task.name!r}: PEFT adapter {folder}"
    config = load_json(folder / CONFIG, CheckpointError, missing=f"{where} has no {CONFIG}; give a folder "
                       "PeftModel.save_pretrained wrote", invalid="not a PEFT adapter config")
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    targets = config.get("target_modules")
    targets = sorted([targets] if isinstance(targets, str) else targets or [])
    if config.get("r") != task.rank or targets != sorted(task.targets):
        raise CheckpointError(f"{where} has rank {config.get('r')} on {targets}; the job file says rank {task.rank} on "
                              f"{sorted(task.targets)}: make them agree")
    file = folder / WEIGHTS
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors' own error types
        raise CheckpointError(f"{where}: {WEIGHTS} cannot be read ({e})") from None
    tensors = {k.replace(".default.", "."): v for k, v in tensors.items()}  # keys saved with the adapter name
    want = {}
    for layer in range(spec.num_layers):
        for target in task.targets:
            fan_in, fan_out = projection_shape(spec, target)
            owner = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            base = f"{PREFIX}model.layers.{layer}.{owner}.{target}"
            want[f"{base}.lora_A.weight"] = (task.rank, fan_in)
            want[f"{base}.lora_B.weight"] = (fan_out, task.rank)
    missing = [k for k in want if k not in tensors]
    extra = sorted(k for k in tensors if k not in want)
    wrong = [k for k in want if k in tensors and tuple(tensors[k].shape) != want[k]]
    if missing or extra or wrong:
        what = (f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model has no place for" if extra
                else f"has {wrong[0]} of shape {tuple(tensors[wrong[0]].shape)}, not {want[wrong[0]]}")
        raise CheckpointError(f"{where} {what}: it was trained on another base model than {spec.name!r}")
    return tensors


@torch.no_grad()
def load_adapter_inits(model: nn.Module, tasks: TaskSet, spec: ModelSpec) -> None:
    """Fill the adapters of every task with an ``init`` folder from it (any shard layout)."""
    read = {slot: read_adapter(t.init, t, spec) for slot, t in enumerate(tasks) if t.init}
    for name, param in model.named_parameters():
        if is_adapter(name) and adapter_slot(canonical_name(name)) in read:
            copy_full_(param, read[adapter_slot(canonical_name(name))][peft_key(name)].float())
