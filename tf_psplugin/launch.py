"""Public module: a whole job on one host (`LocalCluster`).

The code lives in `tf_psplugin.cluster`: the processes in `local_cluster`,
the restart budget in `restart_budget`, the command in `launch`. This
module is their public face and the command `python -m tf_psplugin.launch
--workers N --ps M [--evaluator] -- COMMAND`.
"""

import sys

from tf_psplugin.cluster.launch import main  # noqa: F401  (the public names)
from tf_psplugin.cluster.local_cluster import LocalCluster  # noqa: F401

__all__ = ["LocalCluster", "main"]


if __name__ == "__main__":
    from tf_psplugin.cluster.launch import main as _main  # noqa: E402  (the command)

    sys.exit(_main())
