"""Role entry point: parameter servers and workers serve, the chief trains.

Why this module exists: with ParameterServerStrategy only the chief (the
coordinator) runs the training program; ps and worker tasks just host a
`tf.distribute.Server` that the chief drives over gRPC. Users nevertheless
ship one script and one container image for every role, as Kubeflow's TFJob
and the TF1 `--job_name` world expect. `start()` makes that work: called
first in the script, it returns the config on the chief and the evaluator,
and on a ps or worker task it serves until told to stop and then exits the
process, so the rest of the script only ever runs where it should.

    import tf_psplugin

    def main():
        config = tf_psplugin.start_server()  # tf_psplugin: never returns on ps/worker.
        strategy = ...(config.cluster_resolver())

(`tf_psplugin.start_server` is this module's `start`, exported lazily so that
`python -m tf_psplugin.server` does not find the module already imported.)
`python -m tf_psplugin.server [flags]` does the same for ps/worker tasks of
scripts that do not call `start()` (the launcher's `--servers builtin`).

Servers are started from the *training* cluster spec (chief, workers, ps;
never the evaluator) so workers see each other, which the collective
all-reduce of dense gradients needs. A TF server cannot be stopped from
Python, so on SIGTERM or SIGINT the process flushes its output and leaves
with `os._exit(0)`.
"""

import json
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster.config import ClusterConfig, ConfigError

__all__ = ["start", "run_server"]

_PREFIX = "tf_psplugin.server"


def _say(message: str) -> None:
    sys.stderr.write(f"{_PREFIX}: {message}\n")
    sys.stderr.flush()


def _exit(code: int) -> None:
    """Leaves the process without waiting for TF's server threads."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # Closed or broken pipe: nothing to flush to.
            pass
    os._exit(code)


def _describe(config: ClusterConfig) -> str:
    return f"{config.task_type}:{config.task_index}"


def start(
    config: Optional[ClusterConfig] = None, argv: Optional[Sequence[str]] = None
) -> ClusterConfig:
    """Call first in every training script: serves on ps/worker, returns elsewhere.

    Resolves the config (flags, else TF_CONFIG; see `config.resolve`) unless
    one is given, sets `GRPC_FAIL_FAST=use_caller` (unless already set; PSS
    failure handling needs it) and exports the resolved configuration as
    the standard `TF_CONFIG` (chief explicit), so stock TensorFlow code in
    the same process (Estimator's RunConfig, TFConfigClusterResolver) sees
    the same cluster even when flags were used.

    Args:
      config: the task's config; default: `config.resolve(argv)`.
      argv: command line for `resolve` (default `sys.argv`); unknown flags
        are left to the script.

    Returns:
      The config, on the chief and the evaluator. On a ps or worker task
      this function does not return: it serves until SIGTERM/SIGINT and
      exits the process with code 0.

    Raises:
      SystemExit: with code 2 after printing one line, if the configuration
        is invalid.
    """
    if config is None:
        try:
            config = config_lib.resolve(argv=argv)
        except ConfigError as e:
            _say(f"error: {e}")
            raise SystemExit(2) from None
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    os.environ["TF_CONFIG"] = json.dumps(config.tf_config())
    if config.is_server:
        run_server(config)
    return config


def run_server(config: ClusterConfig) -> None:
    """Serves this ps/worker task until SIGTERM or SIGINT, then exits the process.

    Never returns: exits with 0 when stopped by a signal, or with 1 after
    one line on stderr if the server cannot start (e.g. the port is taken).
    Signal handlers are installed only when called from the main thread;
    elsewhere the default handlers (terminate) stay in place.

    Args:
      config: a config whose task is a ps or worker.

    Raises:
      ConfigError: if the task is the chief or the evaluator.
    """
    if not config.is_server:
        raise ConfigError(
            "task", f"{_describe(config)} does not run a server: the {config.task_type} runs the "
            f"{'training' if config.is_chief else 'evaluation'} script itself",
            "run your script for this task; tf_psplugin.server is only for ps and worker tasks")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    stop = threading.Event()
    received = []

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        received.append(signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        # Installed before importing TF so an early SIGTERM still exits cleanly.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)

    import tensorflow as tf  # Lazy: `--help` and config errors should not wait for TF.

    address = config.task_address
    try:
        tf.distribute.Server(
            config.cluster_spec(), job_name=config.task_type, task_index=config.task_index,
            protocol=config.rpc_layer, start=True)
    except (tf.errors.OpError, ValueError) as e:
        port = address.rsplit(":", 1)[1]
        _say(f"error: {_describe(config)} could not start its server on {address} "
             f"({getattr(e, 'message', e)}). Fix: free port {port} on this host (another process "
             "holds it?) or give this task another address")
        _exit(1)
    _say(f"{_describe(config)} serving at {address} (training cluster: 1 chief, "
         f"{config.num_workers} worker(s), {config.num_ps} ps; pid {os.getpid()})")
    while not stop.wait(1.0):
        pass
    _say(f"{_describe(config)} stopping on {signal.Signals(received[0]).name}")
    _exit(0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_psplugin.server`: serve a ps/worker task; 2 on bad input."""
    argv = list(sys.argv if argv is None else argv)
    if config_lib.is_help(argv):
        sys.stdout.write(
            "usage: python -m tf_psplugin.server [--job_name=ps|worker --task_index=N "
            "--worker_hosts=... --ps_hosts=... [--chief_hosts=...]]\n\n"
            "Runs the TF server of one ps or worker task (from the flags, else TF_CONFIG) until\n"
            "SIGTERM/SIGINT. The chief and the evaluator run the training/eval script instead.\n")
        return 0
    try:
        config = config_lib.resolve_strict(argv)
        if not config.is_server:
            raise ConfigError(
                "task", f"{_describe(config)} does not run a server: the {config.task_type} "
                f"runs the {'training' if config.is_chief else 'evaluation'} script",
                "run your script for this task; use python -m tf_psplugin.server only for "
                "ps and worker tasks")
    except ConfigError as e:
        _say(f"error: {e}")
        return 2
    start(config)
    return 0  # Not reached: start() exits on ps/worker tasks.

