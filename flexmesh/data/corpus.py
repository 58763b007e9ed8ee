"""Corpus: the raw text documents a run trains on.

Two sources: a folder of text files (searched recursively; one file is one document) or a ``.jsonl``
file with one JSON object per line whose text field is one document. The project's own real
corpus is the running Python's standard library source (:func:`stdlib_corpus_dir`), which exists
on every machine without a download.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from flexmesh.errors import DataError

DEFAULT_EXTENSIONS: tuple[str, ...] = (".txt", ".md", ".py", ".rst")
# The most bytes one document (a file of a folder corpus, a line of a .jsonl one) may hold: it is read and
# tokenized whole, so a 3 GB file would be held in memory several times over
MAX_DOCUMENT_BYTES = 256 * 2**20
# Third-party packages installed inside the standard library folder differ from machine to machine;
# leaving them out keeps the stdlib corpus the same wherever one Python version runs.
_STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class Corpus:
    """A resolved corpus: which files hold it and how to read documents out of them.

    ``files`` is sorted, so document order (and every cache key) is the same on every run.
    """

    root: Path
    files: tuple[Path, ...]
    kind: str  # "dir" or "jsonl"
    text_field: str = "text"

    def fingerprint(self) -> str:
        """Hash of the file names and contents: a cache keyed by it never serves stale tokens, even
        after an edit in place that keeps a file's size and modification time.

        It reads every byte (SHA-256 at several hundred MB/s: a fraction of a second for the
        standard library's sources, still far cheaper than tokenising), once per Corpus: the
        tokenizer's cache key, the token cache's and the run's corpus record all ask the one object a
        run resolved, so a training start reads the corpus once. A corpus edited since is another
        Corpus (:func:`read_corpus` again).
        """
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:  # cached_property writes the instance's __dict__, which a frozen dataclass allows
        return content_fingerprint(self)

    def documents(self) -> Iterator[str]:
        """Yield the non-empty documents in a fixed order."""
        if self.kind == "jsonl":
            yield from _jsonl_documents(self.files[0], self.text_field)
            return
        for f in self.files:
            size = f.stat().st_size
            if size > MAX_DOCUMENT_BYTES:  # read whole as one document: bounded before it is read
                raise DataError(f"corpus file {f} is {size / 2**20:,.0f} MiB, more than the "
                                f"{MAX_DOCUMENT_BYTES // 2**20} MiB flexmesh reads as one document; split it into "
                                "files of one document each, or give a .jsonl with one document per line")
            # Some source trees hold files in legacy encodings; replacing the odd byte keeps them usable.
            with f.open("rb") as fh:
                raw = fh.read(MAX_DOCUMENT_BYTES + 1)  # a file that grew meanwhile: no more than the bound
            if len(raw) > MAX_DOCUMENT_BYTES:
                raise DataError(f"corpus file {f} grew past {MAX_DOCUMENT_BYTES // 2**20} MiB while it was read; "
                                "read a corpus that is not being written")
            text = raw.decode("utf-8", errors="replace")
            if text.strip():
                yield text

    def texts(self) -> list[str]:
        """All documents in memory; raises DataError when there are none."""
        docs = list(self.documents())
        if not docs:
            raise DataError(f"corpus {self.root} has no documents: every file is empty; point --corpus at text data")
        return docs


def content_fingerprint(corpus: Corpus) -> str:
    """The hash :meth:`Corpus.fingerprint` keeps: ``corpus``'s file names and every byte, read now."""
    h = hashlib.sha256(f"{corpus.kind}:{corpus.text_field}".encode())
    for f in corpus.files:
        name = f.relative_to(corpus.root) if corpus.kind == "dir" else f.name
        h.update(b"\0" + os.fsencode(name) + b"\0")  # the name's bytes: a name that is not UTF-8 hashes too
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_DOCUMENT_BYTES + 1), b""), start=1):
            if len(raw) > MAX_DOCUMENT_BYTES:  # one line, read in bounded pieces
                raise DataError(f"{path} line {lineno} is longer than the {MAX_DOCUMENT_BYTES // 2**20} MiB flexmesh "
                                "reads as one document; split that document")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {lineno} is not UTF-8 text (byte {e.start} of the line); re-encode the "
                                "file as UTF-8 or remove that line") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                raise DataError(f"{path} line {lineno} is not valid JSON ({reason}); fix or remove that line") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path} line {lineno} is a JSON {type(obj).__name__}, not an object; write each line "
                                f"as {{{field!r}: \"...\"}}".replace("'", '"'))
            if field not in obj:
                raise DataError(
                    f"{path} line {lineno} has no {field!r} field; give each line a {field!r} string "
                    "or choose the field with text_field"
                )
            text = obj[field]
            if not isinstance(text, str):
                raise DataError(f"{path} line {lineno}: field {field!r} is a {type(text).__name__}, expected a string")
            if text.strip():
                yield text


def read_corpus(
    path: str | Path,
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS,
    text_field: str = "text",
    exclude_dirs: tuple[str, ...] = (),
) -> Corpus:
    """Resolve ``path`` (a folder or a ``.jsonl`` file) into a :class:`Corpus`.

    Raises DataError for a missing path, an unsupported file, or a folder with no matching files.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"corpus path {root} does not exist; pass a folder of text files or a .jsonl file")
    if root.is_file():
        if root.suffix != ".jsonl":
            raise DataError(f"corpus file {root} is not .jsonl; pass a .jsonl file or the folder holding text files")
        return Corpus(root=root, files=(root,), kind="jsonl", text_field=text_field)
    exts = {e if e.startswith(".") else f".{e}" for e in extensions}
    files = tuple(sorted(_walk(root, exts, set(exclude_dirs))))
    if not files:
        raise DataError(
            f"corpus folder {root} has no documents: no files ending in {', '.join(sorted(exts))}; "
            "add text files or change the extensions"
        )
    return Corpus(root=root, files=files, kind="dir", text_field=text_field)


def _walk(root: Path, exts: set[str], exclude_dirs: set[str]) -> Iterator[Path]:
    # os.walk lets excluded folders be pruned before they are entered (site-packages can hold
    # far more files than the standard library itself).
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in exclude_dirs]
        for name in filenames:
            if os.path.splitext(name)[1] in exts:
                f = Path(dirpath) / name
                if f.is_file():
                    yield f


def stdlib_corpus_dir() -> Path:
    """The running Python's standard library source folder (e.g. ``/usr/lib/python3.11``)."""
    d = Path(sysconfig.get_paths()["stdlib"])
    if not d.is_dir():
        raise DataError(f"the standard library folder {d} is missing; use a Python installation with its sources")
    return d


def stdlib_corpus() -> Corpus:
    """The standard library's ``.py`` files, without third-party packages or caches."""
    return read_corpus(stdlib_corpus_dir(), extensions=(".py",), exclude_dirs=_STDLIB_EXCLUDE)

