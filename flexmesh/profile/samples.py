"""The iterations of an engine profile's sweep as measured (``flexmesh profile engine --samples``, one JSON object a
line): :class:`IterationSample`, :func:`read_iteration_samples`, and how well the fit's form carries from one phase
of the sweep to the other (:func:`held_out_errors`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flexmesh.errors import ProfileError
from flexmesh.profile.iteration import TERMS, EngineProfile, ProfiledIterationTiming, fit_iterations


@dataclass(frozen=True)
class IterationSample:
    """One iteration as ``flexmesh profile engine --samples`` wrote it: its batch, wall and CPU seconds, the engine
    that ran it, its phase (``sweep`` with the scenario, ``serving`` with the load) and when it started."""

    batch: tuple[tuple[int, int], ...]
    wall_s: float
    cpu_s: float
    engine: int
    phase: str
    scenario: str = ""
    load: float = 0.0
    start_s: float = 0.0  # perf_counter seconds (one clock for every engine on the machine)
    taken: int = 0  # requests the engine took in while it ran (module doc)
    answered: int = 0  # requests it answered while it ran
    others_cpu_s: float = 0.0  # CPU time of the engine's other threads while it ran

    @classmethod
    def from_dict(cls, d: dict) -> IterationSample:
        """A sample from one ``--samples`` line's fields (KeyError, TypeError or ValueError when malformed)."""
        return cls(tuple((int(c), int(q)) for c, q in d["batch"]), float(d["wall_s"]), float(d["cpu_s"]),
                   int(d["engine"]), str(d["phase"]), str(d.get("scenario", "")), float(d.get("load", 0.0)),
                   float(d.get("start_s", 0.0)), int(d.get("taken", 0)), int(d.get("answered", 0)),
                   float(d.get("others_cpu_s", 0.0)))


def held_out_errors(samples: Sequence[IterationSample]) -> dict[str, dict[str, float]]:
    """How well the form carries from one phase of a profile to the other: fitted (as :func:`fit_iterations`, to
    the medians of identical batches) on the sweep's iterations and priced against every serving iteration's CPU
    time, and the reverse; per direction the median and p90 of |predicted / measured - 1| and the predicted over
    the measured CPU seconds in all (``busy``). A direction with too few batches to fit is left out.

    >>> from flexmesh.profile.iteration import iteration_features
    >>> c = (1e-3, 1e-4, 2e-5, 1e-7, 1e-8, 2e-8)  # while serving, every batch costs a tenth more
    >>> def cpu(batch, k):
    ...     return k * sum(x * f for x, f in zip(c, iteration_features(batch)))
    >>> batches = ([((0, t),) for t in (16, 64, 256)] + [((n, 1),) * b for b in (1, 8, 32) for n in (64, 512)]
    ...            + [((0, 200), (300, 1)), ((256, 256),) * 2, ((256, 128),)])
    >>> e = held_out_errors([IterationSample(b, 1.0, cpu(b, 1.0), 0, "sweep") for b in batches]
    ...                     + [IterationSample(b, 1.0, cpu(b, 1.1), 0, "serving", load=0.4) for b in batches])
    >>> {k: round(v["median"], 3) for k, v in e.items()}, round(e["sweep->serving"]["busy"], 3)
    ({'sweep->serving': 0.091, 'serving->sweep': 0.1}, 0.909)
    """
    by: dict[str, list[IterationSample]] = {"sweep": [], "serving": []}
    for s in samples:
        by.setdefault(s.phase, []).append(s)
    out = {}
    for src, dst in (("sweep", "serving"), ("serving", "sweep")):
        groups: dict[tuple, list[float]] = {}
        for s in by[src]:
            groups.setdefault(tuple(sorted(s.batch)), []).append(s.cpu_s)
        if len(groups) < len(TERMS) or not by[dst]:
            continue
        timing = ProfiledIterationTiming(EngineProfile({}, {}, fit_iterations(
            [(list(b), float(np.median(v))) for b, v in groups.items()])))
        pred = np.array([timing.iteration_s(s.batch) for s in by[dst]])
        cpu = np.array([s.cpu_s for s in by[dst]])
        rel = np.abs(pred / np.maximum(cpu, 1e-12) - 1)
        out[f"{src}->{dst}"] = {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)),
                                "busy": float(pred.sum() / max(cpu.sum(), 1e-12))}
    return out


def read_iteration_samples(path: str | Path) -> list[IterationSample]:
    """The iterations of a ``--samples`` file (JSON lines); ProfileError (one line) when missing or malformed.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "samples.jsonl")
    >>> _ = open(f, "w").write('{"phase": "sweep", "scenario": "prefill 8", "engine": 0, "batch": [[0, 8]], '
    ...                        '"wall_s": 0.011, "cpu_s": 0.01}\\n')
    >>> read_iteration_samples(f)[0].batch, read_iteration_samples(f)[0].cpu_s
    (((0, 8),), 0.01)
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ProfileError(f"iteration samples {str(path)!r} do not exist; write them with "
                           f"`flexmesh profile engine --samples {path}`") from None
    out = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(IterationSample.from_dict(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{path.name} line {k} is not an iteration sample ({e}); each line is {{batch: "
                               "[[cached, new], ...], wall_s, cpu_s, engine, phase}}") from None
    return out
