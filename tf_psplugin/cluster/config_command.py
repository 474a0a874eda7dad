"""The command `python -m tf_psplugin.config [flags]`: this process's role, as JSON.

Why this module exists: a misconfigured task is found fastest on its own
host, before TensorFlow starts. The command resolves the cluster exactly as
a training process would (`flags.resolve_strict`: the plugin's flags, or
TF_CONFIG) and prints the role and cluster, or exits 2 with the one-line
`ConfigError`. `tf_psplugin/config.py` runs `main()`; see docs/cluster.md.
"""

import json
import sys
from typing import Mapping, Optional, Sequence

from tf_psplugin.cluster import flags as flags_lib
from tf_psplugin.errors import ConfigError

__all__ = ["main"]

_USAGE = f"""usage: python -m tf_psplugin.config [flags]

Prints, as JSON, the role and cluster this process would get from its flags or
from the TF_CONFIG environment variable (flags win when --job_name is given).
Exits 2 with one line on stderr if the configuration is invalid.

flags:
  --job_name        {flags_lib.FLAG_HELP['job_name']}
  --task_index      Index of this task within --job_name.
  --chief_hosts     {flags_lib.FLAG_HELP['chief_hosts']}
  --worker_hosts    {flags_lib.FLAG_HELP['worker_hosts']}
  --ps_hosts        {flags_lib.FLAG_HELP['ps_hosts']}
  --evaluator_hosts {flags_lib.FLAG_HELP['evaluator_hosts']}
"""


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 invalid configuration)."""
    argv = list(sys.argv if argv is None else argv)
    if flags_lib.is_help(argv):
        sys.stdout.write(_USAGE)
        return 0
    try:
        config = flags_lib.resolve_strict(argv, environ)
    except ConfigError as e:
        sys.stderr.write(f"tf_psplugin.config: error: {e}\n")
        return 2
    sys.stdout.write(json.dumps(config.to_json_dict(), indent=2) + "\n")
    return 0
