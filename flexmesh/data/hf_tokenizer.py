"""The tokenizer a run used, as a Hugging Face tokenizer folder: ``tokenizer.json`` + ``tokenizer_config.json``.

``flexmesh train`` records the tokenizer it used in ``<out>/tokenizer/`` (:func:`record_tokenizer`):
the ``--tokenizer`` file byte for byte, or the byte-level BPE it trained; ``flexmesh export`` writes
the same two files beside the model, so ``transformers.AutoTokenizer.from_pretrained`` loads it.

Special tokens follow what training fed the model: flexmesh.data.loader encodes every document with
``add_special_tokens=False`` and puts the eos token after it (:func:`end_of_text_id`, as torchtitan and
Megatron-LM feed documents; ``flexmesh train --no-end-of-text`` leaves it out), so the model learns to
end a text with the token generation stops on. The exported tokenizer adds no token when encoding, so
``tokenizer(text)`` gives the ids training saw before that eos. The flexmesh BPE has no post-processor
and is written byte for byte; a ``--tokenizer`` whose post-processor adds tokens (a Llama's BOS) is
exported without that template (:func:`without_added_tokens`; transformers 5 ignores
``add_bos_token`` when a tokenizer.json is there). ``eos_token`` (where generation stops) and
``pad_token`` are ``<|endoftext|>``, the flexmesh BPE's one special token; a ``--tokenizer`` with a
``tokenizer_config.json`` or ``special_tokens_map.json`` beside it keeps the bos/eos/pad/unk tokens
those name (its eos is then the token after each document).

>>> from tokenizers import Tokenizer, models
>>> tok = Tokenizer(models.BPE())
>>> _ = tok.add_special_tokens([END_OF_TEXT])
>>> cfg = tokenizer_config(tok, {}, max_length=512)
>>> cfg["eos_token"], cfg["pad_token"], cfg["bos_token"]
('<|endoftext|>', '<|endoftext|>', None)
>>> special_token_ids(tok, cfg)
{'bos_token_id': None, 'eos_token_id': 0, 'pad_token_id': 0}
>>> end_of_text_id(tok)
0
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from flexmesh.data.tokenizer import END_OF_TEXT, load_tokenizer, tokenizer_hash
from flexmesh.errors import DataError
from flexmesh.files import write_atomic
from flexmesh.inputs import load_json

RUN_TOKENIZER = "tokenizer"  # the folder of a run (flexmesh train --out) that records its tokenizer
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_ROLES = ("bos", "eos", "pad", "unk")


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file, or the one in the folder ``path``."""
    p = Path(path).expanduser()
    return p / TOKENIZER_JSON if p.is_dir() else p


def _content(value: object) -> str | None:
    """A special token as tokenizer configs write it: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def declared_special_tokens(path: str | Path) -> dict[str, str | None]:
    """``{"bos": ..., "eos": ..., ...}`` as the ``tokenizer_config.json`` (else ``special_tokens_map.json``)
    beside the tokenizer file ``path`` names them (a role it sets to null stays None); {} without one."""
    folder = tokenizer_file(path).parent
    for name in (TOKENIZER_CONFIG, "special_tokens_map.json"):
        f = folder / name
        if not f.is_file():
            continue
        d = load_json(f, DataError, invalid="not valid JSON ({reason}); fix it or move it away from the tokenizer")
        if isinstance(d, dict):
            return {r: _content(d[f"{r}_token"]) for r in _ROLES if f"{r}_token" in d}
    return {}


def tokenizer_config(tok: Tokenizer, declared: dict[str, str | None], max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of ``tok`` (see the module doc): the ``declared`` roles whose token
    is in the vocabulary, else ``<|endoftext|>`` as eos (when it is one) and the eos as pad."""
    def known(t: str | None) -> str | None:
        return t if t is not None and tok.token_to_id(t) is not None else None

    roles = {r: known(declared.get(r)) for r in _ROLES}
    if "eos" not in declared:
        roles["eos"] = known(END_OF_TEXT)
    if "pad" not in declared:
        roles["pad"] = roles["eos"]
    return {"tokenizer_class": "PreTrainedTokenizerFast", **{f"{r}_token": roles[r] for r in _ROLES},
            "model_max_length": max_length, "clean_up_tokenization_spaces": False}


def special_token_ids(tok: Tokenizer, config: dict[str, Any]) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of a :func:`tokenizer_config`, for a model's
    config.json and generation_config.json (null where the tokenizer has no such token)."""
    return {f"{r}_token_id": None if config.get(f"{r}_token") is None else tok.token_to_id(config[f"{r}_token"])
            for r in ("bos", "eos", "pad")}


def end_of_text_id(tok: Tokenizer, source: str | Path | None = None) -> int | None:
    """The id training puts after each document of ``tok`` (``source``: the tokenizer file it was read from,
    None for the flexmesh BPE): the eos token of its :func:`tokenizer_config` (the one a
    ``tokenizer_config.json`` beside ``source`` declares, else ``<|endoftext|>``), so the ``eos_token_id``
    an export writes is the token the model learnt to end a document with. None when it has none."""
    eos = tokenizer_config(tok, declared_special_tokens(source) if source is not None else {}, 0)["eos_token"]
    return None if eos is None else tok.token_to_id(eos)


def without_added_tokens(text: str) -> str:
    """tokenizer.json ``text`` whose post-processor adds no tokens: a template (TemplateProcessing,
    BertProcessing, RobertaProcessing) dropped, ByteLevel's offset trimming kept; ``text`` itself when
    nothing is dropped.

    >>> parts = [{"type": "ByteLevel"}, {"type": "RobertaProcessing"}]
    >>> without_added_tokens(json.dumps({"post_processor": {"type": "Sequence", "processors": parts}}))
    '{"post_processor": {"type": "ByteLevel"}}'
    """
    d = json.loads(text)
    post = d.get("post_processor")
    if not isinstance(post, dict):
        return text
    parts = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    kept = [p for p in parts if isinstance(p, dict) and p.get("type") == "ByteLevel"]
    if len(kept) == len(parts):
        return text
    d["post_processor"] = {**post, "processors": kept} if len(kept) > 1 else kept[0] if kept else None
    return json.dumps(d, ensure_ascii=False)


def read_hf_tokenizer(path: str | Path, max_length: int) -> tuple[Tokenizer, str, dict[str, Any]]:
    """The tokenizer at ``path`` (a tokenizer.json or a folder holding one), the text to export of it
    (:func:`without_added_tokens`: it encodes as training did) and the :func:`tokenizer_config` to write beside it."""
    f = tokenizer_file(path)
    tok = load_tokenizer(f)
    text = without_added_tokens(f.read_text(encoding="utf-8"))
    return tok, text, tokenizer_config(tok, declared_special_tokens(f), max_length)


def write_hf_tokenizer(folder: str | Path, text: str, config: dict[str, Any], root: str | Path | None = None) -> None:
    """Write ``tokenizer.json`` (``text``) and ``tokenizer_config.json`` into ``folder``, each atomically
    (``root``: the folder flexmesh owns that holds ``folder``, every component below it checked)."""
    folder = Path(folder)
    write_atomic(folder / TOKENIZER_JSON, text, root)
    write_atomic(folder / TOKENIZER_CONFIG, json.dumps(config, indent=2) + "\n", root)


def record_tokenizer(out: str | Path, tok: Tokenizer, source: str | Path | None, max_length: int,
                     replace: bool = False) -> tuple[Callable[[], None] | None, str | None]:
    """Check now, write later: the record in run folder ``out`` (``<out>/tokenizer/``) of the tokenizer
    a run trains with, the file ``source`` (``--tokenizer``) as it is, or ``tok`` (the trained BPE)
    when None. When the folder holds another tokenizer (a resume under a different one), a DataError
    unless ``replace`` (``--new-tokenizer``). Returns (the write, None when the record is already
    this tokenizer; a warning to say once it is written, when it replaces another one): the caller
    writes only after every other check of the resume has passed, so a refused resume leaves the
    run's record as it was."""
    folder = Path(out) / RUN_TOKENIZER
    if source is not None:
        text = tokenizer_file(source).read_text(encoding="utf-8")
        config = tokenizer_config(tok, declared_special_tokens(source), max_length)
    else:
        text, config = tok.to_str(pretty=True), tokenizer_config(tok, {}, max_length)
    warning = None
    if (folder / TOKENIZER_JSON).is_file():
        try:
            before = tokenizer_hash(load_tokenizer(folder))
        except DataError:
            before = None
        if before == tokenizer_hash(tok):
            return None, None
        if not replace:
            raise DataError(f"{folder} records another tokenizer than this run's, and the run's checkpoints were "
                            "trained under it; resume with the --tokenizer (or corpus and vocabulary) the run started "
                            "with, or add --new-tokenizer to go on under this one")
        warning = (f"{folder} held another tokenizer than this run's, now replaced: checkpoints written before "
                   "this attempt were trained under the other one (resume with the --tokenizer, or corpus and "
                   "vocabulary, the run started with)")
    return lambda: write_hf_tokenizer(folder, text, config, root=out), warning
