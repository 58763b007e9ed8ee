"""Helpers for multi-process tests."""

import socket


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
