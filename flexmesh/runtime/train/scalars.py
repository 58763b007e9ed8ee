"""TensorBoard scalars of a run (``flexmesh train --tensorboard``): rank 0 writes each step's ``loss``,
``lr``, ``grad_norm``, ``tokens_per_s``, on evaluated steps ``eval_loss`` and ``eval_ppl``, with
``--domains`` each domain's ``domain_loss/<name>``, ``domain_weight/<name>`` and ``eval_domain_loss/<name>``, and
with ``--reweight`` the step's ``doc_weight/min`` and ``doc_weight/max``, under the names metrics.jsonl gives
them, through torch's own ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package, an optional
dependency: ``pip install tensorboard``).
"""

from __future__ import annotations

import importlib.util
import math

from flexmesh.errors import DataError
from flexmesh.runtime.train.config import StepMetrics

# The metrics.jsonl fields written as scalars, every step; the evaluated ones only where present.
STEP_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s")
EVAL_SCALARS = ("eval_loss", "eval_ppl")
DOMAIN_SCALARS = ("domain_loss", "domain_weight", "eval_domain_loss")  # per domain, with --domains


def check_tensorboard() -> None:
    """Refuse ``--tensorboard`` in one line where the ``tensorboard`` package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise DataError("--tensorboard writes through the tensorboard package, which is not installed: "
                        "pip install tensorboard (or drop --tensorboard)")


class Scalars:
    """One event file in ``folder``; ``resumed_at``: the step the run starts after (its checkpoint's, 0 from
    the start), so TensorBoard drops the events an earlier attempt wrote after it (SummaryWriter's
    ``purge_step``)."""

    def __init__(self, folder: str, resumed_at: int = 0) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(folder, purge_step=resumed_at + 1)

    def add(self, m: StepMetrics) -> None:
        """Step ``m``'s scalars (a value that is not finite is left out: TensorBoard plots it as a gap)."""
        names = STEP_SCALARS + tuple(n for n in EVAL_SCALARS if getattr(m, n) is not None)
        values = [(name, getattr(m, name)) for name in names]
        for field in DOMAIN_SCALARS:  # with --domains: one scalar per domain, "domain_loss/<name>"
            values += [(f"{field}/{d}", x) for d, x in zip(m.domains, getattr(m, field), strict=False)]
        values += [(f"doc_weight/{end}", x) for end, x in zip(("min", "max"), m.doc_weight, strict=False)]
        for name, value in values:
            if value is not None and math.isfinite(float(value)):
                self._writer.add_scalar(name, float(value), global_step=m.step)

    def close(self) -> None:
        self._writer.close()
