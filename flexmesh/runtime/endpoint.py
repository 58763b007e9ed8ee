"""Whether a ``--rdzv-endpoint`` will answer, checked before torchrun starts: torchrun itself waits on an
endpoint that never answers in silence, then ends in a traceback (docs/failures.md).

No torch import at module level: only a port that something holds is probed with a store client.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
from typing import Any

from flexmesh.errors import PlanError

RDZV_WAIT_S = 60.0  # torchrun's own client wait for the c10d store (its read_timeout default, 60 s)


def check_endpoint(endpoint: str | None, timeout_s: float = 5.0, wait_s: float = RDZV_WAIT_S) -> None:
    """Refuse (PlanError, one line) a ``--rdzv-endpoint`` torchrun would wait on in silence.

    On this machine: a port held by a program other than a rendezvous store (torchrun would connect
    to it as a client and wait for an answer that never comes); a free port passes (this launcher's
    torchrun serves the store there). On another host: the store is served by that node's launcher,
    which may start later, so the port is tried until it accepts, for at most ``wait_s`` seconds (said
    once on stderr when the first try fails); a port that never accepts, or a host that does not
    resolve, is refused with what to check. A port where the job's store already serves passes.
    """
    if endpoint is None:
        return
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise PlanError(f"--rdzv-endpoint {endpoint}: host {host!r} does not resolve on this machine; give node "
                        "0's name or address as this node reaches it") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            return  # free here
        except OSError as e:
            local = e.errno == errno.EADDRINUSE
    if not local:
        _wait_for(endpoint, address, family, wait_s)
    if not _store_answers(host, int(port), timeout_s):
        where = "on this machine" if local else f"on {host}"
        raise PlanError(f"--rdzv-endpoint {endpoint}: port {port} is in use by another program {where}; "
                        "stop it or choose another port")


def _wait_for(endpoint: str, address: Any, family: int, wait_s: float) -> None:
    """Try ``address`` until it accepts a connection, for at most ``wait_s`` seconds; PlanError after."""
    import time

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(max(0.1, min(5.0, left)))  # an address that drops packets answers nothing at all
                s.connect(address)
            return
        except OSError as e:
            reason = e.strerror or type(e).__name__.replace("Error", " error").lower()
        left = deadline - time.monotonic()
        if left <= 0:
            host, _, port = endpoint.rpartition(":")
            raise PlanError(f"--rdzv-endpoint {endpoint} did not answer within {wait_s:g} s ({reason}): check that "
                            f"node 0's launcher runs with this --rdzv-endpoint, that {host} is its address as this "
                            f"node reaches it and that port {port} is open between the nodes "
                            "(--rdzv-wait waits longer)")
        if not said:
            print(f"waiting up to {wait_s:g} s for the rendezvous at {endpoint} (node 0's launcher serves it): "
                  f"{reason}", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(1.0, left))


def _store_answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether a c10d store (of this job, served by a torchrun) answers at ``host:port`` within ``timeout_s``."""
    from datetime import timedelta

    import torch.distributed as dist

    answered: list[bool] = []

    def connect() -> None:  # a store of this job, hosted by a torchrun, answers at once
        try:
            dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            answered.append(True)
        except Exception:  # noqa: BLE001 - torch raises RuntimeError, DistNetworkError or TimeoutError here
            pass

    # In a thread: a program that accepts and never answers blocks the store's handshake past its timeout.
    probe_thread = threading.Thread(target=connect, daemon=True)
    probe_thread.start()
    probe_thread.join(timeout_s)
    return bool(answered)
