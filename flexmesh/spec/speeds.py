"""Devices slower than the rest: ``--slow RANK=FACTOR,...`` as ``plan``, ``simulate`` and ``train`` read it
(docs/cli.md#slow-devices), checked against the devices of a run and turned into one speed factor per
device (flexmesh.spec.cluster.MixedCluster.with_speeds prices a cluster at them)."""

from __future__ import annotations

from collections.abc import Iterable

from flexmesh.errors import SpecError


def slow_devices(pairs: Iterable[tuple[int, float]], world: int) -> dict[int, float]:
    """``--slow`` pairs (``RANK=FACTOR``, flexmesh.commands.args.rank_factors) as {device: factor} for a
    run of ``world`` devices: one meaning in ``plan``, ``simulate`` and ``train``. A device outside the
    run, a device named twice or a factor outside (0, 1] is a one-line SpecError.

    >>> slow_devices([(3, 0.5)], 4), speeds_of(slow_devices([(3, 0.5)], 4), 4)
    ({3: 0.5}, (1.0, 1.0, 1.0, 0.5))
    >>> slow_devices([(4, 0.5)], 4)
    Traceback (most recent call last):
    flexmesh.errors.SpecError: --slow names rank 4, but there are ranks 0 to 3 (one per device); name one of them
    """
    out: dict[int, float] = {}
    for rank, factor in pairs:
        if not 0 <= rank < world:
            raise SpecError(f"--slow names rank {rank}, but there are ranks 0 to {world - 1} (one per device); name "
                            "one of them")
        if rank in out:
            raise SpecError(f"--slow names rank {rank} twice; give each rank one factor")
        if not 0.0 < factor <= 1.0:
            raise SpecError(f"--slow factor of rank {rank} must be in (0, 1], got {factor}")
        out[rank] = factor
    return out


def speeds_of(slow: dict[int, float], world: int) -> tuple[float, ...]:
    """One speed factor per device: ``slow``'s where it names the device, else 1.0 (nominal); () for none."""
    return tuple(slow.get(r, 1.0) for r in range(world)) if slow else ()
