"""Free loopback ports for tests that start a server or a Ray node of their own."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free right now (another process may take it before it is bound)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now (held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
