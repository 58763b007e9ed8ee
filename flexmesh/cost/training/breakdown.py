"""A predicted step split term by term, to say where one plan gains over another.

:meth:`CostModel.evaluate_stages` reports four parts (compute, exposed communication, bubble, sync +
optimizer). :func:`step_terms` splits them further, on the busiest pipeline rank as the evaluation
does: compute without recomputation, the recomputed forward, TP and context-parallel communication
left exposed, ZeRO's per-micro-batch communication left exposed, resharding between layer meshes and
pipeline sends (with a model profile's framework seconds per pipeline chunk, which
:meth:`CostModel.pipeline_p2p` adds to them), the bubble, the exposed data-parallel gradient sync and
the optimizer step. The terms add up to the step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.work import LayerCost
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy, Recompute, chunk_anchors

TERMS = ("compute", "recompute", "exposed TP/CP comm", "exposed ZeRO comm", "resharding + pipeline sends",
         "pipeline bubble", "exposed DP gradient sync", "optimizer")


def step_terms(cost: CostModel, chunks: Sequence[Sequence[LayerStrategy]], pp: int, schedule: str, m: int, v: int,
               microbatch_seqs: int, seq_len: int, overlap: Overlap = NO_OVERLAP) -> dict[str, float]:
    """Seconds per step of each of :data:`TERMS` (see the module docstring), summing to the step time.

    >>> from flexmesh.spec import parse_cluster, parse_model
    >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    >>> chunks = [(LayerStrategy(tp=2, dp=4, zero=3, recompute=True),) * 32]
    >>> t = step_terms(cm, chunks, 1, "1f1b", 4, 1, 8, 4096)
    >>> ev = cm.evaluate_stages(chunks, 1, "1f1b", 4, 1, 8, 4096)
    >>> round(float(sum(t.values()) / ev.step_time), 9), t["recompute"] > 0, t["exposed TP/CP comm"] > 0
    (1.0, True, True)
    """
    ev = cost.evaluate_stages(chunks, pp, schedule, m, v, microbatch_seqs, seq_len, overlap)
    ov = cost.effective_overlap(overlap, m)
    n = len(chunks)
    anchors = chunk_anchors(chunks, pp)
    busiest = int(np.argmax(ev.stage_times))
    compute = recompute = tp_cp = zero = 0.0
    for i in range(busiest, n, pp):
        for s in chunks[i]:
            work = cost.layer_work(s, microbatch_seqs, seq_len)
            c = cost.layer(s, work, ov)
            plain = cost.layer(replace(s, recompute=Recompute.NONE), work, ov)
            unsharded = cost.layer(replace(s, zero=0), work, ov)  # no ZeRO collective in a micro-batch
            compute += plain.fwd + plain.bwd
            recompute += c.bwd - plain.bwd
            tp_cp += unsharded.comm_fwd + unsharded.comm_bwd
            zero += c.comm_fwd + c.comm_bwd - unsharded.comm_fwd - unsharded.comm_bwd
        if i in (0, n - 1):
            first, last = (chunks[i] or anchors[i:i + 1])[0], (chunks[i] or anchors[i:i + 1])[-1]
            for s, embed, head in ((first, True, False), (last, False, True)):
                if (embed and i == 0) or (head and i == n - 1):
                    e = cost.ends(s, cost.layer_work(s, microbatch_seqs, seq_len), embed, head, ov)
                    compute += e.fwd + e.bwd
                    zero += e.comm_fwd + e.comm_bwd
    terms = {"compute": m * compute, "recompute": m * recompute, "exposed TP/CP comm": m * tp_cp,
             "exposed ZeRO comm": m * zero}
    terms["resharding + pipeline sends"] = ev.exposed_comm - m * (tp_cp + zero)
    terms["pipeline bubble"] = ev.bubble
    # The tail is the slowest rank's exposed sync + optimizer; split it on that rank.
    tails = []
    for r in range(pp):
        rc = sum((cost.stage_cost(chunks[i], microbatch_seqs, seq_len, i == 0, i == n - 1, ov, anchors[i])
                  for i in range(r, n, pp)), start=LayerCost())
        layers = sum(len(chunks[i]) for i in range(r, n, pp))
        tails.append((float(cost.exposed_sync(rc.grad_sync, rc.bwd, layers)), rc.optim))
    sync, optim = max(tails, key=lambda x: x[0] + x[1])
    terms["exposed DP gradient sync"], terms["optimizer"] = sync, optim
    return {k: float(x) for k, x in terms.items()}
