"""The record of the corpus a run trains on, in its folder (``<out>/corpus.json``), so a resume
under another corpus is refused rather than continued on other documents from a loader position
that was counted in the first one's.

A corpus is known by its content: the fingerprint the token cache keys it by
(:meth:`flexmesh.data.corpus.Corpus.fingerprint`, a hash of its file names and bytes), so a moved
or copied corpus is the same one, and one edited in place is not. A run of several tasks records
each task's corpus, in order. The record also names the end-of-text id put after each document
(``end_of_text``, null when none: flexmesh.data.loader; a record from before flexmesh put one has no
such field and reads as null), so a resume that would feed the documents otherwise is refused too.

>>> import tempfile, pathlib
>>> from flexmesh.data.corpus import read_corpus
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> (d / "docs").mkdir(); _ = (d / "docs" / "a.txt").write_text("one")
>>> write, _ = record_corpus(d / "run", [("docs", read_corpus(d / "docs"))])
>>> write()
>>> record_corpus(d / "run", [("docs", read_corpus(d / "docs"))])  # the same corpus: nothing to do
(None, None)
>>> _ = (d / "docs" / "a.txt").write_text("two")
>>> record_corpus(d / "run", [("docs", read_corpus(d / "docs"))])  # doctest: +ELLIPSIS
Traceback (most recent call last):
flexmesh.errors.DataError: .../corpus.json records another corpus (docs, ...) than this run's ...
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flexmesh.data.corpus import Corpus
from flexmesh.errors import DataError
from flexmesh.files import write_atomic
from flexmesh.inputs import load_json

RUN_CORPUS = "corpus.json"  # in a run folder (flexmesh train --out): which corpus its steps were drawn from


def record_corpus(out: str | Path, corpora: Sequence[tuple[str, Corpus]], replace: bool = False,
                  end_of_text: int | None = None) -> tuple[Callable[[], None] | None, str | None]:
    """Check now, write later (as :func:`flexmesh.data.hf_tokenizer.record_tokenizer`): the record of
    ``corpora`` ((name as given, corpus) per task, or the one corpus) in run folder ``out``. When the
    folder records other corpora (a resume under another one), a DataError unless ``replace``
    (``--new-corpus``); the same for a record of another ``end_of_text`` (the id after each document,
    None: none). Returns (the write, None when the record is already these corpora; a
    warning to say once written, when it replaces another record)."""
    path = Path(out) / RUN_CORPUS
    now: list[dict[str, Any]] = [{"name": name, "fingerprint": corpus.fingerprint(), "files": len(corpus.files)}
                                 for name, corpus in corpora]
    warning = None
    if path.is_file() or path.is_symlink():
        before, eot = _recorded(path)
        same = before == [c["fingerprint"] for c in now]
        if same and eot == end_of_text:
            return None, None
        if same and not replace:
            raise DataError(f"{path} records documents {_fed(eot)} but this run feeds them {_fed(end_of_text)}, and "
                            "the run's checkpoints and data position were made on the recorded tokens; resume "
                            f"{_as_before(eot)}, or add --new-corpus to go on with this run's")
        if not replace:
            was = ", ".join(_names(path)) or "unreadable"
            raise DataError(f"{path} records another corpus ({was}, fingerprint {', '.join(before or ['?'])}) than "
                            f"this run's ({', '.join(c['name'] for c in now)}, fingerprint "
                            f"{', '.join(c['fingerprint'] for c in now)}), and the run's checkpoints and data position "
                            "were made on it; resume with the --corpus the run started with, or add --new-corpus to "
                            "go on under this one")
        warning = (f"{path} recorded documents {_fed(eot)}, now {_fed(end_of_text)}: the steps before this "
                   "attempt were fed the other way") if same else (
                   f"{path} recorded another corpus than this run's, now replaced: the steps before this attempt "
                   "were drawn from the other one")
    text = json.dumps({"format": 1, "corpora": now, "end_of_text": end_of_text}, indent=2) + "\n"
    return lambda: write_atomic(path, text, root=out), warning


def recorded_end_of_text(out: str | Path) -> bool | None:
    """Whether run folder ``out``'s corpus record says its documents were fed with an end-of-text token
    after each (False for a record from before flexmesh put one); None without a readable record."""
    path = Path(out) / RUN_CORPUS
    if not path.is_file():
        return None
    before, eot = _recorded(path)
    return None if before is None else eot is not None


def _fed(end_of_text: int | None) -> str:
    return "without an end-of-text token" if end_of_text is None else f"each followed by end-of-text id {end_of_text}"


def _as_before(end_of_text: int | None) -> str:
    """How to resume feeding documents as a run recorded ``end_of_text``."""
    if end_of_text is None:
        return "with --no-end-of-text, as the run started"
    return "without --no-end-of-text and with the tokenizer the run started with"


def _recorded(path: Path) -> tuple[list[str] | None, int | None]:
    """The fingerprints ``path`` records, None when it is unreadable (a damaged record is another one), and
    its end-of-text id (None: none, or a record from before flexmesh put one)."""
    try:
        data = load_json(path, DataError, missing=f"{path} is missing")
        eot = data.get("end_of_text")
        return [str(c["fingerprint"]) for c in data["corpora"]], eot if isinstance(eot, int) else None
    except (DataError, KeyError, TypeError, AttributeError):
        return None, None


def _names(path: Path) -> list[str]:
    try:
        return [str(c["name"]) for c in load_json(path, DataError, missing="")["corpora"]]
    except (DataError, KeyError, TypeError):
        return []
