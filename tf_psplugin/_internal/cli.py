"""Which plugin command this process is, if any (no TensorFlow import).

Why this module exists: an import-time convenience (dropping TensorFlow's
import chatter) is right for the plugin's own command-line tools and wrong
for a user's program that merely imports `tf_psplugin`. `compat` (which
imports TensorFlow) and `cluster.config` (which the launcher uses without
TensorFlow) ask here.
"""

import sys
from typing import Optional

# The plugin's command-line modules: `python -m tf_psplugin.<name>`.
CLI_MODULES = ("config", "server", "launch")


def cli_module() -> Optional[str]:
    """The plugin CLI this process was started as (`python -m tf_psplugin.X`), or None.

    Read from `sys.orig_argv` (Python >= 3.10), because while `python -m`
    imports this package to find the module, `sys.argv[0]` is only "-m".
    Importing the package from any other program returns None, so the
    conveniences above apply to the plugin's own commands only.
    """
    argv = list(getattr(sys, "orig_argv", []))
    for flag, value in zip(argv, argv[1:]):
        if flag == "-m":
            package, _, name = value.partition(".")
            return name if package == "tf_psplugin" and name in CLI_MODULES else None
    return None
