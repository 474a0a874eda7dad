"""Public module: a task's role entry point (`start`, `run_server`).

The code lives in `tf_psplugin.cluster.server`; this module is its public
face and the command `python -m tf_psplugin.server [flags]`, which serves a
ps or worker task.
"""

import sys

from tf_psplugin.cluster.server import (  # noqa: F401  (the public names)
    start,
    run_server,
)

__all__ = ["start", "run_server"]


if __name__ == "__main__":
    from tf_psplugin.cluster.server import main as _main  # noqa: E402  (the command)

    sys.exit(_main())
