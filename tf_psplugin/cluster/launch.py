"""The command `python -m tf_psplugin.launch`: a whole job on one host.

Why this module exists: the command line is a thin front-end over
`LocalCluster` (`cluster/local_cluster.py`, the processes) and its restart
budget (`cluster/restart_budget.py`); kept apart, each of the three has one
job. This module parses the options, reports bad usage in one line (exit
2), turns SIGINT/SIGTERM/SIGHUP into a clean stop (a second one skips the
grace period) and exits with the chief's exit code.

Command line:

    python -m tf_psplugin.launch --workers 2 --ps 2 [--evaluator] -- \\
        python train.py --model_dir /tmp/model

`LocalCluster` is also importable from here, as it always was.
"""

import signal
import sys
from typing import Dict, Optional, Sequence

from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin.cluster import local_cluster as local_cluster_lib
from tf_psplugin.cluster.config import ConfigError
from tf_psplugin.cluster.local_cluster import LocalCluster  # noqa: F401  (its former home)

__all__ = ["main"]

_USAGE = """usage: python -m tf_psplugin.launch --workers N --ps M [options] -- COMMAND [ARGS...]

Starts a chief, N workers, M parameter servers (and an evaluator) on this host,
each with its own TF_CONFIG, prints their output prefixed with the role, and
exits with the chief's exit code once the chief (and the evaluator) finish.

options:
  --workers N          worker tasks besides the chief (default 1)
  --ps M               parameter servers (default 1)
  --evaluator          add an evaluator task running COMMAND
  --servers MODE       command (default): ps/worker run COMMAND, which must call
                       tf_psplugin.start_server() first; builtin: they run
                       python -m tf_psplugin.server
  --restart-failed     restart a ps/worker that exits before the chief finished,
                       an evaluator that fails, and the chief when it exits with
                       138 (a task failed: it resumes from the latest
                       checkpoint) or is killed by SIGKILL; same address,
                       command and TF_CONFIG
  --max-restarts K     restart budget per task (default 3): how many times a task
                       is restarted after failing itself (crash, kill, nonzero
                       exit; the chief: killed, or 138 with no failed task
                       seen). Restarts the plugin causes are not counted:
                       after a worker/PS fails, the chief's exit 138 and the
                       surviving workers the chief aborts (exit -6) are free,
                       so a long job survives many failures spread over its
                       tasks. The chief is not restarted once a ps/worker
                       has spent its budget.
  --max-total-restarts T
                       budget of task failures summed over the whole cluster
                       (default: no limit beyond --max-restarts per task)
  --host HOST          loopback host (default 127.0.0.1)
  --pid-file PATH      keep {"launcher", "tasks": {role: pid}, "all": [...]} there
  --log-dir DIR        also write each task's output to DIR/<role>.log
  --grace-period S     seconds between SIGTERM and SIGKILL on stop (default 5)
  --timeout S          stop everything and exit 124 after S seconds
  --verbosity LEVEL    warning (default): TensorFlow's INFO lines hidden in every
                       task; info: shown (TF_PSPLUGIN_VERBOSITY=info and
                       TF_CPP_MIN_LOG_LEVEL=0 for the tasks)
"""


# What --verbosity gives every task (the default adds nothing: tasks are quiet).
_VERBOSITY_ENV = {
    "warning": {},
    "info": {verbosity_lib.VERBOSITY_ENV: "info", "TF_CPP_MIN_LOG_LEVEL": "0"},
}


def _parse_args(argv: Sequence[str]) -> Dict[str, object]:
    args = list(argv)
    if "--" not in args:
        raise ConfigError("COMMAND", "is missing", "put the command after --, e.g. "
                          "python -m tf_psplugin.launch --workers 2 --ps 1 -- python train.py")
    split = args.index("--")
    options, command = args[:split], args[split + 1:]
    opts: Dict[str, object] = {"workers": 1, "ps": 1, "evaluator": False, "servers": "command",
                               "restart_failed": False, "max_restarts": 3,
                               "max_total_restarts": None, "host": "127.0.0.1",
                               "pid_file": None, "log_dir": None, "grace_period": 5.0,
                               "timeout": None, "verbosity": "warning", "command": command}
    kinds = {"workers": int, "ps": int, "max_restarts": int, "max_total_restarts": int,
             "grace_period": float, "timeout": float, "servers": str, "host": str,
             "pid_file": str, "log_dir": str, "verbosity": str}
    i = 0
    while i < len(options):
        name, _, value = options[i].partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key in ("evaluator", "restart_failed") and not value:
            opts[key] = True
        elif key in kinds:
            if not value:
                i += 1
                if i >= len(options):
                    raise ConfigError(name, "needs a value", f"pass {name}=VALUE")
                value = options[i]
            try:
                opts[key] = kinds[key](value)
            except ValueError:
                raise ConfigError(name, f"{value!r} is not a {kinds[key].__name__}",
                                  f"pass a number, e.g. {name}=2") from None
        else:
            raise ConfigError(options[i], "is not a launcher option",
                              "see python -m tf_psplugin.launch --help; the training command "
                              "goes after --")
        i += 1
    if opts["servers"] not in local_cluster_lib.SERVER_MODES:
        raise ConfigError("--servers", f"{opts['servers']!r} is not a server mode",
                          "use --servers=command or --servers=builtin")
    if opts["verbosity"] not in verbosity_lib.VERBOSITIES:
        raise ConfigError("--verbosity", f"{opts['verbosity']!r} is not a verbosity",
                          f"use one of {', '.join(verbosity_lib.VERBOSITIES)}")
    for key in ("max_restarts", "max_total_restarts", "grace_period"):
        if opts[key] is not None and opts[key] < 0:
            raise ConfigError("--" + key.replace("_", "-"), "is negative", "pass a value >= 0")
    return opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_psplugin.launch`: returns the chief's exit code (2 on bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    before = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in before):
        sys.stdout.write(_USAGE)
        return 0
    try:
        opts = _parse_args(argv)
        local_cluster_lib.check_command(opts["command"])
        cluster = local_cluster_lib.LocalCluster(
            opts["workers"], opts["ps"], evaluator=opts["evaluator"],
            restart_failed=opts["restart_failed"], servers=opts["servers"],
            log_dir=opts["log_dir"], host=opts["host"], max_restarts=opts["max_restarts"],
            max_total_restarts=opts["max_total_restarts"],
            grace_period=opts["grace_period"], pid_file=opts["pid_file"],
            env=_VERBOSITY_ENV[opts["verbosity"]])
    except (ConfigError, OSError) as e:
        sys.stderr.write(f"tf_psplugin.launch: error: {e}\n")
        return 2

    class _Interrupted(BaseException):
        pass

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, lambda *_: cluster.skip_grace_period())  # A second one: no grace.
        cluster.log(f"{signal.Signals(signum).name} received; stopping every task")
        if cluster.stopping:  # Already stopping: just skip the grace period.
            cluster.skip_grace_period()
            return
        raise _Interrupted(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    tasks = ", ".join(f"{job}:{i}={addr}" for job, hosts in cluster.config.cluster.items()
                      for i, addr in enumerate(hosts))
    cluster.log(f"starting {tasks} (servers: {opts['servers']})")
    try:
        return cluster.run(opts["command"], timeout=opts["timeout"])
    except _Interrupted as e:
        cluster.stop()
        return 128 + e.args[0]
    except ConfigError as e:
        sys.stderr.write(f"tf_psplugin.launch: error: {e}\n")
        cluster.stop()
        return 2

