"""Public module: a whole job on one host (`LocalCluster`).

The code lives in `tf_psplugin.cluster.launch`; this module is its public
face and the command `python -m tf_psplugin.launch --workers N --ps M
[--evaluator] -- COMMAND`.
"""

import sys

from tf_psplugin.cluster.launch import (  # noqa: F401  (the public names)
    LocalCluster,
    main,
)

__all__ = ["LocalCluster", "main"]


if __name__ == "__main__":
    from tf_psplugin.cluster.launch import main as _main  # noqa: E402  (the command)

    sys.exit(_main())
