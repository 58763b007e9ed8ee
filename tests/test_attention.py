"""Packed-document attention: the mask, the local kernel, and Ulysses / ring against one process."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import cp_model_check, spawn

from flexmesh.errors import PlanError
from flexmesh.runtime.launch import free_port
from flexmesh.runtime.model.attention import attend, document_causal_mask, document_ids
from flexmesh.runtime.parallel.context import CPContext, context_attend

torch.set_num_threads(1)


def naive_attention(q, k, v, cu_seqlens):
    """Reference written independently of the module: one document at a time, plain softmax."""
    b, h, t, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    bounds = [int(x) for x in cu_seqlens] + ([t] if int(cu_seqlens[-1]) < t else [])
    out = torch.zeros_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        scores = q[:, :, s:e] @ k[:, :, s:e].transpose(-1, -2) / d ** 0.5
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        out[:, :, s:e] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, s:e]
    return out


def test_document_ids_and_mask_block_diagonal_causal():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert document_ids(cu, 7).tolist() == [0, 0, 0, 1, 1, 2, 2]
    m = document_causal_mask(cu, 0, 5, 0, 5, 5)
    for i in range(5):
        for j in range(5):
            same_doc = (i < 3) == (j < 3)
            assert bool(m[i, j]) == (same_doc and j <= i)
    # a block of the global mask equals the slice of the whole mask
    assert torch.equal(document_causal_mask(cu, 3, 2, 1, 3, 5), m[3:5, 1:4])


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_local_attend_matches_per_document_reference_fwd_bwd(h, hkv):
    torch.manual_seed(0)
    t, d = 23, 8
    cu = torch.tensor([0, 5, 6, 17, 20], dtype=torch.int32)  # 3 trailing tokens: their own document
    q = torch.randn(2, h, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, t, d, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, cu)
    ref = naive_attention(q, k, v, cu)
    assert torch.allclose(out, ref, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10)


def test_no_attention_across_documents():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    cu = torch.tensor([0, 4, 10])
    base = attend(q, k, v, cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4] += 5.0  # change only the first document's keys and values
    v2[:, :, :4] -= 3.0
    moved = attend(q, k2, v2, cu)
    # exact: the later documents' attention runs the same operations on the same inputs
    assert torch.equal(base[:, :, 4:], moved[:, :, 4:])
    assert not torch.allclose(base[:, :, :4], moved[:, :, :4])


def test_bad_head_counts_are_rejected():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(PlanError, match="multiple"):
        attend(q, k, k, torch.tensor([0, 4]))
    with pytest.raises(PlanError, match="ulysses"):
        CPContext("zigzag", None, 0, 2)


# ---- multi-process: Ulysses and ring against the single-process kernel ---------------------------------
# Each case: (query heads, kv heads, T, cu_seqlens). Documents straddle the ranks' slices, one case
# pads T with a trailing dummy document, one has a single long document.
CASES = [
    (4, 4, 16, [0, 3, 9, 16]),
    (4, 2, 24, [0, 1, 2, 13, 20]),  # GQA; tail 20..24 is padding
    (8, 2, 16, [0, 16]),            # one document over all ranks
    (4, 1, 12, [0, 7, 12]),         # kv heads fewer than cp: Ulysses repeats them
]


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        # cp = world, and cp = 2 on two disjoint sub-groups to exercise group-local ranks
        groups = [(list(range(world)), dist.group.WORLD)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
        if pairs:
            groups.append(([0, 1] if rank < 2 else [2, 3], pairs[rank // 2]))
        for ranks, group in groups:
            cp = len(ranks)
            me = ranks.index(rank)
            for kind in ("ulysses", "ring"):
                for case_no, (h, hkv, t, cu_list) in enumerate(CASES):
                    if kind == "ulysses" and h % cp:
                        continue
                    gen = torch.Generator().manual_seed(100 + case_no)  # same full tensors on every rank
                    q = torch.randn(1, h, t, 8, generator=gen)
                    k = torch.randn(1, hkv, t, 8, generator=gen)
                    v = torch.randn(1, hkv, t, 8, generator=gen)
                    dout = torch.randn(1, h, t, 8, generator=gen)
                    cu = torch.tensor(cu_list, dtype=torch.int32)
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                    ref = attend(*leaves, cu)
                    ref_grads = torch.autograd.grad(ref, leaves, dout)
                    n = t // cp
                    sl = slice(me * n, (me + 1) * n)
                    local = [x[:, :, sl].clone().requires_grad_() for x in (q, k, v)]
                    out = context_attend(*local, cu, CPContext(kind, group, me, cp))
                    # through a transpose, as in the model, so the incoming gradient is not contiguous
                    loss = (out.transpose(1, 2) * dout[:, :, sl].transpose(1, 2)).sum()
                    grads = torch.autograd.grad(loss, local)
                    label = f"{kind} cp={cp} case={case_no}"
                    torch.testing.assert_close(out, ref[:, :, sl], rtol=1e-5, atol=1e-5, msg=label)
                    for name, a, b in zip("qkv", grads, ref_grads):
                        torch.testing.assert_close(a, b[:, :, sl], rtol=1e-5, atol=1e-5,
                                                   msg=lambda m, name=name, label=label: f"{label} d{name}: {m}")
        _model_check(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _model_check(rank: int, world: int) -> None:
    """The whole model under context parallelism: same loss and gradients as one process."""
    from flexmesh.spec.model import ModelSpec

    cp_model_check(rank, world, ModelSpec("t", 2, 64, 4, 2, 96, 256, dtype="fp32"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ulysses_and_ring_match_single_process_forward_and_backward():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = 4
    spawn(_worker, (world, free_port()), world)
