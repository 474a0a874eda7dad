"""`check()`: the `CHECK <name> ok|FAIL <why>` line every chief script prints.

tests/cluster/_cluster_util.py's `assert_checks_passed` reads these lines, so
a test asserts each check by name and a failure names what broke.
"""

import contextlib
import functools
import os
import sys
import threading


def check(name, ok, why=""):
    """Prints `CHECK <name> ok`, or `CHECK <name> FAIL <why>` (one line, 400 chars)."""
    # One os.write per line: stdout and stderr share the launcher's pipe, and
    # print() writes the text and its newline separately when unbuffered, so a
    # log line from TF's closure threads could land between them.
    why = " ".join(str(why).split())[:400]
    line = f"CHECK {name} {'ok' if ok else 'FAIL ' + why}\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


class HarnessThread(threading.Thread):
    """TF's coordinator-test harness thread (`ErrorReportingThread`): target= only.

    TF's cluster_coordinator_test.py replaces `threading.Thread` with it; a
    `threading.Timer` (whose constructor passes no target) then raises.
    Used by tf_coordinator_cases.py and tests/unit/test_coordinator_threads.py.
    """

    def __init__(self, *args, **kwargs):
        assert "target" in kwargs, "TF's test harness threads need target="
        target = kwargs["target"]

        @functools.wraps(target)
        def wrapped(*a, **kw):
            return target(*a, **kw)

        kwargs["target"] = wrapped
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def tf_test_harness_threads():
    """`threading.Thread` replaced by `HarnessThread` inside, as TF's tests replace it."""
    saved = threading.Thread
    threading.Thread = HarnessThread
    try:
        yield
    finally:
        threading.Thread = saved
