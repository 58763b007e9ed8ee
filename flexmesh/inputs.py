"""One bounded reader for every structured file a user hands flexmesh (plans, profiles, clusters,
jobs, routing, migration requests, metrics, manifests, length and trace files, engine configs).

Whatever the bytes are, reading either returns plain values or raises the caller's FlexmeshError
(exit status 2) with one line naming the file and, where it can, the field:

- only a regular file is read: a fifo, device, socket or folder is refused before it is opened for
  reading, so a fifo is never waited on and ``/dev/zero`` never fills memory;
- the size is checked before reading (``limit``), and at most ``limit`` bytes are read even from a
  file that grows meanwhile;
- nesting deeper than :data:`MAX_DEPTH` and more than :data:`MAX_VALUES` values are refused;
- bytes that are not UTF-8 and numbers that are not finite (``1e999``, ``NaN``, ``Infinity``; TOML's
  ``inf`` and ``nan``) are named with the file and the field that holds them.

>>> import tempfile, pathlib
>>> from flexmesh.errors import PlanError
>>> p = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
>>> _ = p.write_bytes(b'{"stages": [{"time_s": 1e999}]}')
>>> load_json(p, PlanError)  # doctest: +ELLIPSIS
Traceback (most recent call last):
flexmesh.errors.PlanError: .../plan.json: stages[0].time_s is 1e999, not a finite number; write a finite number there
>>> _ = p.write_bytes(b'{"name": "caf\\xe9"}')
>>> load_json(p, PlanError)  # doctest: +ELLIPSIS
Traceback (most recent call last):
flexmesh.errors.PlanError: .../plan.json: name holds bytes that are not UTF-8 ('caf\\\\xe9'); save the file as UTF-8
>>> load_json("/dev/null", PlanError)
Traceback (most recent call last):
flexmesh.errors.PlanError: /dev/null is a device, not a file flexmesh reads; give a regular file
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomllib

# A structured input of flexmesh is at most a few MiB (a plan, a profile, a metrics file of a long
# run is ~10 kB per 100 steps); 256 MiB leaves room for traces and length files of millions of rows.
MAX_BYTES = 256 * 2**20
# Plans and profiles nest 6 levels, tokenizer.json 5; a JSON nested 64 deep is not one of them.
MAX_DEPTH = 64
# Bounds the work done on what was read: each value costs at least a byte, so this adds little to
# MAX_BYTES, but it also holds for text parsed from memory (jsonl lines, engine answers).
MAX_VALUES = 50_000_000

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def read_bytes(path: str | Path, error: type[Exception], *, missing: str | None = None,
               limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``error`` (one line) when
    it is missing (``missing``, if given, is the message), not a regular file, or larger than
    ``limit``. A fifo or device is refused without being waited on or read."""
    name = str(path)
    try:
        mode = os.stat(path).st_mode  # follows symlinks: the user may name a file through one
    except (FileNotFoundError, NotADirectoryError):
        raise error(missing or f"{name} does not exist; give an existing file") from None
    except OSError as e:
        raise error(f"{name} cannot be read ({e.strerror or e}); give a readable file") from None
    if not stat.S_ISREG(mode):
        raise error(f"{name} is {_kind(mode)}, not a file flexmesh reads; give a regular file")
    try:
        # O_NONBLOCK: a fifo put there since the check opens at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{name} cannot be read ({e.strerror or e}); give a readable file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{name} is {_kind(st.st_mode)}, not a file flexmesh reads; give a regular file")
        if st.st_size > limit:
            raise error(f"{name} is {_mib(st.st_size)}, more than the {_mib(limit)} flexmesh reads from such a "
                        "file; give the right file or a smaller one")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise error(f"{name} grew past the {_mib(limit)} flexmesh reads from such a file while it was read; "
                        "give a file that is not being written")
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{name} cannot be read ({e.strerror or e}); give a readable file") from None
    finally:
        os.close(fd)


def field_name(path: tuple[str | int, ...]) -> str:
    """``("stages", 2, "time_s")`` -> ``stages[2].time_s``; ``()`` -> ``the top level``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the top level"


def _has_surrogate(s: str) -> bool:
    # Bytes that are not UTF-8 decode (errors="surrogateescape") to lone surrogates; so does a
    # "\udcff" escape in JSON, which no UTF-8 text holds either.
    return any("\ud800" <= c <= "\udfff" for c in s)


def _shown(s: str) -> str:
    return repr(s.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")[:40])


def check_values(value: Any, error: type[Exception], where: str, *, finite: bool = True,
                 max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> Any:
    """``value`` (as parsed from JSON or TOML) once it holds no text that was not UTF-8, no number
    that is not finite (unless ``finite`` is False), no nesting deeper than ``max_depth`` and no more
    than ``max_values`` values; else ``error("<where>: <field> ...")``. Walks iteratively."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    count = 0
    while stack:
        v, at = stack.pop()
        count += 1
        if count > max_values:
            raise error(f"{where}: holds more than {max_values} values; give the right file")
        if len(at) > max_depth:
            raise error(f"{where}: {field_name(at)} nests more than {max_depth} levels deep; "
                        "give the right file")
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and _has_surrogate(k):
                    raise error(f"{where}: the key {_shown(k)} under {field_name(at)} holds bytes that are not "
                                "UTF-8; save the file as UTF-8")
                stack.append((item, (*at, k)))
        elif isinstance(v, list):
            stack.extend((item, (*at, i)) for i, item in enumerate(v))
        elif isinstance(v, str):
            if _has_surrogate(v):
                raise error(f"{where}: {field_name(at)} holds bytes that are not UTF-8 ({_shown(v)}); save the "
                            "file as UTF-8")
        elif isinstance(v, float) and finite and not math.isfinite(v):
            raise error(f"{where}: {field_name(at)} is {_NONFINITE.get(repr(v), repr(v))}, not a finite number; "
                        "write a finite number there")
    return value


_NONFINITE = {"inf": "1e999", "-inf": "-1e999", "nan": "NaN"}


def decode_text(raw: bytes) -> str:
    """Text of ``raw`` with bytes that are not UTF-8 kept as lone surrogates, for check_values to name
    the field that holds them (a BOM is dropped, as editors on Windows write one)."""
    return raw.decode("utf-8", "surrogateescape").removeprefix("\ufeff")


def _invalid(where: str, invalid: str, reason: str) -> str:
    """``<where>: <invalid> (<reason>)``, or the reason put where ``invalid`` says ``{reason}``."""
    if "{reason}" in invalid:
        return f"{where}: {invalid.replace('{reason}', reason)}"
    return f"{where}: {invalid} ({reason})"


def parse_json(text: str, error: type[Exception], where: str, *, invalid: str = "not valid JSON",
               finite: bool = True) -> Any:
    """The JSON value of ``text`` (from ``where``, a file or a file's line), bounded and checked as
    :func:`check_values` says; ``error("<where>: <invalid> (<reason>)")`` when it is not JSON."""
    # Values bounded before they are built: each value after a container's first follows a comma, so commas and
    # openings bound the count from above (commas inside strings only make it stricter), counted at C speed.
    if len(text) > MAX_VALUES and text.count(",") + text.count("[") + text.count("{") > MAX_VALUES:
        raise error(_invalid(where, invalid, f"more than {MAX_VALUES:,} values"))
    try:
        value = json.loads(text)
    except RecursionError:  # nested deeper than Python's parser goes
        raise error(_invalid(where, invalid, f"nested too deeply, more than {MAX_DEPTH} levels deep")) from None
    except json.JSONDecodeError as e:
        if _has_surrogate(text[max(0, e.pos - 1):e.pos + 1]):
            raise error(f"{where}: line {e.lineno} holds bytes that are not UTF-8; save the file as UTF-8") from None
        raise error(_invalid(where, invalid, str(e))) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise error(_invalid(where, invalid, str(e))) from None
    return check_values(value, error, where, finite=finite)


def load_json(path: str | Path, error: type[Exception], *, missing: str | None = None,
              invalid: str = "not valid JSON", limit: int = MAX_BYTES, finite: bool = True) -> Any:
    """The JSON value in the regular file ``path`` (:func:`read_bytes`, then :func:`parse_json`)."""
    raw = read_bytes(path, error, missing=missing, limit=limit)
    return parse_json(decode_text(raw), error, str(path), invalid=invalid, finite=finite)


def parse_toml(text: str, error: type[Exception], where: str, *, invalid: str = "not valid TOML") -> dict[str, Any]:
    """The TOML table of ``text``, bounded and checked as :func:`check_values` says."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise error(_invalid(where, invalid, f"nested too deeply, more than {MAX_DEPTH} levels deep")) from None
    except tomllib.TOMLDecodeError as e:
        raise error(_invalid(where, invalid, str(e))) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise error(_invalid(where, invalid, str(e))) from None
    return check_values(value, error, where)


def load_toml(path: str | Path, error: type[Exception], *, missing: str | None = None,
              invalid: str = "not valid TOML", limit: int = MAX_BYTES) -> dict[str, Any]:
    """The TOML table in the regular file ``path`` (:func:`read_bytes`, then :func:`parse_toml`)."""
    raw = read_bytes(path, error, missing=missing, limit=limit)
    return parse_toml(decode_text(raw), error, str(path), invalid=invalid)


def read_text(path: str | Path, error: type[Exception], *, missing: str | None = None,
              limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``; bytes that are not UTF-8 are named by line."""
    raw = read_bytes(path, error, missing=missing, limit=limit)
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise error(f"{path}: line {line} holds bytes that are not UTF-8; save the "
                    "file as UTF-8") from None


def iter_jsonl(path: str | Path, error: type[Exception], *, missing: str | None = None,
               invalid: str = "not a JSON record", limit: int = MAX_BYTES,
               finite: bool = True) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of the JSON-lines file ``path``, each line
    read as :func:`parse_json` does and named ``<path> line <n>`` in errors."""
    text = decode_text(read_bytes(path, error, missing=missing, limit=limit))
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield n, parse_json(line, error, f"{path} line {n}", invalid=invalid, finite=finite)


def load_config(path: str | Path, error: type[Exception], *, missing: str | None = None,
                invalid: str = "cannot be parsed") -> Any:
    """A TOML file (``.toml``) or else a JSON file, read as :func:`load_toml` or :func:`load_json`."""
    if Path(path).suffix == ".toml":
        return load_toml(path, error, missing=missing, invalid=invalid)
    return load_json(path, error, missing=missing, invalid=invalid)
