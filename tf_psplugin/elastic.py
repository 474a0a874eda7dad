"""Public module: opt-in recovery from a task failure inside one process (`run`).

The code lives in `tf_psplugin.fault.elastic`.
"""

from tf_psplugin.fault.elastic import (  # noqa: F401  (the public names)
    run,
)

__all__ = ["run"]
