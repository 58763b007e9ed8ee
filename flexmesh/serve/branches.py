"""Test-time scaling: a request samples N branches (answers) and needs M of them (SART, arXiv 2505.13326:
"Scaling Test-Time Compute for LLM Serving ... with Branch-Aware Scheduling"); the other branches stop once M
have finished, and a score hook may stop weak branches earlier. The same rules in the simulator
(:mod:`flexmesh.serve.simulator`) and in flexmesh's router (:mod:`flexmesh.serve.engine.router`).

A request's branches all go to one replica (they share its prompt). Each branch's length is the request's
``branch_tokens`` (where the trace or :func:`flexmesh.data.requests.with_branches` gives them); the request is
done when its M-th branch finishes, and the branches still running or queued then are cancelled: the tokens they
would have generated after that moment are the saving, ``decode tokens = sum over branches of the tokens each
generated``.

Pruning (SART's second half): each time a branch finishes before the M-th, :func:`to_prune` asks the score
hook for a score of every branch still alive (a reward model's view of its answer so far; higher is better)
and stops those below ``threshold``, keeping the best so that at least ``M - finished`` stay alive.

>>> from flexmesh.data.requests import Request
>>> r = Request(3, 0.0, 100, 50, branches=6, needed=2)
>>> to_prune(r, alive=[1, 2, 4, 5], finished=1, score=lambda r, b: b / 10, threshold=0.3)
[1, 2]
>>> to_prune(r, alive=[1, 2], finished=1, score=lambda r, b: 0.0, threshold=0.3)  # one must stay alive
[2]
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from flexmesh.data.requests import Request
from flexmesh.errors import SpecError

Score = Callable[[Request, int], float]  # (request, branch index) -> the branch's score, higher is better


def to_prune(request: Request, alive: Sequence[int], finished: int, score: Score | None,
             threshold: float) -> list[int]:
    """The branches of ``alive`` to stop now (see the module doc), in index order."""
    if score is None or not alive:
        return []
    keep_at_least = max(request.needed - finished, 0)
    scored = sorted(alive, key=lambda b: (-score(request, b), b))  # best first
    protected = set(scored[:keep_at_least])
    return sorted(b for b in alive if b not in protected and score(request, b) < threshold)


def seeded_score(request: Request, branch: int) -> float:
    """A stand-in reward: uniform in [0, 1), fixed per (request, branch) (crc32), so the simulator and the router
    prune the same branches."""
    return zlib.crc32(f"{request.id}:{branch}".encode()) / 2**32


SCORES: dict[str, Score] = {"seeded": seeded_score}


def make_score(name: str | None) -> Score | None:
    if name is None:
        return None
    if name not in SCORES:
        raise SpecError(f"unknown branch score hook {name!r}; hooks: {', '.join(SCORES)}")
    return SCORES[name]
