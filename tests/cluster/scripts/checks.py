"""`check()`: the `CHECK <name> ok|FAIL <why>` line every chief script prints.

tests/cluster/_cluster_util.py's `assert_checks_passed` reads these lines, so
a test asserts each check by name and a failure names what broke.
"""

import os
import sys


def check(name, ok, why=""):
    """Prints `CHECK <name> ok`, or `CHECK <name> FAIL <why>` (one line, 400 chars)."""
    # One os.write per line: stdout and stderr share the launcher's pipe, and
    # print() writes the text and its newline separately when unbuffered, so a
    # log line from TF's closure threads could land between them.
    why = " ".join(str(why).split())[:400]
    line = f"CHECK {name} {'ok' if ok else 'FAIL ' + why}\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())
