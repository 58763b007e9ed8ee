"""Sliding-window attention: every kernel path against a dense reference with an explicit mask.

Convention under test (transformers' ``sliding_window_causal``): with window w, query i of a document
sees keys j of the same document with i - w < j <= i.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import cp_model_check

from flexmesh.runtime import attention as A
from flexmesh.runtime.attention import CPContext, attend, document_causal_mask, flash_window_size, ring_steps
from flexmesh.runtime.launch import free_port

torch.set_num_threads(1)


def brute_mask(cu: list[int], t: int, window: int | None) -> torch.Tensor:
    """[t, t] allowed(i, j), written with loops independently of the module (padding: one more document)."""
    bounds = list(cu) + ([t] if cu[-1] < t else [])
    doc = [next(n for n in range(len(bounds) - 1) if bounds[n] <= i < bounds[n + 1]) for i in range(t)]
    m = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        for j in range(t):
            m[i, j] = doc[i] == doc[j] and j <= i and (window is None or i - j < window)
    return m


def dense_reference(q, k, v, cu: list[int], window: int | None):
    """Plain softmax over the whole row with the explicit mask."""
    t, d = q.shape[2], q.shape[3]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    return scores.masked_fill(~brute_mask(cu, t, window), float("-inf")).softmax(-1) @ v


# ---- mask logic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 2, 3, 7])
def test_document_mask_with_window_equals_brute_force(window):
    cu = [0, 3, 11, 12]
    t = 14
    full = brute_mask(cu, t, window)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    assert torch.equal(document_causal_mask(cu_t, 0, t, 0, t, t, window), full)
    # blocks with global positions are slices of the whole mask (what ring attention relies on)
    assert torch.equal(document_causal_mask(cu_t, 7, 7, 3, 4, t, window), full[7:14, 3:7])


def test_window_convention_matches_transformers_when_available():
    masking = pytest.importorskip("transformers.masking_utils")
    fn = masking.sliding_window_causal_mask_function(3)
    for i in range(8):
        for j in range(8):
            want = bool(fn(0, 0, torch.tensor(i), torch.tensor(j)))
            assert bool(A.window_causal(torch.tensor(i), torch.tensor(j), 3)) == want, (i, j)


def test_flash_window_size_is_flash_attn_convention():
    # flash-attn: query i sees keys in [i - left, i + right]; causal already bounds the right side.
    left, right = flash_window_size(5)
    assert (left, right) == (4, 0)
    assert flash_window_size(None) == (-1, -1)


@pytest.mark.parametrize("cp,block", [(2, 4), (4, 3), (4, 8)])
def test_ring_steps_cover_exactly_the_blocks_in_reach(cp, block):
    t = cp * block
    for window in [None, *range(1, t + 2)]:
        full = brute_mask([0, t], t, window)
        needed = 1 + max((r - j for r in range(cp) for j in range(r + 1)
                          if full[r * block:(r + 1) * block, j * block:(j + 1) * block].any()), default=0)
        assert ring_steps(cp, block, window) == needed, window


# ---- local kernels --------------------------------------------------------------------------------
DOCS = [0, 5, 6, 17, 40]  # lengths 5, 1, 11, 23; tail 40..45 is padding (its own document)


@pytest.mark.parametrize("window", [1, 4, 6, 12, 100])
@pytest.mark.parametrize("block", [2, 256])
def test_cpu_windowed_attention_matches_dense_reference_fwd_bwd(monkeypatch, window, block):
    monkeypatch.setattr(A, "WINDOW_BLOCK", block)  # small blocks: several query blocks per document
    torch.manual_seed(0)
    t, h, hkv, d = 45, 4, 2, 8
    q = torch.randn(2, h, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, t, d, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, torch.tensor(DOCS, dtype=torch.int32), window=window)
    ref = dense_reference(q, k, v, DOCS, window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_window_longer_than_every_document_changes_nothing():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 45, 8) for _ in range(3))
    cu = torch.tensor(DOCS)
    assert torch.equal(attend(q, k, v, cu, window=23), attend(q, k, v, cu))
    assert not torch.allclose(attend(q, k, v, cu, window=22), attend(q, k, v, cu))


def test_flash_path_passes_the_window(monkeypatch):
    """The flash-attn varlen call, replaced by a model of its documented semantics, gives the reference."""
    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        assert causal
        left, right = window_size
        out = torch.zeros_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            i = torch.arange(b - a)[:, None]
            j = torch.arange(b - a)[None, :]
            ok = (j <= i) & ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
            g = q.shape[1] // k.shape[1]
            kk, vv = k[a:b].repeat_interleave(g, 1), v[a:b].repeat_interleave(g, 1)
            s = torch.einsum("qhd,khd->hqk", q[a:b], kk) / q.shape[-1] ** 0.5
            out[a:b] = torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, float("-inf")).softmax(-1), vv)
        return out

    monkeypatch.setattr(A, "_flash_varlen", fake_varlen)
    torch.manual_seed(3)
    q, k = torch.randn(2, 4, 45, 8, dtype=torch.float64), torch.randn(2, 2, 45, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 45, 8, dtype=torch.float64)
    for window in (None, 3, 12):
        got = A._local_flash(q, k, v, torch.tensor(DOCS, dtype=torch.int32), window)
        torch.testing.assert_close(got, dense_reference(q, k, v, DOCS, window), rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_mask_mod_with_window(monkeypatch):
    """FlexAttention's path on CPU, eager (the GPU compiles it); the mask_mod is the code under test."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(A, "_compiled_flex", flex.flex_attention)
    torch.manual_seed(4)
    t = 48  # eager FlexAttention wants whole 16-token blocks on CPU
    cu = [0, 5, 6, 17, 40]
    q, k, v = (torch.randn(1, 2, t, 16) for _ in range(3))
    for window in (None, 4):
        try:
            got = A._local_flex(q, k, v, torch.tensor(cu, dtype=torch.int32), window)
        except Exception as e:  # pragma: no cover - CPU support of FlexAttention varies by build
            pytest.skip(f"FlexAttention does not run on this CPU build: {e}")
        torch.testing.assert_close(got, dense_reference(q, k, v, cu, window), rtol=1e-5, atol=1e-5)


# ---- multi-process: Ulysses and ring against the dense reference ---------------------------------------
# (query heads, kv heads, T, cu_seqlens, windows); documents straddle the ranks' slices.
CP_CASES = [
    (4, 2, 24, [0, 3, 20], [1, 3, 6, 7, 13, 100]),  # GQA; tail 20..24 is padding
    (4, 4, 16, [0, 16], [2, 5, 9]),                 # one document over all ranks
]


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for kind in ("ulysses", "ring"):
            for case_no, (h, hkv, t, cu_list, windows) in enumerate(CP_CASES):
                for window in windows:
                    gen = torch.Generator().manual_seed(200 + case_no)  # same full tensors on every rank
                    q, k, v, dout = (torch.randn(1, n, t, 8, generator=gen) for n in (h, hkv, hkv, h))
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                    ref = dense_reference(*leaves, cu_list, window)
                    ref_grads = torch.autograd.grad(ref, leaves, dout)
                    n = t // world
                    sl = slice(rank * n, (rank + 1) * n)
                    local = [x[:, :, sl].clone().requires_grad_() for x in (q, k, v)]
                    out = attend(*local, torch.tensor(cu_list, dtype=torch.int32),
                                 CPContext(kind, dist.group.WORLD, rank, world), window)
                    grads = torch.autograd.grad((out.transpose(1, 2) * dout[:, :, sl].transpose(1, 2)).sum(), local)
                    label = f"{kind} cp={world} case={case_no} window={window}"
                    torch.testing.assert_close(out, ref[:, :, sl], rtol=1e-5, atol=1e-5, msg=label)
                    for name, a, b in zip("qkv", grads, ref_grads):
                        torch.testing.assert_close(a, b[:, :, sl], rtol=1e-5, atol=1e-5,
                                                   msg=lambda m, name=name, label=label: f"{label} d{name}: {m}")
        _model_check(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _model_check(rank: int, world: int) -> None:
    """A model with windows on some layers, under Ulysses and ring: the loss and gradients of one process."""
    from flexmesh.spec.model import ModelSpec

    cp_model_check(rank, world,
                   ModelSpec("t", 2, 64, 4, 2, 96, 256, dtype="fp32", sliding_window=5, window_layers=(True, False)),
                   plain=ModelSpec("t", 2, 64, 4, 2, 96, 256, dtype="fp32"))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_and_ring_with_window_match_dense_reference(world):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)


def test_cost_model_ring_hops_are_the_runtime_ring_steps():
    from dataclasses import replace

    from flexmesh.cost import CostModel
    from flexmesh.spec import parse_cluster, parse_model

    for window in (1, 2, 5, 8, 9, 17, 40):
        cm = CostModel(replace(parse_model("tiny"), sliding_window=window), parse_cluster("8xA100-80GB"))
        for cp in (2, 4, 8):
            for block in (1, 3, 8):
                assert cm.ring_hops(cp, float(block)) == ring_steps(cp, block, window) - 1, (window, cp, block)
