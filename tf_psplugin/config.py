"""Public module: the cluster configuration (flags, `TF_CONFIG`), validated.

The code lives in `tf_psplugin.cluster.config`; this module is its public
face and the command `python -m tf_psplugin.config [flags]`, which prints
the role and cluster as JSON or exits 2 with one line.
"""

import sys

from tf_psplugin.cluster.config import (  # noqa: F401  (the public names)
    ClusterConfig,
    ConfigError,
    FLAGS,
    define_flags,
    from_flags,
    from_tf_config,
    local,
    resolve,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "FLAGS",
    "define_flags",
    "from_flags",
    "from_tf_config",
    "local",
    "resolve",
]


if __name__ == "__main__":
    from tf_psplugin.cluster.config import main as _main  # noqa: E402  (the command)

    sys.exit(_main())
