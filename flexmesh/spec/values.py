"""Checks of single values read from user files: whole numbers, finite numbers, flags, text.

Every parser of user input (configs, cluster files, plans, profiles, lengths) reads numbers through
these, so a wrong type, a fraction where a count belongs, NaN, infinity, zero or a negative number
is a one-line error naming the key and what it must be, of the error class the caller passes.

>>> whole(4, "num_hidden_layers", ValueError)
4
>>> whole(3.5, "num_hidden_layers", ValueError)
Traceback (most recent call last):
ValueError: num_hidden_layers must be a whole number >= 1, got 3.5
>>> number(float("nan"), "hbm_gbps", ValueError)
Traceback (most recent call last):
ValueError: hbm_gbps must be a finite number > 0, got nan
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def _shown(value: Any) -> str:
    """``value`` as a file wrote it: JSON's null, true and false; repr otherwise, cut to 60 characters."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The largest count a file may give (layers, widths, lengths, devices, batch sizes): the int32 range.
# No real value comes near it, and products of two such counts (a length squared, tokens x width)
# still fit the int64 arithmetic numpy and torch do them in; a larger value is a typo or garbage.
MAX_COUNT = 2**31 - 1


def whole(value: Any, what: str, error: type[Exception], minimum: int | None = 1, maximum: int = MAX_COUNT) -> int:
    """``value`` as an int when it is a whole number (not a bool, not 3.5, not "3") in
    [``minimum``, ``maximum``]."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok and isinstance(value, float) and value.is_integer():
        ok = True  # 4.0 is the whole number 4 (TOML and some writers emit floats)
    if not ok or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise error(f"{what} must be a whole number{bound}, got {_shown(value)}")
    if value > maximum:
        raise error(f"{what} is {_shown(value)}, above the largest count flexmesh accepts ({maximum:,}); "
                    "check the value")
    return int(value)


def number(value: Any, what: str, error: type[Exception], minimum: float = 0.0, strict: bool = True,
           maximum: float | None = None) -> float:
    """``value`` as a float when it is a finite number (not a bool or a string) above ``minimum``
    (``strict``) or at least it, and at most ``maximum`` when given."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (v > minimum if strict else v >= minimum) and (maximum is None or v <= maximum)
    if not ok:
        rel = ">" if strict else ">="
        upper = f" and <= {maximum:g}" if maximum is not None else ""
        raise error(f"{what} must be a finite number {rel} {minimum:g}{upper}, got {_shown(value)}")
    return float(value)


def flag(value: Any, what: str, error: type[Exception]) -> bool:
    """``value`` when it is true or false (JSON true/false, not 1 or "yes")."""
    if not isinstance(value, bool):
        raise error(f"{what} must be true or false, got {_shown(value)}")
    return value


def text(value: Any, what: str, error: type[Exception]) -> str:
    """``value`` when it is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise error(f"{what} must be a non-empty string, got {_shown(value)}")
    return value


def mapping(value: Any, what: str, error: type[Exception]) -> dict:
    """``value`` when it is a JSON object (a dict)."""
    if not isinstance(value, dict):
        raise error(f"{what} must be a JSON object, got {type(value).__name__} {_shown(value)}")
    return value


def sequence(value: Any, what: str, error: type[Exception]) -> list:
    """``value`` when it is a JSON list."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{what} must be a list, got {type(value).__name__} {_shown(value)}")
    return list(value)


def known_keys(d: dict, known: set[str] | tuple[str, ...], what: str, error: type[Exception]) -> None:
    """Refuse keys of ``d`` outside ``known``, listing the ones that exist (a typo names no field)."""
    unknown = sorted(str(k) for k in set(d) - set(known))
    if unknown:
        raise error(f"{what} has unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}")
