"""ModelFile: the config.json a model was read from -- where it lies and what it held (its sha256).

A plan made with ``--model path/config.json`` records its ModelFile, so a command run from another
folder finds the model again, and an edited file is noticed instead of silently planned for.

``--model`` text names a config file when it is a path (``a/config.json``, a folder ``a`` holding
``config.json``, ``./tiny``): a preset name or ``gpt:L:H:A`` never does, so ``tiny`` is the preset and
``./tiny`` the folder (:func:`flexmesh.spec.model.config_path`).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp()) / "tiny"
>>> folder.mkdir()
>>> _ = (folder / "config.json").write_text("{}")
>>> ModelFile.of("tiny") is None, ModelFile.of(str(folder)).path == str(folder / "config.json")
(True, True)
>>> ModelFile.of(str(folder)).sha256[:12]  # of the file's bytes, b"{}"
'44136fa355b3'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from flexmesh.errors import SpecError
from flexmesh.spec.model import config_path
from flexmesh.spec.values import known_keys, mapping, text


def file_sha256(path: Path) -> str | None:
    """The sha256 of the bytes of ``path``, None when it is not a readable file."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class ModelFile:
    """A model's config.json: its absolute ``path`` and the ``sha256`` of its content when read."""

    path: str
    sha256: str

    def __post_init__(self) -> None:
        text(self.path, "model_config path", SpecError)
        text(self.sha256, "model_config sha256", SpecError)

    @classmethod
    def of(cls, model: str) -> ModelFile | None:
        """The file ``--model`` text ``model`` names, as it is now; None when it names no file (a preset,
        a GPT triple) or the file cannot be read (parse_model says why)."""
        path = config_path(model)
        digest = file_sha256(path) if path is not None else None
        return cls(str(path.resolve()), digest) if path is not None and digest is not None else None

    def current(self) -> str | None:
        """The sha256 of the file at :attr:`path` now; None when it is gone."""
        return file_sha256(Path(self.path))

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: object, where: str, error: type[Exception]) -> ModelFile:
        d = mapping(d, where, error)
        known_keys(d, ("path", "sha256"), where, error)
        missing = [k for k in ("path", "sha256") if k not in d]
        if missing:
            raise error(f"{where} is missing {', '.join(missing)}")
        try:
            return cls(d["path"], d["sha256"])
        except SpecError as e:
            raise error(f"{where}: {e}") from None
