"""A workload's length buckets (:class:`~flexmesh.serve.layout.buckets.RequestBuckets`), made from a trace or by
hand, and a workload drawn from them.

The planner prices every replica configuration per bucket, routes each bucket's share of the rate, and a plan's
router sends a request by its bucket (the same :class:`~flexmesh.serve.layout.classes.LengthClasses`). Buckets
split by prompt length only by default: a router knows a prompt's length when the request arrives, not its
output's (splitting outputs too, ``output_edges``, routes by the trace's output lengths, an oracle).

From a trace (:func:`buckets_from_trace`): prompt edges at powers of two from 256 tokens, a bucket holding
less than ``min_share`` of the requests merged into its smaller neighbour; each bucket keeps its mean prompt
and output (what its throughput is priced at), the prompt and output at the attainment quantile (what its
latency is judged at) and its longest request (what a replica's KV cache must hold). Given by hand
(:func:`parse_buckets`): ``PROMPT:OUTPUT=SHARE`` entries, each bucket of one length.

>>> from flexmesh.data.requests import load_trace
>>> b = buckets_from_trace(load_trace("azure-conv"))
>>> b.prompt_edges, [round(x.share, 3) for x in b.buckets]
((256, 512, 1024, 2048, 4096), [0.134, 0.26, 0.111, 0.355, 0.118, 0.021])
>>> b.of(300, 20), round(b.buckets[1].prompt_mean), b.buckets[1].longest
(1, 398, 1202)
>>> hand = parse_buckets("512:128=0.75,4096:256=0.25")
>>> hand.prompt_edges, hand.output_edges, [x.share for x in hand.buckets]
((1449,), (), [0.75, 0.25])
"""

from __future__ import annotations

import math

import numpy as np

from flexmesh.data.requests import Request, Workload, with_arrivals
from flexmesh.errors import SpecError
from flexmesh.serve.layout.buckets import Bucket, RequestBuckets
from flexmesh.serve.layout.classes import LengthClasses

# Prompt edges of a trace's buckets: powers of two from 256 tokens (Mélange buckets request sizes on a log scale).
FIRST_EDGE = 256
# A bucket with fewer of the requests than this is merged into its neighbour (a class too small to plan for).
MIN_SHARE = 0.02


def _stats(prompts: np.ndarray, outputs: np.ndarray, quantile: float) -> tuple[float, float, int, int, int, float]:
    if prompts.size == 0:
        return 0.0, 0.0, 0, 0, 0, 0.0
    ctx = prompts + outputs / 2
    return (float(prompts.mean()), float(outputs.mean()), int(np.quantile(prompts, quantile, method="higher")),
            int(np.quantile(outputs, quantile, method="higher")), int((prompts + outputs).max()),
            float(np.sqrt((ctx ** 2).mean())))


def _merged(edges: list[int], counts: list[int], floor: float) -> list[int]:
    """``edges`` with the edge beside each bucket of less than ``floor`` of the requests removed, the smallest
    bucket first, merged into its smaller neighbour."""
    total = sum(counts)
    while len(counts) > 1:
        small = min(range(len(counts)), key=lambda i: counts[i])
        if counts[small] >= floor * total:
            break
        if small == 0:
            other = 1
        elif small == len(counts) - 1:
            other = small - 1
        else:
            other = small - 1 if counts[small - 1] <= counts[small + 1] else small + 1
        lo = min(small, other)
        counts[lo:lo + 2] = [counts[lo] + counts[lo + 1]]
        del edges[lo]
    return edges


def buckets_from_trace(workload: Workload, prompt_edges: tuple[int, ...] | None = None,
                       output_edges: tuple[int, ...] = (), quantile: float = 0.9,
                       min_share: float = MIN_SHARE) -> RequestBuckets:
    """The workload's requests in buckets (default prompt edges: powers of two from :data:`FIRST_EDGE`, small
    buckets merged; ``quantile``: where each bucket's latency is judged, the SLO's attainment target)."""
    if not 0 < quantile <= 1:
        raise SpecError(f"a bucket's quantile is in (0, 1], got {quantile}")
    p = np.array([r.prompt_tokens for r in workload.requests])
    o = np.array([r.output_tokens for r in workload.requests])
    for name, edges in (("prompt", prompt_edges or ()), ("output", output_edges)):
        if any(b <= a for a, b in zip(edges, edges[1:])) or any(e < 1 for e in edges):
            raise SpecError(f"{name} edges must rise from >= 1 token, got {list(edges)}")
    if prompt_edges is None:
        auto = [FIRST_EDGE]
        while auto[-1] * 2 <= p.max():
            auto.append(auto[-1] * 2)
        auto = [e for e in auto if e <= p.max()]
        counts = np.bincount(LengthClasses(tuple(auto)).of_each(p, o), minlength=len(auto) + 1).tolist()
        prompt_edges = tuple(_merged(auto, counts, min_share))
    classes = LengthClasses(tuple(prompt_edges), tuple(output_edges))
    cls = classes.of_each(p, o)
    out = []
    for k, (pr, orng) in enumerate(classes.intervals()):
        mask = cls == k
        out.append(Bucket(pr, orng, float(mask.mean()), *_stats(p[mask], o[mask], quantile)))
    return RequestBuckets(tuple(prompt_edges), tuple(output_edges), tuple(out), workload.name)


def parse_buckets(text: str) -> RequestBuckets:
    """Buckets of one length each from ``PROMPT:OUTPUT=SHARE,...`` (shares normalised to sum to 1); edges
    between neighbouring lengths at their geometric mean."""
    given: dict[tuple[int, int], float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        lengths, eq, share_text = part.partition("=")
        pieces = lengths.split(":")
        try:
            prompt, output, weight = int(pieces[0]), int(pieces[1]), float(share_text)
        except (ValueError, IndexError):
            prompt = output = 0
            weight = -1.0
        if not eq or len(pieces) != 2 or prompt < 1 or output < 1 or not (weight > 0 and math.isfinite(weight)):
            raise SpecError(f"bucket {part!r} is not PROMPT:OUTPUT=SHARE (whole tokens, a share > 0); e.g. "
                            "512:128=0.75,4096:256=0.25")
        given[prompt, output] = given.get((prompt, output), 0.0) + weight
    if not given:
        raise SpecError(f"buckets {text!r} name none; write e.g. 512:128=0.75,4096:256=0.25")
    total = sum(given.values())

    def edges(values: list[int]) -> tuple[int, ...]:
        return tuple(int(math.sqrt(a * b)) + 1 for a, b in zip(values, values[1:]))

    prompts = sorted({p for p, _ in given})
    outputs = sorted({o for _, o in given}) if len({o for _, o in given}) > 1 and len(prompts) < len(given) else []
    pe, oe = edges(prompts), edges(outputs)
    classes = LengthClasses(pe, oe)
    cells: list[list[tuple[int, int, float]]] = [[] for _ in range(classes.classes)]
    for (p, o), w in given.items():
        cells[classes.of(p, o)].append((p, o, w / total))
    out = []
    for items, (pr, orng) in zip(cells, classes.intervals()):
        share = sum(w for _, _, w in items)
        if share == 0:
            out.append(Bucket(pr, orng, 0.0, 0.0, 0.0, 0, 0, 0))
            continue
        pm = sum(p * w for p, _, w in items) / share
        om = sum(o * w for _, o, w in items) / share
        rms = math.sqrt(sum((p + o / 2) ** 2 * w for p, o, w in items) / share)
        out.append(Bucket(pr, orng, share, pm, om, max(p for p, _, _ in items), max(o for _, o, _ in items),
                          max(p + o for p, o, _ in items), rms))
    return RequestBuckets(pe, oe, tuple(out), f"buckets {text}")


def bucket_workload(buckets: RequestBuckets, rate: float, n: int, seed: int = 0) -> Workload:
    """``n`` requests at ``rate`` (Poisson) whose lengths follow the buckets: each bucket's share of them at its
    mean prompt and output, in a seeded random order."""
    if n < 1:
        raise SpecError(f"a workload from buckets needs at least one request, got {n}")
    counts = [round(b.share * n) for b in buckets.buckets]
    reqs: list[tuple[int, int]] = []
    for b, c in zip(buckets.buckets, counts):
        reqs += [(max(1, round(b.prompt_mean)), max(1, round(b.output_mean)))] * c
    if not reqs:
        raise SpecError("the buckets' shares give no request; give more requests")
    order = np.random.default_rng(seed).permutation(len(reqs))
    base = Workload(tuple(Request(i, 0.0, *reqs[j]) for i, j in enumerate(order)), "buckets", 0, buckets.source)
    return with_arrivals(base, rate, seed, n=len(reqs))
