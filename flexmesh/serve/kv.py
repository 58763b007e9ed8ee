"""The KV cache of one replica: blocks the scheduler asks for, and a prefix cache over block ids (LRU, bounded).

Blocks hold ``block_tokens`` tokens each (vLLM's paged KV cache). A request holds its own blocks; the
blocks of its prompt's whole prefix blocks (ids of ``prefix_tokens`` tokens each: a trace's ``hash_ids``) are
entries of the prefix cache once computed, shared by every request whose prompt starts with the same ids.
An entry no request refers to stays cached and counts as free: it is evicted, least recently released first,
when an allocation needs its blocks (as vLLM's free-block queue evicts cached blocks), or when more than
``cap_blocks`` of them are kept.

>>> kv = KVBlocks(total=100, block_tokens=16, prefix_tokens=64)  # an entry is 4 blocks
>>> kv.allocate(10); kv.free
90
>>> kv.insert((7, 8), already=0)  # a request's first two prefix blocks (8 of its 10 blocks) become entries
>>> kv.own, kv.used, kv.lookup((7, 8, 9))
(2, 10, 2)
>>> kv.release(2); kv.unref((7, 8)); kv.used, kv.free  # its entries stay cached, evictable
(0, 92)
>>> kv.allocate(95); kv.lookup((7, 8)), kv.lookup((8,)), kv.free  # the allocation evicted the older entry
(0, 1, 1)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flexmesh.errors import SpecError


class KVBlocks:
    """Block counts of one replica's KV cache (one device's: every device of a replica holds the same blocks)."""

    def __init__(self, total: int, block_tokens: int, prefix_tokens: int = 0, cap_blocks: int | None = None,
                 entry_groups: int = 1):
        if prefix_tokens and prefix_tokens % block_tokens:
            raise SpecError(f"prefix blocks of {prefix_tokens} tokens are not whole KV blocks of {block_tokens}; give "
                            "a KV block size that divides them (--block-tokens) or turn prefix caching off")
        self.total = total
        self.block_tokens = block_tokens
        self.prefix_tokens = prefix_tokens  # 0: no prefix cache
        # blocks of one prefix entry: a block per ``block_tokens`` in each of the ``entry_groups`` KV groups that
        # keep a whole prefix (with sliding layers, the full-attention ones: flexmesh.serve.replica's module doc)
        self.entry_blocks = prefix_tokens // block_tokens * entry_groups if prefix_tokens else 0
        self.cap_blocks = cap_blocks
        self.own = 0  # blocks requests hold outside the prefix cache
        self.refs: dict[int, int] = {}  # cached ids and the requests referring to them
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached ids no request refers to, oldest first
        self.hits = self.lookups = 0  # prefix blocks found / asked for at admissions

    @property
    def cached_blocks(self) -> int:
        return len(self.refs) * self.entry_blocks

    @property
    def free(self) -> int:
        """Blocks no one holds, evictable cached ones not counted."""
        return self.total - self.own - self.cached_blocks

    @property
    def used(self) -> int:
        """Blocks requests hold, their own and the cached ones they refer to (what vLLM reports as KV usage)."""
        return self.own + (len(self.refs) - len(self.idle)) * self.entry_blocks

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= self.free + len(self.idle) * self.entry_blocks

    def allocate(self, blocks: int) -> None:
        """Take ``blocks`` for a request, evicting idle cached entries as needed (check :meth:`can_allocate`)."""
        while self.free < blocks:
            oldest, _ = self.idle.popitem(last=False)
            del self.refs[oldest]
        self.own += blocks

    def release(self, blocks: int) -> None:
        self.own -= blocks

    # ---- the prefix cache ------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int]) -> int:
        """How many of ``ids``, from the first, are cached (a prefix matches only as far as every block before)."""
        n = 0
        for i in ids:
            if i not in self.refs:
                break
            n += 1
        return n

    def acquire(self, ids: Sequence[int]) -> None:
        """Refer to cached ``ids`` (found by :meth:`lookup`): they are no longer evictable."""
        for i in ids:
            if self.refs[i] == 0:
                del self.idle[i]
            self.refs[i] += 1

    def insert(self, ids: Sequence[int], already: int) -> None:
        """A request computed the blocks of ``ids`` (beyond the ``already`` first it refers to): each becomes a
        cached entry it refers to, its blocks moved out of the request's own; an id cached meanwhile by another
        request is referred to instead and the request's copy freed."""
        for i in ids[already:]:
            if i in self.refs:
                if self.refs[i] == 0:
                    del self.idle[i]
                self.refs[i] += 1
            else:
                self.refs[i] = 1
            self.own -= self.entry_blocks

    def unref(self, ids: Sequence[int]) -> None:
        """A request no longer refers to ``ids``: those left without one become evictable, newest last, and the
        oldest are evicted while more than ``cap_blocks`` are kept."""
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.idle[i] = None
        if self.cap_blocks is not None:
            while self.idle and len(self.idle) * self.entry_blocks > self.cap_blocks:
                oldest, _ = self.idle.popitem(last=False)
                del self.refs[oldest]
