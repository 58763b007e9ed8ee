"""Naming the rank that stopped answering.

A collective that waits past the collective timeout (``init_distributed(timeout_s=...)``, ``flexmesh
train --collective-timeout``) fails with gloo's "Timed out waiting 5000ms for recv operation", which
names no peer. So each rank beats a counter in the rendezvous store from a daemon thread
(:class:`Heartbeat`); when a collective times out or loses its connection, :func:`rank_error` reads
the counters twice and names the ranks whose counter stood still: stopped (SIGSTOP, a debugger,
swapped out) or dead. Counters rather than clock times, so nodes' clocks need not agree.
"""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from flexmesh.errors import RankError

KEY = "flexmesh/heartbeat/{}"
# Words of torch's and gloo's errors when a peer never answers or went away.
LOST = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "connection refused")


class Heartbeat:
    """Beat ``KEY.format(rank)`` in the store at ``MASTER_ADDR:MASTER_PORT`` every ``interval_s``.

    Inert (nothing is named later) with one rank or without that store. ``close()`` stops the beat.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._lock = threading.Lock()  # one store client, two threads
        self._stop = threading.Event()
        self._store = _store_client() if self.world > 1 else None
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, name="flexmesh-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        store = self._store
        assert store is not None  # the thread runs only where there is a store
        while not self._stop.wait(self.interval_s):
            try:
                with self._lock:
                    store.add(KEY.format(self.rank), 1)
            except Exception:  # the store went away: the run is ending anyway
                return

    def silent_ranks(self) -> list[int] | None:
        """Other ranks whose beat stood still over three intervals; None when that cannot be told."""
        if self._store is None:
            return None
        try:
            before = self._counts()
            time.sleep(3 * self.interval_s)
            after = self._counts()
        except Exception:
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def _counts(self) -> list[int]:
        store = self._store
        assert store is not None  # asked only where there is a store
        with self._lock:
            return [int(store.add(KEY.format(r), 0)) for r in range(self.world)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)


def _store_client() -> dist.Store | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10))
    except Exception:  # another rendezvous (file://, a store this process cannot reach): no names then
        return None


def rank_error(error: BaseException, heartbeat: Heartbeat | None) -> RankError | None:
    """A RankError naming the silent ranks when ``error`` is a collective that timed out or lost its
    peer, else None (the error is something else and should be raised as it is)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if not any(w in " ".join(lines).lower() for w in LOST):
        return None
    from torch.distributed import distributed_c10d

    limit = distributed_c10d.default_pg_timeout.total_seconds()  # set by init_distributed
    # gloo prefixes its messages with its source location ("[.../unbound_buffer.cc:78] Timed out ...")
    cause = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1])[:200] if lines else type(error).__name__
    me = dist.get_rank()
    silent = heartbeat.silent_ranks() if heartbeat is not None else None
    if silent:
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
        return RankError(f"{who} stopped answering (no heartbeat: stopped or dead), so a collective on rank {me} "
                         f"failed ({cause}); see what happened to {who}, or raise --collective-timeout (now "
                         f"{limit:g} s) if it is only slow")
    return RankError(f"a collective on rank {me} failed after waiting up to {limit:g} s ({cause}); no rank could be "
                     "named (all show a heartbeat): one is hung or far behind; raise --collective-timeout if it is "
                     "only slow")
