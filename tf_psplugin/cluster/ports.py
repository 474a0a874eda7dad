"""Free TCP ports and host:port formatting for loopback clusters.

Why this module exists: the local launcher, `config.local()` and the cluster
tests all need a handful of distinct free ports on one host, and all of them
need to write `host:port` the way TensorFlow's gRPC layer expects it (IPv6
hosts in brackets). Keeping both in one small module means the three callers
agree.

Picking a port by binding to port 0 and closing the socket is inherently
racy: another process may take the port before the TF server binds it. The
window is short (the server starts a few seconds later) and the kernel hands
out ephemeral ports in a rotating order, so clashes are rare; when one
happens the server fails with "Could not start gRPC server" and the caller
should simply retry with fresh ports (see docs/cluster.md, troubleshooting).
"""

import contextlib
import socket
from typing import List

__all__ = ["format_address", "pick_free_ports", "strip_brackets"]


def strip_brackets(host: str) -> str:
    """Returns `host` without the brackets of a bracketed IPv6 literal."""
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def format_address(host: str, port: int) -> str:
    """Formats `host:port`, bracketing a bare IPv6 literal.

    Args:
      host: a host name, IPv4 literal, or IPv6 literal (with or without
        brackets).
      port: the TCP port.

    Returns:
      `"host:port"`, or `"[v6::addr]:port"` for IPv6.
    """
    host = strip_brackets(host)
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def pick_free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """Returns `count` distinct TCP ports that are free on `host` right now.

    All sockets stay open until every port is chosen, so the ports are
    distinct from each other; they are closed before returning, so the
    caller can bind them.

    Args:
      count: how many ports to pick (>= 0).
      host: the host to bind, e.g. "127.0.0.1", "localhost" or "::1".

    Returns:
      A list of `count` port numbers.

    Raises:
      OSError: if `host` cannot be bound (not a local address).
    """
    bare = strip_brackets(host)
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    ports: List[int] = []
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((bare, 0))
            ports.append(sock.getsockname()[1])
    return ports
