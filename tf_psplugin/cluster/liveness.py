"""Is a task alive: TCP probes of its address, and errors that mean it died.

Why this module exists: connecting to the cluster (`connection`), the step
watchdog (`coordinator`), failover and in-process recovery all ask the same
two questions — does `host:port` accept connections yet, and does this
error from a step mean a task died or hung rather than a bug in the user's
code — and answer them the same way. Cluster-level facts, so they live
here, below everything that asks.
"""

import os
import re
import socket
import time
from typing import Any, Dict, List, Set, Tuple

import tensorflow as tf

__all__ = ["accepts_connections", "is_task_failure", "served_by_this_process", "tasks_named_in",
           "wait_for_listeners"]

_TASK_RE = re.compile(r"/job:(worker|ps)/replica:\d+/task:(\d+)")
_TASK_FAILURE_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.InternalError,
    tf.errors.NotFoundError,
)


def is_task_failure(error: BaseException) -> bool:
    """Whether an error from a step means a task died or hung (vs. a bug).

    TF's `ClosureInputError`/`ClosureAbortedError` (a per-worker input that
    could not be built) are judged by the error they wrap: a dead worker's
    iterator is a task failure, the user's failing dataset function is not.
    """
    original = getattr(error, "original_exception", None)
    if original is not None and original is not error:
        return is_task_failure(original)
    if not isinstance(error, _TASK_FAILURE_ERRORS):
        return False
    if isinstance(error, (tf.errors.InternalError, tf.errors.NotFoundError)):
        text = str(error)
        return any(s in text for s in ("Socket closed", "failed to connect", "Connection reset",
                                       "context_id", "Unable to find a context",
                                       "unknown context", "/job:"))
    return True


def tasks_named_in(error: BaseException) -> Set[Tuple[str, int]]:
    """Tasks ("worker"/"ps", index) that an error message blames."""
    return {(job, int(index)) for job, index in _TASK_RE.findall(str(error))}


def accepts_connections(address: str, timeout: float = 1.0) -> bool:
    """Whether `host:port` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def served_by_this_process(address: str) -> bool:
    """Whether a socket of this very process listens on `address`'s port.

    True for the tasks of an in-process cluster (TF's own tests and its PSS
    tutorial start the workers' and PS's `tf.distribute.Server`s in the
    chief's process): no restart policy can restart such a task, and
    aborting it (failover's restart of collective members) would end the
    chief. Reads Linux's /proc (the listening sockets of the port, and this
    process's open file descriptors); elsewhere, or when /proc cannot be
    read, False.
    """
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit():
        return False
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)  # The header.
                for line in f:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN.
                    if (len(fields) > 9 and fields[3] == "0A"
                            and int(fields[1].rsplit(":", 1)[1], 16) == int(port)):
                        inodes.add(fields[9])
        except (OSError, ValueError, IndexError):
            continue
    if not inodes:
        return False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(os.path.join("/proc/self/fd", fd))
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def wait_for_listeners(addresses: Dict[Any, str], timeout_seconds: float,
                       poll_seconds: float, connect_timeout: float = 1.0) -> List[Any]:
    """Polls until every address accepts connections; returns the keys that never did.

    Keys come back in `addresses`' order.
    """
    deadline = time.monotonic() + timeout_seconds
    pending = list(addresses)
    while True:
        pending = [k for k in pending
                   if not accepts_connections(addresses[k], timeout=connect_timeout)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(poll_seconds)
