"""PackedBatch construction: every token once, labels stay inside documents, positions, normaliser."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Group, Piece, StepSchedule
from flexmesh.runtime.model.packing import (
    IGNORE_INDEX,
    global_label_tokens,
    pack_microbatch,
    pad_to,
    pad_to_multiple,
    rank_microbatches,
    shard_for_cp,
)

STRIDE = 10_000  # token id = doc * STRIDE + position: every token names its own origin


def _docs(lengths: list[int]) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.int64) + i * STRIDE for i, n in enumerate(lengths)]


@st.composite
def _schedules(draw):
    """Random documents, each cut into random pieces, dealt to random groups and micro-batches."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    pieces = []
    for sid, n in enumerate(lengths):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        bounds = [0, *cuts, n]
        pieces += [Piece(sid, a, b) for a, b in zip(bounds, bounds[1:])]
    order = draw(st.permutations(pieces))
    n_groups = draw(st.integers(1, 3))
    cps = [draw(st.sampled_from([1, 2, 4])) for _ in range(n_groups)]
    slots: dict[tuple[int, int], list[Piece]] = {}
    for p in order:
        slots.setdefault((draw(st.integers(0, n_groups - 1)), draw(st.integers(0, 2))), []).append(p)
    groups, rank = [], 0
    for g in range(n_groups):
        mbs = tuple(tuple(slots[(g, m)]) for m in range(3) if (g, m) in slots)
        groups.append(Group(ranks=tuple(range(rank, rank + cps[g])), microbatches=mbs))
        rank += cps[g]
    sched = StepSchedule(lengths=tuple(lengths), groups=tuple(groups), policy="test")
    sched.validate()
    return lengths, sched


def _check_batch(b, lengths: list[int]) -> list[int]:
    """Assert the per-token invariants of one packed batch; return the token ids it holds."""
    tok, lab, pos = b.tokens[0].tolist(), b.labels[0].tolist(), b.positions[0].tolist()
    cu = b.cu_seqlens.tolist()
    assert b.tokens.shape == b.labels.shape == b.positions.shape == (1, len(tok))
    assert b.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == len(tok)
    for a, e in zip(cu, cu[1:]):
        docs_in_segment = {t // STRIDE for t in tok[a:e]}
        assert len(docs_in_segment) == 1, "a segment mixes documents"
        assert pos[a:e] == list(range(pos[a], pos[a] + e - a)), "positions are not consecutive in a segment"
    for t, label, p in zip(tok, lab, pos):
        doc, j = divmod(t, STRIDE)
        assert p == j, "position is not the token's place in its document"
        want = t + 1 if j + 1 < lengths[doc] else IGNORE_INDEX
        assert label == want, "label is not the next token of the same document"
    assert b.num_label_tokens == sum(1 for x in lab if x != IGNORE_INDEX)
    return tok


@settings(max_examples=60, deadline=None)
@given(_schedules())
def test_every_token_placed_once_with_document_local_labels(case) -> None:
    lengths, sched = case
    docs = _docs(lengths)
    seen: list[int] = []
    label_total = 0
    for g in sched.groups:
        for mb in g.microbatches:
            b = pack_microbatch(docs, mb)
            seen += _check_batch(b, lengths)
            label_total += b.num_label_tokens
    assert sorted(seen) == sorted(int(t) for d in docs for t in d)
    assert label_total == global_label_tokens(docs, sched) == sum(n - 1 for n in lengths)


@settings(max_examples=40, deadline=None)
@given(_schedules())
def test_cp_shards_reassemble_and_count_labels(case) -> None:
    lengths, sched = case
    docs = _docs(lengths)
    per_rank = {r: rank_microbatches(docs, sched, r) for g in sched.groups for r in g.ranks}
    total = 0
    for g in sched.groups:
        for m, mb in enumerate(g.microbatches):
            whole = pack_microbatch(docs, mb)
            shards = [per_rank[r][m] for r in g.ranks]
            assert all(s.cu_seqlens.tolist() == shards[0].cu_seqlens.tolist() for s in shards)
            joined = torch.cat([s.tokens for s in shards], dim=1)
            assert joined.shape[1] % g.cp == 0 and joined.shape[1] - whole.num_tokens < g.cp
            assert torch.equal(joined[:, :whole.num_tokens], whole.tokens)
            assert torch.equal(torch.cat([s.labels for s in shards], dim=1)[:, :whole.num_tokens], whole.labels)
            total += sum(s.num_label_tokens for s in shards)
    assert total == global_label_tokens(docs, sched)


def test_worked_example_cut_document_keeps_next_token_label() -> None:
    a, b = np.array([10, 11, 12]), np.array([20, 21, 22, 23])
    first = pack_microbatch([a, b], (Piece(0, 0, 3), Piece(1, 0, 2)))
    assert first.tokens.tolist() == [[10, 11, 12, 20, 21]]
    assert first.labels.tolist() == [[11, 12, -100, 21, 22]]
    assert first.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert first.cu_seqlens.tolist() == [0, 3, 5]
    assert first.num_label_tokens == 4
    rest = pack_microbatch([a, b], (Piece(1, 2, 4),))
    assert rest.labels.tolist() == [[23, -100]] and rest.positions.tolist() == [[2, 3]]


def test_contiguous_pieces_of_one_document_form_one_segment() -> None:
    d = np.arange(6)
    b = pack_microbatch([d], (Piece(0, 0, 2), Piece(0, 2, 6)))
    assert b.cu_seqlens.tolist() == [0, 6]
    assert b.labels.tolist() == [[1, 2, 3, 4, 5, -100]]


def test_padding_is_a_separate_ignored_document() -> None:
    b = pad_to(pack_microbatch([np.arange(5)], (Piece(0, 0, 5),)), 8)
    assert b.tokens.shape == (1, 8) and b.cu_seqlens.tolist() == [0, 5, 8]
    assert b.labels[0, 4:].tolist() == [IGNORE_INDEX] * 4 and b.num_label_tokens == 4
    assert b.positions[0, 5:].tolist() == [0, 1, 2]
    assert pad_to_multiple(b, 4) is b


def test_shard_for_cp_slices_contiguously() -> None:
    b = pack_microbatch([np.arange(8)], (Piece(0, 0, 8),))
    s1 = shard_for_cp(b, 1, 2)
    assert s1.tokens.tolist() == [[4, 5, 6, 7]] and s1.cu_seqlens.tolist() == [0, 8]
    assert s1.num_label_tokens == 3
    with pytest.raises(ScheduleError, match="pad_to_multiple"):
        shard_for_cp(b, 0, 3)


@pytest.mark.parametrize("pieces, msg", [
    ((Piece(2, 0, 1),), "names document 2"),
    ((Piece(0, 0, 9),), "outside document 0"),
    ((), "no pieces"),
])
def test_bad_pieces_raise_clear_errors(pieces, msg) -> None:
    with pytest.raises(ScheduleError, match=msg):
        pack_microbatch([np.arange(4), np.arange(3)], pieces)


def test_pad_cannot_shrink_and_unknown_rank_errors() -> None:
    b = pack_microbatch([np.arange(4)], (Piece(0, 0, 4),))
    with pytest.raises(ScheduleError, match="down to"):
        pad_to(b, 2)
    sched = StepSchedule(lengths=(4,), groups=(Group((0,), ((Piece(0, 0, 4),),)),), policy="t")
    with pytest.raises(ScheduleError, match="no group"):
        rank_microbatches([np.arange(4)], sched, 3)
