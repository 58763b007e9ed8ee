"""Training checkpoints -> Hugging Face folders (``flexmesh export``), in one process, no process group.

A DCP checkpoint of any layout (plain, FSDP2/ZeRO shards, tensor-parallel shards, pipeline stages,
interleaved chunks) describes every tensor by its global shape in ``.metadata``; DCP's loader
reassembles the full tensor from whatever pieces the ranks wrote when handed an empty tensor of
that shape (``no_dist=True``: this process plays every rank). Only the model's tensors are read,
never the optimizer's, and only one output shard's worth at a time, so memory stays about one
shard whatever the model's size.

Keys: the trainer saves ``{"model": state_dict, "optim": ...}``, so DCP keys are ``model.<fqn>``;
with an interleaved pipeline the state module is a list of chunks and the fqn starts with the
chunk index (``model.1.layers.3...``); the chunk index says nothing the layer index does not.
Every fqn maps through :func:`flexmesh.runtime.state.weights.hf_name` to its Hugging Face name.

The folder written (``out/``)::

    model-00001-of-0000N.safetensors ...    shards of at most ``max_shard_bytes`` (one larger tensor alone)
    model.safetensors.index.json           metadata.total_size and weight_map, as transformers writes
    tokenizer.json, tokenizer_config.json  the tokenizer the run recorded (flexmesh.data.hf_tokenizer)
    generation_config.json                 its bos/eos/pad token ids, also written into config.json
    config.json                            flexmesh.spec.hf.to_hf_config of the model; written last

A mixture of experts is written with its experts in the layout of the weights the run started from
(fused or one key per expert, flexmesh.runtime.state.expert_weights; fused for a run trained from scratch),
or the one asked for. The routing biases of aux-loss-free balancing pick experts in training only and
have no Hugging Face name: they are left out.

Each file is written whole into a staging folder (:data:`STAGING`, inside ``out``) and, once every one is, moved
into place, the earlier export's other files removed and ``config.json`` written last: a failure while writing (a
full disk) leaves an earlier export as it was; a folder with a config.json is a finished export; one interrupted
while its files are moved in has none and loads nowhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from flexmesh.data.hf_tokenizer import (
    RUN_TOKENIZER,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    read_hf_tokenizer,
    special_token_ids,
    tokenizer_file,
    write_hf_tokenizer,
)
from flexmesh.errors import CheckpointError, DataError, OutputError, SpecError
from flexmesh.files import check_file_target, make_folder, write_atomic, write_atomic_with
from flexmesh.inputs import load_json
from flexmesh.layout.plan import load_plan
from flexmesh.layout.plan_model import plan_model
from flexmesh.runtime.model.params import canonical_name, is_adapter
from flexmesh.runtime.state.checkpoint import (
    MANIFEST,
    STEP_DIR,
    latest_checkpoint,
    manifest_step,
    manifest_tasks,
    plan_hash,
    read_metadata,
    verify_checkpoint,
)
from flexmesh.runtime.state.checkpoint_io import bytes_loading_planner, guarded_reader
from flexmesh.runtime.state.expert_weights import FUSED, LAYOUTS, in_layout
from flexmesh.runtime.state.peft import write_adapters
from flexmesh.runtime.state.weights import hf_name
from flexmesh.spec.hf import hf_family, to_hf_config
from flexmesh.spec.model import ModelSpec, parse_model
from flexmesh.units import GIB

DEFAULT_MAX_SHARD_BYTES = 2 * GIB
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
_ASIDE = (TOKENIZER_JSON, TOKENIZER_CONFIG, GENERATION_CONFIG)  # written beside the weights when there is a tokenizer
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_CHUNK = re.compile(r"\d+\.")  # an interleaved pipeline's chunk index in front of the fqn
_PASS = "pass --checkpoint RUN/checkpoints/step_NNNNNN (or the run folder RUN for its latest checkpoint)"


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_checkpoint` wrote."""

    checkpoint: Path
    step: int
    out: Path
    family: str
    dtype: str
    files: tuple[str, ...]  # the shards, in order
    tensors: int
    total_bytes: int
    tokenizer: Path | None = None  # the tokenizer.json written beside the model, None when none was
    warnings: tuple[str, ...] = ()
    adapters: tuple[Path, ...] = ()  # the PEFT folders of a run's LoRA tasks (flexmesh.runtime.state.peft)
    expert_layout: str | None = None  # how a mixture of experts' experts were written; None: no experts

    def summary(self) -> str:
        """One line for the command to print."""
        return (f"exported step {self.step} of {self.checkpoint} to {self.out}: {self.family} model, "
                f"{self.tensors} tensors, {self.total_bytes / GIB:.3f} GiB {self.dtype} in {len(self.files)} "
                f"shard{'s' if len(self.files) != 1 else ''}"
                + (f", experts {self.expert_layout}" if self.expert_layout else "")
                + (f", tokenizer from {self.tokenizer}" if self.tokenizer is not None else ", no tokenizer")
                + (f"; {len(self.adapters)} PEFT adapter{'s' if len(self.adapters) != 1 else ''} in "
                   f"{self.out / 'adapters'}" if self.adapters else ""))


def find_checkpoint(path: str | Path) -> Path:
    """The finished checkpoint folder ``path`` names: a ``step_NNNNNN`` folder, or a run folder (or its
    ``checkpoints/``), meaning its latest checkpoint. CheckpointError, saying what to pass, otherwise."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a run or checkpoint folder; {_PASS}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; {_PASS}")
    if (path / MANIFEST).is_file():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir() and ((root / "latest").is_file() or any(root.glob("step_*"))):
            found = latest_checkpoint(root)
            if found is not None:
                return found
    if STEP_DIR.fullmatch(path.name) or path.name.startswith(".tmp-step_"):
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is unfinished (a crash while saving?) or not "
                              f"a flexmesh checkpoint; export an earlier one: {_PASS}")
    raise CheckpointError(f"{path} holds no finished flexmesh checkpoint (no {MANIFEST}); {_PASS}")


def _apart(out: Path, path: Path) -> None:
    """Refuse an export folder that is the run's own folder, or inside its checkpoints (files a checkpoint's
    manifest does not list); a folder inside the run beside them (``RUN/hf``) is fine."""
    out, ckpt = out.resolve(), path.resolve()
    checkpoints = ckpt.parent if STEP_DIR.fullmatch(ckpt.name) else ckpt
    run = checkpoints.parent if checkpoints.name == "checkpoints" else None
    if out == run or out == checkpoints or checkpoints in out.parents:
        raise CheckpointError(f"--out {out} is the run's folder or inside its checkpoints; export to another folder "
                              f"(e.g. {(run or checkpoints.parent) / 'hf'})")


def _manifest(path: Path) -> dict:
    try:
        manifest = load_json(path / MANIFEST, CheckpointError)
        manifest_step(manifest)
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        why = str(e).removeprefix(f"{path / MANIFEST}: ")
        raise CheckpointError(f"{path / MANIFEST} is corrupt ({why}); export an earlier checkpoint") from None
    files = manifest.get("sha256")
    names = sorted(files) if isinstance(files, dict) else []
    missing = [n for n in names if (n == ".metadata" or n.endswith(".distcp")) and not (path / n).is_file()]
    if not (path / ".metadata").is_file() and ".metadata" not in missing:
        missing.insert(0, ".metadata")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing[:3])}: it is incomplete or was copied "
                              "in part; copy the whole folder or export an earlier checkpoint")
    return manifest


def checkpoint_spec(checkpoint: str | Path, model: str | None = None, plan: str | Path | None = None) -> ModelSpec:
    """The model of ``checkpoint``: ``model`` (a preset or config.json) if given, else the model the
    plan ``plan`` names (whose layout must be the checkpoint's), else the one the manifest records."""
    path = find_checkpoint(checkpoint)
    manifest = _manifest(path)
    if plan is not None:
        loaded = load_plan(plan)  # any plan: one layout or several replica groups
        if manifest.get("plan_hash") not in (None, plan_hash(loaded)):
            raise CheckpointError(f"checkpoint {path} was written under plan {manifest.get('plan_layout')!r}, not "
                                  f"{loaded.layout!r} ({plan}); pass the plan the run used, or --model")
        return plan_model(loaded, model, str(plan))  # its recorded config.json when it has one
    if model is not None:
        return parse_model(model)
    if isinstance(manifest.get("model"), dict):  # manifests that record the model spec
        return ModelSpec.from_dict(manifest["model"])
    raise SpecError(f"checkpoint {path} does not record its model; pass --model PRESET|config.json or --plan "
                    "PLAN.json (the ones `flexmesh train` was given)")


def _model_keys(path: Path) -> dict[str, tuple[str, Any]]:
    """flexmesh fqn -> (DCP key, tensor metadata) of every model tensor of checkpoint ``path``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = verify_checkpoint(path, _manifest(path))  # hashes, and the metadata read without running code
    out: dict[str, tuple[str, Any]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
            continue
        fqn = canonical_name(key[len("model."):])
        if _CHUNK.match(fqn):
            fqn = fqn.split(".", 1)[1]
        if fqn.endswith((".rotary_emb.inv_freq", ".balance_bias", ".routed_share")):  # recomputed; training-only
            continue
        if fqn in out:
            raise CheckpointError(f"checkpoint {path} holds {fqn} twice ({out[fqn][0]} and {key}); it is not a "
                                  "flexmesh training checkpoint")
        out[fqn] = (key, meta)
    if not out:
        raise CheckpointError(f"checkpoint {path} holds no model tensors (no 'model.*' keys); it is not a flexmesh "
                              "training checkpoint")
    return out


def _check_against(spec: ModelSpec, found: dict[str, tuple[str, Any]], path: Path) -> list[str]:
    """The model's parameter names in model order, after checking the checkpoint holds exactly them."""
    from flexmesh.runtime.model.transformer import Transformer

    with torch.device("meta"):  # names and shapes only
        whole = Transformer(spec)
    shapes = {name: tuple(p.shape) for name, p in whole.named_parameters()}
    missing = [n for n in shapes if n not in found]
    extra = sorted(n for n in found if n not in shapes)
    wrong = [n for n in shapes if n in found and tuple(found[n][1].size) != shapes[n]]
    if missing or extra or wrong:
        what = (f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model has no place for"
                if extra else f"has {wrong[0]} of shape {tuple(found[wrong[0]][1].size)}, not {shapes[wrong[0]]}")
        raise CheckpointError(f"checkpoint {path} {what}: it is not of model {spec.name!r}; pass the --model or "
                              "--plan the run trained with")
    return list(shapes)


def read_full_tensors(path: str | Path, keys: dict[str, tuple[str, Any]],
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of checkpoint ``path``: ``{name: (DCP key, metadata)}`` -> ``{name: tensor}``
    (its metadata read through the allow-list, once per call; DCP never unpickles it)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in keys.values()}
    try:
        metadata = read_metadata(path)
        with warnings.catch_warnings():  # "no process group: loading locally" is what is meant here
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=guarded_reader(path, metadata, CheckpointError),
                     planner=bytes_loading_planner(), no_dist=True)
    except CheckpointError:
        raise
    except BaseException as e:  # DCP wraps read errors in CheckpointException, a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = f"{type(e).__name__}: {lines[-1][:300]}" if lines else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be read ({cause}); it is corrupt: export an earlier "
                              "checkpoint") from e
    return {name: state[key] if dtype is None else state[key].to(dtype) for name, (key, _) in keys.items()}


def _plan_shards(names: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive names in groups of at most ``limit`` bytes (a larger tensor makes a group alone).

    >>> _plan_shards(["a", "b", "c", "d"], {"a": 4, "b": 4, "c": 9, "d": 1}, 8)
    [['a', 'b'], ['c'], ['d']]
    """
    shards: list[list[str]] = []
    size = 0
    for n in names:
        if not shards or size + nbytes[n] > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    return shards


# What an export wrote in its folder: {"files": {name: [size, mtime_ns] or null while being written}}.
# ``--overwrite`` replaces or removes only files listed there as they were left, never a file flexmesh
# did not write (a downloaded model's weights in the folder named as --out).
EXPORT_RECORD = ".flexmesh-export.json"
# Where an export writes its files whole before they replace an earlier export's (removed once they have)
STAGING = ".flexmesh-export-staging"


def _stamp(p: Path) -> list[int]:
    st = os.lstat(p)
    return [st.st_size, st.st_mtime_ns]


def _check_ours(out: Path, previous: list[Path]) -> dict[str, list[int] | None]:
    """The record of the export in ``out`` once every file of ``previous`` is one it wrote, unchanged
    since; else a CheckpointError naming a file it did not write, and nothing is touched."""
    record = out / EXPORT_RECORD
    raw = load_json(record, CheckpointError) if os.path.lexists(record) else {}
    files = raw.get("files") if isinstance(raw, dict) else None
    files = files if isinstance(files, dict) else {}
    foreign = [p.name for p in previous if p.name not in files or files[p.name] not in (None, _stamp(p))]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise CheckpointError(f"{out} holds {foreign[0]}{more}, which no flexmesh export left there (a downloaded "
                              "model?); --overwrite replaces only an earlier export's files, so nothing was touched: "
                              "choose another --out")
    return files


def _record(out: Path, files: dict[str, list[int] | None]) -> None:
    write_atomic(out / EXPORT_RECORD, json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")


def _previous_export(out: Path) -> list[Path]:
    """Files of an earlier export in ``out`` (which a new one replaces or, with other shard names, removes)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_file() and not p.is_symlink() and (
        p.name in ("config.json", INDEX, "model.safetensors", *_ASIDE) or _SHARD.fullmatch(p.name)))


def run_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer folder ``flexmesh train`` recorded in the run of ``checkpoint``
    (``RUN/checkpoints/step_N`` -> ``RUN/tokenizer``), None when there is none."""
    if checkpoint.parent.name != "checkpoints":
        return None
    folder = checkpoint.parent.parent / RUN_TOKENIZER
    return folder if (folder / TOKENIZER_JSON).is_file() else None


@dataclass(frozen=True)
class _Tokenizer:
    """What an export writes of a tokenizer: ``file``'s ``text``, the ``config`` beside it and the special
    token ids for config.json and generation_config.json."""

    file: Path
    text: str
    config: dict
    ids: dict


def _tokenizer(path: Path, tokenizer: str | Path | None, spec: ModelSpec) -> _Tokenizer | str:
    """The tokenizer to export with checkpoint ``path``: ``tokenizer`` if given, else the one its run
    recorded; a warning saying what to pass when there is none."""
    if tokenizer is None:
        found = run_tokenizer(path)
        if found is None:
            return (f"the run of {path} records no tokenizer (`flexmesh train` records it in "
                    f"RUN/{RUN_TOKENIZER}/; this run predates that, or was copied without it): the export has none "
                    "and cannot encode text; pass --tokenizer with the run's tokenizer.json (its --tokenizer, or "
                    "the BPE it trained, cached as tokenizers/bpe-*.json under --cache-dir)")
        tokenizer = found
    tok, text, config = read_hf_tokenizer(tokenizer, spec.max_position)
    if tok.get_vocab_size() > spec.vocab:
        raise DataError(f"tokenizer {tokenizer_file(tokenizer)} has {tok.get_vocab_size()} tokens but model "
                        f"{spec.name!r} only {spec.vocab}: it is not the run's; pass the --tokenizer it trained with")
    return _Tokenizer(tokenizer_file(tokenizer), text, config, special_token_ids(tok, config))


def _why(e: Exception) -> str:
    """What a failed write met, in words: a full disk, a quota, a name too long, or the error's own line."""
    code = e.errno if isinstance(e, OSError) else None
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.ENAMETOOLONG: "a name is longer than the file system allows"}.get(
        code or 0, (e.strerror if isinstance(e, OSError) else None) or str(e).replace("\n", " "))


def _write_shards(folder: Path, path: Path, found: dict[str, tuple[str, Any]], groups: list[list[str]],
                  files: list[str], dtype: torch.dtype, layout: str | None, family: str, total: int) -> None:
    """Checkpoint ``path``'s tensors as safetensors shards (``groups[i]`` into ``files[i]``) and their index, in
    ``folder``: each file written whole (:func:`write_atomic_with`)."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    for group, file in zip(groups, files, strict=True):
        tensors = read_full_tensors(path, {n: found[n] for n in group}, dtype)
        named = {}
        for n, t in tensors.items():  # experts one key each: copies, as safetensors refuses shared storage
            parts = in_layout(hf_name(n), t.contiguous(), layout, family) if layout else {hf_name(n): t.contiguous()}
            named.update({k: v.clone() if len(parts) > 1 else v for k, v in parts.items()})
        write_atomic_with(folder / file, partial(save_file, named, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(named, file))
        del tensors, named
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(folder / INDEX, json.dumps(index, indent=2) + "\n")


def _clear_staging(staging: Path) -> None:
    """Remove an export's staging folder (:data:`STAGING`: its own name, holding only what it wrote there); a
    link or a file of that name is left alone (make_folder then refuses it)."""
    import shutil

    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging)


def _remove_partial(out: Path, files: list[str], tasks: Any, made: bool, previous: bool) -> None:
    """Remove what a failed export wrote in ``out`` (its shards, index, config, tokenizer and adapter
    folders: names it recorded, so never a file of someone else's), and ``out`` itself when it made it;
    the record stays while an earlier export's files may remain (a later --overwrite still knows them)."""
    import shutil

    for name in [*files, INDEX, "config.json", *_ASIDE, *([] if previous else [EXPORT_RECORD])]:
        if (out / name).is_file() and not (out / name).is_symlink():
            (out / name).unlink()
    for task in tasks.names if tasks is not None else ():
        folder = out / "adapters" / task  # plain names (flexmesh.runtime.state.peft checked them)
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
    for folder in ([out / "adapters"] if not previous else []) + ([out] if made else []):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            pass


def export_checkpoint(checkpoint: str | Path, out: str | Path, spec: ModelSpec, *, dtype: str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                      tokenizer: str | Path | None = None, expert_layout: str | None = None) -> ExportReport:
    """Write checkpoint ``checkpoint`` of model ``spec`` as a Hugging Face folder ``out`` (see the module doc).

    ``dtype`` (fp32, bf16, fp16) converts the weights; None keeps the checkpoint's (fp32 master
    weights). ``config.json`` names the dtype written. ``out`` holding an earlier export is refused
    unless ``overwrite``; then its files are replaced and files the new export does not write removed.
    ``tokenizer`` (a tokenizer.json or a folder holding one) is written beside the model; None: the
    one the run recorded, and when it recorded none the report warns that the export has no tokenizer.
    ``expert_layout`` (fused, per-expert): how a mixture of experts' experts are written; None: as the
    weights the run started from were (its manifest says), else fused.
    A failure while writing (a full disk) removes what this export wrote and is one OutputError.
    """
    from safetensors import SafetensorError

    if dtype is not None and dtype not in DTYPES:
        raise SpecError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise SpecError(f"the maximum shard size must be positive, got {max_shard_bytes} bytes")
    family = hf_family(spec)  # refuse a model transformers cannot build before reading anything
    out = make_folder(out, create=False)  # a symlink or a file there: refused before reading anything
    for name in ("config.json", INDEX):  # replaced or removed below: only a regular file is
        check_file_target(out / name)
    path = find_checkpoint(checkpoint)
    _apart(out, path)
    manifest = _manifest(path)
    layout = (expert_layout or manifest.get("expert_layout") or FUSED) if spec.is_moe else None
    if layout is not None and layout not in LAYOUTS:
        raise CheckpointError(f"checkpoint {path} records expert layout {layout!r}; pass --expert-layout "
                              f"{' or '.join(LAYOUTS)}")
    previous = _previous_export(out)
    if previous and not overwrite:
        raise CheckpointError(f"{out} already holds an export ({previous[0].name}); choose another --out or add "
                              "--overwrite")
    ours = _check_ours(out, previous) if previous else {}
    found = _model_keys(path)
    adapters = {n: found.pop(n) for n in [n for n in found if is_adapter(n)]}
    tasks = manifest_tasks(manifest, path)
    if adapters and tasks is None:
        raise CheckpointError(f"checkpoint {path} holds adapters but its manifest names no tasks; it is damaged")
    names = _check_against(spec, found, path)
    tok = _tokenizer(path, tokenizer, spec)  # a wrong one is refused before anything is written
    stored = {found[n][1].properties.dtype for n in names}
    target = DTYPES[dtype] if dtype is not None else None
    if target is None and len(stored) > 1:
        raise CheckpointError(f"checkpoint {path} holds tensors of several dtypes ({sorted(map(str, stored))}); "
                              "pass --dtype")
    written = target or stored.pop()
    if written not in _NAMES:
        raise CheckpointError(f"checkpoint {path} holds {written} weights; pass --dtype fp32, bf16 or fp16")
    nbytes = {n: found[n][1].size.numel() * written.itemsize for n in names}
    groups = _plan_shards(names, nbytes, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    made = not out.exists()
    make_folder(out)
    staging = out / STAGING
    swapping = False
    try:
        _clear_staging(staging)  # an interrupted export's
        make_folder(staging)
        # Written whole into the staging folder first: until every file is, the earlier export stays as it was.
        _write_shards(staging, path, {n: found[n] for group in groups for n in group}, groups, files, written,
                      layout, family, sum(nbytes.values()))
        total = sum(nbytes.values())
        config = to_hf_config(replace(spec, dtype=_NAMES[written]))
        if isinstance(tok, _Tokenizer):
            write_hf_tokenizer(staging, tok.text, tok.config)
            write_atomic(staging / GENERATION_CONFIG, json.dumps(tok.ids, indent=2) + "\n")
            config.update(tok.ids)  # else transformers' defaults (Llama: bos 1, eos 2) would stop generation on a byte
        # The swap: every file it may write recorded before it is there (an interrupted swap is still ours); the
        # folder loads nowhere until config.json, written last, names the new export.
        _record(out, {**ours, **dict.fromkeys([*files, INDEX, "config.json", *_ASIDE])})
        swapping = True
        (out / "config.json").unlink(missing_ok=True)
        keep = {*files, INDEX, "config.json", *(_ASIDE if isinstance(tok, _Tokenizer) else ())}
        for name in sorted(keep - {"config.json"}):
            os.replace(staging / name, out / name)
        for old in previous:  # files of the earlier export; model.safetensors would shadow the index
            if old.name not in keep:
                old.unlink(missing_ok=True)
        write_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
        staging.rmdir()
        _record(out, {p.name: _stamp(p) for p in _previous_export(out)})
        folders = (write_adapters(out, tasks, read_full_tensors(path, adapters), str(Path(out).resolve())) if tasks
                   else [])
    except (OSError, SafetensorError) as e:  # a full disk, a quota, a name too long: nothing half-written stays
        _clear_staging(staging)
        if swapping or not previous:
            _remove_partial(out, files, tasks, made, bool(previous))
        kept = "" if not previous else ("; the earlier export there is kept as it was" if not swapping else
                                        "; the earlier export there is gone too (it failed while replacing it)")
        raise OutputError(f"cannot write the export to {out}: {_why(e)}; the files this export wrote are removed"
                          f"{kept}: free space there or choose another --out, then export again") from None
    return ExportReport(adapters=tuple(folders), expert_layout=layout, checkpoint=path, step=int(manifest["step"]),
                        out=out, family=family,
                        dtype=_NAMES[written], files=tuple(files), tensors=len(names), total_bytes=total,
                        tokenizer=tok.file if isinstance(tok, _Tokenizer) else None,
                        warnings=() if isinstance(tok, _Tokenizer) else (tok,))
