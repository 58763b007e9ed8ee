"""Packing: turn one micro-batch of a StepSchedule into the tensors a rank feeds the model.

A micro-batch is a tuple of pieces ``(seq_id, start, end)``; each piece is tokens ``[start, end)``
of document ``docs[seq_id]``. The pieces are laid end to end in one row of ``T`` tokens and
attention must never look across a document boundary, so the batch carries ``cu_seqlens``, the
cumulative boundaries of the segments in that row.

Worked example: documents ``a = [10, 11, 12]`` and ``b = [20, 21, 22, 23]``, micro-batch
``(Piece(0, 0, 3), Piece(1, 0, 2))`` (all of ``a``, the first half of ``b``)::

    tokens     10   11   12   20   21
    labels     11   12 -100   21   22      # a ends here: no next token; b continues: 22 is known
    positions   0    1    2    0    1
    cu_seqlens [0, 3, 5]                   num_label_tokens = 4

The label of a piece's last token is the document's next token when the piece stops inside the
document (the other half of ``b`` goes to another micro-batch, where it starts at position 2 and
attends to this half's keys and values, carried by flexmesh.runtime.model.carry), and
-100 (ignored by cross-entropy) when the piece ends the document. Hence a document of length n
contributes exactly n - 1 label tokens however it is cut, which is what makes the loss independent
of the schedule (see :func:`global_label_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Piece, StepSchedule, merge_pieces

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
PAD_TOKEN = 0  # id fed for padding; its label is IGNORE_INDEX so its value never matters
PADDING_SLOT = -1  # the task slot of padding tokens (flexmesh.runtime.model.lora: no adapter)


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch of packed documents for one rank (before context-parallel sharding).

    ``cu_seqlens`` always describes the whole micro-batch; after :func:`shard_for_cp` the token
    tensors hold one contiguous slice while ``cu_seqlens`` stays global, as attention expects.
    """

    tokens: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T]; IGNORE_INDEX on each document's last token and on padding
    positions: torch.Tensor  # int64 [1, T]; position of each token inside its document
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1]; boundaries within the (global) T tokens
    num_label_tokens: int  # labels != IGNORE_INDEX held by this batch (this shard, once sharded)
    # The documents' pieces behind the first segments of cu_seqlens, in row order (padding has none).
    segments: tuple[Piece, ...] = ()
    # This micro-batch's view of the keys and values carried between micro-batches
    # (flexmesh.runtime.model.carry.CarryView; set by the trainer when a document is cut), else None.
    carry: Any = None
    # ``cu_seqlens`` on the host, kept by :meth:`to` so that nothing reads the device copy back.
    bounds: tuple[int, ...] = ()
    # With LoRA tasks (flexmesh.runtime.model.lora): (task slot, tokens) runs covering the row in order, and
    # each token's loss weight [1, T] (1 / its task's label tokens in the step; 0 on ignored labels).
    task_runs: tuple[tuple[int, int], ...] = ()
    weights: torch.Tensor | None = None
    # Tokens from the row's start that belong to documents (the rest is padding, which experts do not
    # route: flexmesh.runtime.model.moe); None: all of them.
    real_tokens: int | None = None
    # The whole row's tokens when this batch holds one rank's context-parallel slice of it
    # (:func:`shard_for_cp`); None: the batch is the whole row.
    row_tokens: int | None = None
    row_start: int = 0  # where this batch's tokens start in the whole row (a context-parallel slice's offset)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        """This batch on ``device``: on a GPU copied from pinned memory without waiting (the host's
        boundaries kept in ``bounds``)."""
        device = torch.device(device)
        bounds = self.bounds or tuple(int(x) for x in self.cu_seqlens.tolist())
        if device.type == self.tokens.device.type:
            return replace(self, bounds=bounds)
        cuda = device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)

        return replace(self, tokens=move(self.tokens), labels=move(self.labels), positions=move(self.positions),
                       cu_seqlens=move(self.cu_seqlens), bounds=bounds,
                       weights=None if self.weights is None else move(self.weights))


def _check_piece(docs: Sequence[np.ndarray], p: Piece) -> np.ndarray:
    if not 0 <= p.seq_id < len(docs):
        raise ScheduleError(
            f"piece {p} names document {p.seq_id} but the batch has {len(docs)} documents; "
            "build the schedule from the same batch that is packed"
        )
    doc = docs[p.seq_id]
    if not 0 <= p.start < p.end <= len(doc):
        raise ScheduleError(
            f"piece {p} lies outside document {p.seq_id} of {len(doc)} tokens; "
            "the schedule's lengths must be the documents' token counts"
        )
    return doc


def piece_label_tokens(doc_length: int, piece: Piece) -> int:
    """Label tokens a piece contributes: its length, less one when it ends its document."""
    return piece.length - (1 if piece.end == doc_length else 0)


def pack_microbatch(docs: Sequence[np.ndarray], pieces: Sequence[Piece],
                    tasks: Sequence[int] | np.ndarray | None = None,
                    task_weights: Sequence[float] | None = None) -> PackedBatch:
    """Lay ``pieces`` of ``docs`` end to end in one row (see the module docstring for an example).

    With ``tasks`` (the task slot of every document, flexmesh.runtime.model.lora) the pieces are laid task by
    task, in slot order (attention never crosses a document, so the order changes nothing else), the
    batch records the row's task runs, and, with ``task_weights`` (per slot), each label token's loss
    weight.
    """
    if not pieces:
        raise ScheduleError("a micro-batch has no pieces; drop empty micro-batches from the schedule")
    segments = merge_pieces(list(pieces))
    if tasks is not None:
        segments = sorted(segments, key=lambda p: tasks[p.seq_id])
    toks, labs, poss, bounds = [], [], [], [0]
    for p in segments:
        doc = np.asarray(_check_piece(docs, p), dtype=np.int64)
        toks.append(doc[p.start:p.end])
        lab = np.full(p.length, IGNORE_INDEX, dtype=np.int64)
        nxt = doc[p.start + 1:p.end + 1]  # shorter by one exactly when the piece ends the document
        lab[:len(nxt)] = nxt
        labs.append(lab)
        # Positions continue from the piece's offset so RoPE sees the document's own positions
        # even when the document's beginning sits in an earlier micro-batch.
        poss.append(np.arange(p.start, p.end, dtype=np.int64))
        bounds.append(bounds[-1] + p.length)
    labels = np.concatenate(labs)
    runs: list[tuple[int, int]] = []
    weights = None
    if tasks is not None:
        for p in segments:
            slot = int(tasks[p.seq_id])
            if runs and runs[-1][0] == slot:
                runs[-1] = (slot, runs[-1][1] + p.length)
            else:
                runs.append((slot, p.length))
        if task_weights is not None:
            per_token = np.concatenate([np.full(p.length, task_weights[tasks[p.seq_id]]) for p in segments])
            weights = torch.from_numpy(np.where(labels != IGNORE_INDEX, per_token, 0.0).astype(np.float32))[None, :]
    return PackedBatch(
        tokens=torch.from_numpy(np.concatenate(toks))[None, :],
        labels=torch.from_numpy(labels)[None, :],
        positions=torch.from_numpy(np.concatenate(poss))[None, :],
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
        segments=tuple(segments),
        task_runs=tuple(runs),
        weights=weights,
    )


def token_docs(batch: PackedBatch) -> np.ndarray:
    """The document (``seq_id``) of each of ``batch``'s tokens, -1 on padding; a context-parallel slice's
    tokens by its place in the row (``row_start``).

    >>> token_docs(pad_to(pack_microbatch([np.arange(3), np.arange(4)], [Piece(1, 0, 4), Piece(0, 1, 3)]), 8)).tolist()
    [1, 1, 1, 1, 0, 0, -1, -1]
    """
    bounds = batch.bounds or tuple(int(x) for x in batch.cu_seqlens.tolist())
    lo, out = batch.row_start, np.full(batch.num_tokens, -1, dtype=np.int64)
    for i, piece in enumerate(batch.segments):
        a, b = max(bounds[i] - lo, 0), min(bounds[i + 1] - lo, batch.num_tokens)
        if b > a:
            out[a:b] = piece.seq_id
    return out


def doc_label_tokens(docs: Sequence[np.ndarray], schedule: StepSchedule) -> np.ndarray:
    """Each document's label tokens in the step (0 for one the schedule defers), its pieces added."""
    out = np.zeros(len(docs), dtype=np.int64)
    for g in schedule.groups:
        for mb in g.microbatches:
            for p in mb:
                out[p.seq_id] += piece_label_tokens(len(_check_piece(docs, p)), p)
    return out


def global_label_tokens(docs: Sequence[np.ndarray], schedule: StepSchedule) -> int:
    """The step's loss normaliser: label tokens over all groups and micro-batches.

    Counts each context-parallel group once (its ranks share the micro-batches). Equals
    ``sum(len(d) - 1)`` over the scheduled (not deferred) documents when the schedule is valid.
    """
    return int(doc_label_tokens(docs, schedule).sum())


def pad_to(batch: PackedBatch, length: int) -> PackedBatch:
    """Append a dummy document so the batch holds ``length`` tokens (labels ignored).

    Used to give every micro-batch of a pipelined step the same shape, and to make T divisible by
    the context-parallel degree. The dummy is its own segment, so real tokens never attend to it.
    """
    t = batch.num_tokens
    if length < t:
        raise ScheduleError(f"cannot pad a micro-batch of {t} tokens down to {length}; raise the padded length")
    pad = length - t
    if pad == 0:
        return batch
    fill = torch.full((1, pad), PAD_TOKEN, dtype=batch.tokens.dtype, device=batch.tokens.device)
    return replace(
        batch,
        tokens=torch.cat([batch.tokens, fill], dim=1),
        labels=torch.cat([batch.labels, torch.full_like(fill, IGNORE_INDEX)], dim=1),
        positions=torch.cat([batch.positions, torch.arange(pad, device=fill.device)[None, :]], dim=1),
        cu_seqlens=torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_tensor([length])]),
        bounds=(*batch.bounds, length) if batch.bounds else (),
        task_runs=(*batch.task_runs, (PADDING_SLOT, pad)) if batch.task_runs else (),
        weights=None if batch.weights is None else torch.cat([batch.weights, batch.weights.new_zeros(1, pad)], dim=1),
        real_tokens=t if batch.real_tokens is None else batch.real_tokens,
    )


def pad_to_multiple(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Pad T up to the next multiple of ``multiple`` (e.g. the context-parallel degree)."""
    if multiple < 1:
        raise ScheduleError(f"padding multiple must be at least 1, got {multiple}")
    return pad_to(batch, -(-batch.num_tokens // multiple) * multiple)


def shard_for_cp(batch: PackedBatch, rank: int, size: int) -> PackedBatch:
    """Rank ``rank``'s contiguous 1/``size`` slice of a micro-batch; ``cu_seqlens`` stays global.

    Example: T = 8, size = 2: rank 0 holds tokens [0, 4), rank 1 tokens [4, 8). ``num_label_tokens``
    counts the slice's own labels, so the shards of a micro-batch sum to the whole; ``row_tokens`` is T.
    """
    if not 0 <= rank < size:
        raise ScheduleError(f"context-parallel rank {rank} is outside a group of {size}")
    t = batch.num_tokens
    if t % size:
        raise ScheduleError(f"a micro-batch of {t} tokens does not split {size} ways; "
                            "pad it with pad_to_multiple first")
    n = t // size
    sl = slice(rank * n, (rank + 1) * n)
    labels = batch.labels[:, sl]
    runs, start = [], 0
    for slot, length in batch.task_runs:  # the runs' parts inside the slice
        part = min(start + length, sl.stop) - max(start, sl.start)
        if part > 0:
            runs.append((slot, part))
        start += length
    real = None if batch.real_tokens is None else min(n, max(0, batch.real_tokens - sl.start))
    return replace(batch, tokens=batch.tokens[:, sl], labels=labels, positions=batch.positions[:, sl],
                   num_label_tokens=int((labels != IGNORE_INDEX).sum()), task_runs=tuple(runs),
                   weights=None if batch.weights is None else batch.weights[:, sl], real_tokens=real, row_tokens=t,
                   row_start=sl.start)


def rank_microbatches(docs: Sequence[np.ndarray], schedule: StepSchedule, data_rank: int) -> list[PackedBatch]:
    """The packed micro-batches data rank ``data_rank`` runs this step, already sharded for its group.

    A group of cp ranks pads each micro-batch to a multiple of cp and gives each member its slice;
    a group of one rank gets the micro-batches unpadded.
    """
    for g in schedule.groups:
        if data_rank in g.ranks:
            i = g.ranks.index(data_rank)
            out = []
            for mb in g.microbatches:
                b = pack_microbatch(docs, mb)
                if g.cp > 1:
                    b = shard_for_cp(pad_to_multiple(b, g.cp), i, g.cp)
                out.append(b)
            return out
    raise ScheduleError(f"data rank {data_rank} is in no group of the schedule; give every data rank a group")


def empty_batch(length: int, tasks: bool = False) -> PackedBatch:
    """A micro-batch with no label tokens: keeps collectives paired when a group has fewer micro-batches.
    With ``tasks`` its tokens are padding of a LoRA run, so every adapter runs (and gets a zero gradient)."""
    return PackedBatch(
        task_runs=((PADDING_SLOT, length),) if tasks else (),
        weights=torch.zeros(1, length) if tasks else None,
        tokens=torch.full((1, length), PAD_TOKEN, dtype=torch.long),
        labels=torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
        positions=torch.arange(length)[None, :],
        cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
        num_label_tokens=0,
        real_tokens=0,
    )
