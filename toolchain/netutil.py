"""Local port helpers shared by the server launcher and the preflight checks."""

from __future__ import annotations

import socket


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str) -> int:
    """A port the OS reports free on `host` right now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something is listening on (host, port). SO_REUSEADDR mirrors the
    server's own bind, so sockets in TIME_WAIT from a previous run don't count."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
