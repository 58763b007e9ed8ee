"""The compute dtypes the runtime trains in (docs/precision.md); torch-free, so that flags can offer them."""

from __future__ import annotations

from flexmesh.errors import PlanError

TRAIN_DTYPES = ("fp32", "bf16")  # what `flexmesh train --dtype` accepts


def check_dtype(dtype: str) -> None:
    """Raise PlanError unless ``dtype`` is a compute dtype the runtime trains in."""
    if dtype not in TRAIN_DTYPES:
        raise PlanError(f"the runtime trains in {' or '.join(TRAIN_DTYPES)}, not {dtype!r}; pass --dtype "
                        f"{' or --dtype '.join(TRAIN_DTYPES)}")
