"""GPU prices (US dollars per GPU-hour) as data with their source and date, overridable.

``presets/prices.toml`` holds public on-demand prices (each with its instance and the date of the price
list); :func:`gpu_prices` reads them, a file of one's own in the same form (``--prices``), and single
overrides (``--price H100=2.49``). Devices are named as the catalogue names them (aliases accepted).

>>> p = gpu_prices()
>>> p["H100-80GB"].usd_per_hour, p["A100-40GB"].usd_per_hour, p["L4"].usd_per_hour
(6.88, 2.74470525, 0.8048)
>>> gpu_prices(overrides=parse_price_overrides("H100=2.5"))["H100-80GB"].source
'given on the command line'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import tomllib

from flexmesh.errors import SpecError
from flexmesh.inputs import load_config
from flexmesh.spec.devices import device
from flexmesh.spec.values import number, whole


@dataclass(frozen=True)
class GpuPrice:
    device: str  # the catalogue's name
    usd_per_hour: float  # per GPU
    source: str  # where the price comes from, with its date


def _read(raw: dict, where: str) -> dict[str, GpuPrice]:
    date, source = raw.get("date", ""), raw.get("source", where)
    out = {}
    for key, entry in raw.items():
        if key in ("date", "source"):
            continue
        name = device(key).name  # unknown devices are a one-line SpecError
        if not isinstance(entry, dict):
            raise SpecError(f"{where}: [{key}] must be a table with instance_usd_per_hour and gpus (or usd_per_hour)")
        if "usd_per_hour" in entry:
            usd = number(entry["usd_per_hour"], f"{where}: {key}.usd_per_hour", SpecError)
        else:
            total = number(entry.get("instance_usd_per_hour"), f"{where}: {key}.instance_usd_per_hour", SpecError)
            usd = total / whole(entry.get("gpus"), f"{where}: {key}.gpus", SpecError)
        what = f", {entry['instance']}" if "instance" in entry else ""
        out[name] = GpuPrice(name, usd, f"{source}{what}{f' ({date})' if date else ''}")
    return out


def parse_price_overrides(text: str) -> dict[str, float]:
    """``DEVICE=USD,...`` (per GPU-hour)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        try:
            usd = float(value)
        except ValueError:
            usd = -1.0
        if not eq or not (usd >= 0 and math.isfinite(usd)):
            raise SpecError(f"price {part!r} is not DEVICE=USD_PER_GPU_HOUR (e.g. H100=2.49)")
        out[device(name.strip()).name] = usd
    return out


def gpu_prices(path: str | Path | None = None, overrides: dict[str, float] | None = None) -> dict[str, GpuPrice]:
    """The preset prices, replaced by those of ``path`` (TOML or JSON in the preset's form) and then by
    ``overrides`` (device name to USD per GPU-hour)."""
    preset = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/prices.toml").read_text())
    prices = _read(preset, "presets/prices.toml")
    if path is not None:
        p = Path(path)
        raw = load_config(p, SpecError, invalid="cannot parse the price file")
        if not isinstance(raw, dict):
            raise SpecError(f"{p}: a price file is a table of devices")
        prices.update(_read(raw, str(p)))
    for name, usd in (overrides or {}).items():
        prices[name] = GpuPrice(name, usd, "given on the command line")
    return prices
