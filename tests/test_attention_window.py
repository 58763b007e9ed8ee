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
from helpers import cp_model_check, spawn

from flexmesh.runtime.launch import free_port
from flexmesh.runtime.model import attention_kernels as AK
from flexmesh.runtime.model.attention import attend, document_causal_mask, flash_window_size
from flexmesh.runtime.parallel.context import CPContext, context_attend, ring_steps

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
            assert bool(AK.window_causal(torch.tensor(i), torch.tensor(j), 3)) == want, (i, j)


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
    monkeypatch.setattr(AK, "WINDOW_BLOCK", block)  # small blocks: several query blocks per document
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
    # exact: a window longer than every document runs the same operations
    assert torch.equal(attend(q, k, v, cu, window=23), attend(q, k, v, cu))
    assert not torch.allclose(attend(q, k, v, cu, window=22), attend(q, k, v, cu))


def flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, left: int, right: int, gqa: bool):
    """A model of the flash varlen kernels' documented semantics on [T, H, D] rows, for faking them:
    where a sequence has more keys than queries, the queries are its last positions (bottom-right)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    qs, ks = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())), list(zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))
    # the host's figures, no device read
    assert (max_q, max_k) == (max(b - a for a, b in qs), max(b - a for a, b in ks))
    assert gqa or q.shape[1] == k.shape[1], "grouped heads passed to a kernel told they are not grouped"
    out = torch.zeros_like(q)
    for (a, b), (c, e) in zip(qs, ks):
        i = torch.arange(b - a)[:, None] + (e - c) - (b - a)  # query positions among the keys
        j = torch.arange(e - c)[None, :]
        ok = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
        g = q.shape[1] // k.shape[1]
        kk, vv = k[c:e].repeat_interleave(g, 1), v[c:e].repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) / q.shape[-1] ** 0.5
        out[a:b] = torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, float("-inf")).softmax(-1), vv)
    return out


def varlen_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's signature: causality is the window (-1, 0), GQA a flag."""
    return flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *window_size, enable_gqa)


def varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
    """torch 2.10-2.11's signature: is_causal, no windows, no GQA."""
    return flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, -1, 0 if is_causal else -1, False)


def fake_flash_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
    assert causal
    return flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, window_size[0], 0, True)


@pytest.mark.parametrize("fake,windows", [(varlen_2_13, True), (varlen_2_11, False)])
def test_torch_varlen_path_reads_the_signature(monkeypatch, fake, windows):
    """PyTorch's varlen kernel, replaced by a model of its semantics under each signature it has had:
    the call gives the reference, and a torch without windows is not picked for a windowed layer."""
    import inspect

    monkeypatch.setattr(AK, "_torch_varlen", lambda: (fake, frozenset(inspect.signature(fake).parameters)))
    kernel = AK.KERNELS["varlen"]
    assert kernel.serves("cuda", torch.bfloat16, None, 64, True)
    assert kernel.serves("cuda", torch.bfloat16, 4, 64, True) is windows
    assert not kernel.serves("cuda", torch.float32, None, 64, False)  # flash kernels: fp16/bf16 only
    assert not kernel.serves("cpu", torch.bfloat16, None, 64, False)
    assert not kernel.serves("cuda", torch.bfloat16, None, 320, False)  # head_dim above flash's 256
    torch.manual_seed(3)
    q, k = torch.randn(2, 4, 45, 8, dtype=torch.float64), torch.randn(2, 2, 45, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 45, 8, dtype=torch.float64)
    for window in (None, 3, 12) if windows else (None,):
        got = kernel.run(q, k, v, AK.Documents(torch.tensor(DOCS, dtype=torch.int32), total=45), window)
        torch.testing.assert_close(got, dense_reference(q, k, v, DOCS, window), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", ["varlen", "flash-attn"])
def test_suffix_path_of_the_varlen_kernels_matches_sdpa(monkeypatch, kernel):
    """A cut document's piece after its carried prefix: n queries over m > n keys, each kernel's
    ``suffix`` (faked by the documented semantics) against the SDPA suffix with its explicit mask."""
    import inspect

    params = frozenset(inspect.signature(varlen_2_13).parameters)
    monkeypatch.setattr(AK, "_torch_varlen", lambda: (varlen_2_13, params))
    monkeypatch.setattr(AK, "_flash_attn", lambda: fake_flash_attn)
    torch.manual_seed(5)
    q = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 70, 8, dtype=torch.float64), torch.randn(1, 2, 70, 8, dtype=torch.float64)
    for window in (None, 5, 45):
        want = AK.suffix_attention(q, k, v, window, kernel="sdpa")
        torch.testing.assert_close(AK.KERNELS[kernel].suffix(q, k, v, window), want, rtol=1e-10, atol=1e-10)
    # queries [40, 70) of one document, as a dense reference: the last 30 rows of the whole document's attention
    whole = dense_reference(torch.randn(1, 4, 70, 8, dtype=torch.float64).index_copy(2, torch.arange(40, 70), q),
                            k, v, [0, 70], 5)
    torch.testing.assert_close(AK.suffix_attention(q, k, v, 5, kernel="sdpa"), whole[:, :, 40:], rtol=1e-10,
                               atol=1e-10)


def test_flash_attn_path_passes_the_window(monkeypatch):
    """The flash-attn varlen call, replaced by a model of its documented semantics, gives the reference."""
    monkeypatch.setattr(AK, "_flash_attn", lambda: fake_flash_attn)
    torch.manual_seed(3)
    q, k = torch.randn(2, 4, 45, 8, dtype=torch.float64), torch.randn(2, 2, 45, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 45, 8, dtype=torch.float64)
    for window in (None, 3, 12):
        got = AK.KERNELS["flash-attn"].run(q, k, v, AK.Documents(torch.tensor(DOCS, dtype=torch.int32), total=45),
                                           window)
        torch.testing.assert_close(got, dense_reference(q, k, v, DOCS, window), rtol=1e-10, atol=1e-10)


def test_kernel_choice_order(monkeypatch):
    """CUDA bf16 takes PyTorch's varlen kernel, then flash-attn, then FlexAttention; fp32 and CPU what serves them."""
    import inspect

    params = frozenset(inspect.signature(varlen_2_11).parameters)
    monkeypatch.setattr(AK, "_torch_varlen", lambda: (varlen_2_11, params))
    monkeypatch.setattr(AK, "_flash_attn", lambda: fake_flash_attn)
    assert AK.select_kernel("cuda", torch.bfloat16, None, 64, True).name == "varlen"
    assert AK.select_kernel("cuda", torch.bfloat16, 4096, 64, True).name == "flash-attn"  # 2.11: no windows
    assert AK.select_kernel("cuda", torch.float32, None, 64, True).name == "flex"
    assert AK.select_kernel("cpu", torch.bfloat16, 4, 64, True).name == "sdpa"
    monkeypatch.setattr(AK, "_flash_attn", lambda: None)
    assert AK.select_kernel("cuda", torch.bfloat16, 4096, 64, True).name == "flex"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_mask_mod_with_window(monkeypatch):
    """FlexAttention's path on CPU, eager (the GPU compiles it); the block mask is built once per row
    and window, and shared (the cache of the row's Documents)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(AK, "_flex", lambda: (flex.flex_attention, flex.create_block_mask))
    torch.manual_seed(4)
    t = 48  # eager FlexAttention wants whole 16-token blocks on CPU
    cu = [0, 5, 6, 17, 40]
    q, k, v = (torch.randn(1, 2, t, 16) for _ in range(3))
    docs = AK.Documents(torch.tensor(cu, dtype=torch.int32), total=t)
    for window in (None, 4):
        try:
            got = AK.KERNELS["flex"].run(q, k, v, docs, window)
        except Exception as e:  # pragma: no cover - CPU support of FlexAttention varies by build
            pytest.skip(f"FlexAttention does not run on this CPU build: {e}")
        torch.testing.assert_close(got, dense_reference(q, k, v, cu, window), rtol=1e-5, atol=1e-5)
        mask = AK.flex_block_mask(docs, window, q.device, compile_mask=False)
        assert AK.flex_block_mask(docs, window, q.device, compile_mask=False) is mask  # built once per row


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
                    out = context_attend(*local, torch.tensor(cu_list, dtype=torch.int32),
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
    spawn(_worker, (world, free_port()), world)


def test_cost_model_ring_hops_are_the_runtime_ring_steps():
    from dataclasses import replace

    from flexmesh.cost import CostModel
    from flexmesh.spec import parse_cluster, parse_model

    for window in (1, 2, 5, 8, 9, 17, 40):
        cm = CostModel(replace(parse_model("tiny"), sliding_window=window), parse_cluster("8xA100-80GB"))
        for cp in (2, 4, 8):
            for block in (1, 3, 8):
                assert cm.ring_hops(cp, float(block)) == ring_steps(cp, block, window) - 1, (window, cp, block)
