"""Bounds on sizes a user can type, checked before any work: a value past one of them is a typo or an
attack, not a run (the largest published runs are far inside each), and taking it would allocate or
loop until the machine gives up. Each bound is a generous multiple of the largest real value named.

>>> within(128, MAX_SEQUENCES, "--global-batch")
128
>>> within(1 << 40, MAX_SEQUENCES, "--global-batch")
Traceback (most recent call last):
flexmesh.errors.SpecError: --global-batch 1099511627776 is beyond flexmesh's bound of 4,194,304; give a realistic value
"""

from __future__ import annotations

from flexmesh.errors import SpecError

MAX_DEVICES = 1 << 20  # devices in one cluster (the largest training clusters: ~100K GPUs)
MAX_SEQUENCES = 1 << 22  # sequences per step (published global batches: up to ~16K sequences)
MAX_TOKENS = 1 << 30  # tokens per step (published: up to ~60M tokens)
MAX_SEQ_LEN = 1 << 24  # tokens in one sequence (published contexts: up to ~10M tokens)
MAX_LAYERS = 1 << 14  # transformer layers (published: up to ~200)
MAX_WIDTH = 1 << 20  # hidden, FFN width, heads (published hidden sizes: up to ~25K)
MAX_VOCAB = 1 << 24  # vocabulary entries (published: up to ~260K)
MAX_STEPS = 1 << 20  # simulated steps in one command
# A device's numbers: a rate of 1 GFLOP/s or 1 MB/s, or a fraction of a peak below 0.1%, is a typo (and prices a
# step past any float's range); the fastest parts reach ~10^4 TFLOP/s (fp4), ~10^4 GB/s of HBM and ~10^3 GiB.
MIN_FRACTION = 1e-3  # an efficiency (a fraction of a datasheet peak) or a speed factor, at least
MAX_SPEED = 1e3  # a speed factor (1: the device's nominal speed), at most
MIN_RATE, MAX_RATE = 1e-3, 1e7  # TFLOP/s, GB/s and GiB of a device, at least and at most


def within(value: int, bound: int, what: str, error: type[Exception] = SpecError) -> int:
    """``value`` when it is at most ``bound``; else ``error`` naming ``what`` and the bound."""
    if value > bound:
        raise error(f"{what} {value} is beyond flexmesh's bound of {bound:,}; give a realistic value")
    return value
