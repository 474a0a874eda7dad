"""Every exception the plugin raises on purpose, in one place.

Why this module exists: a user catches the plugin's errors by class, and a
layer that raises an error must not have to import the layer that defines
it (the connection raised a failover error; the sync layer a strategy
error). Each error's message is one line naming what is wrong and the fix.
This module imports nothing, not even TensorFlow: the launcher and the
config command use it without TensorFlow.

Every class here is also importable from `tf_psplugin` itself (except the
internal `InputStateError`), and from the module that raises it, as before.
"""

from typing import Any, Dict, List, Optional

# The chief's exit status after a worker or PS failure it cannot ride out
# in-process (TaskFailedError): "restart me, I resume from the latest
# checkpoint". 138 is the code Kubeflow's training operator reserves for "a
# user-defined retryable error" under `restartPolicy: ExitCode` (it restarts
# a replica on 130, 137, 138 and 143 and treats every other code as
# permanent; pkg/util/train IsRetryableExitCode). The launcher's
# --restart-failed restarts the chief on it.
RESTART_EXIT_CODE = 138

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EvaluatorError",
    "ExportError",
    "FailoverError",
    "InputStateError",
    "ModelDirError",
    "RESTART_EXIT_CODE",
    "ServingError",
    "StackingError",
    "StrategyError",
    "TaskFailedError",
    "TasksUnreachableError",
]


class ConfigError(ValueError):
    """Invalid cluster configuration, with the field at fault and how to fix it.

    `str(error)` is one line: `"<field>: <problem>. Fix: <fix>"`.

    Attributes:
      field: where the problem is, e.g. `"TF_CONFIG.cluster.ps[1]"` or
        `"--worker_hosts"`.
      problem: what is wrong, without a trailing period.
      fix: what to do about it.
    """

    def __init__(self, field: str, problem: str, fix: str):
        # One line, whatever the input held (JSON errors, absl messages, ...).
        self.field = " ".join(str(field).split())
        self.problem = " ".join(str(problem).split()).rstrip(". ")
        self.fix = " ".join(str(fix).split()).rstrip(". ")
        super().__init__(f"{self.field}: {self.problem}. Fix: {self.fix}")


class StrategyError(ValueError):
    """The strategy cannot be built or used as asked; the message names the fix."""


class FailoverError(RuntimeError):
    """Training cannot continue after a task failure; the message says why.

    Uncaught, it ends the chief with a one-line message and exit status
    `exit_code` (1: restarting the chief alone would not help).
    """

    exit_code = 1


class TaskFailedError(FailoverError):
    """A worker or PS task failed; restart the chief to resume from a checkpoint.

    Raised by the step (`fit`, `schedule`, `join`, an eager read) after the
    chief saved what survived. Uncaught, it ends the chief with exit status
    `RESTART_EXIT_CODE` (138), which the launcher's `--restart-failed` and a
    TFJob's `restartPolicy: ExitCode` restart on; `tf_psplugin.elastic.run`
    catches it and recovers in-process.

    Attributes:
        failed_tasks: The failed tasks, e.g. ``["worker:1"]``.
        addresses: ``{"worker:1": "host:port"}`` for the failed tasks, plus
            any surviving worker that was asked to restart with them.
        checkpoint: The checkpoint a restart resumes from, or None (no
            checkpoint yet: a restart starts over).
        policy: The `FailoverPolicy` of the strategy that raised it (its
            `recovery_timeout_seconds` and `poll_seconds` are what
            `tf_psplugin.elastic.run` waits with), or None.
    """

    exit_code = RESTART_EXIT_CODE

    def __init__(self, message: str, failed_tasks: List[str], addresses: Dict[str, str],
                 checkpoint: Optional[str], policy: Optional[Any] = None):
        super().__init__(message)
        self.failed_tasks = list(failed_tasks)
        self.addresses = dict(addresses)
        self.checkpoint = checkpoint
        self.policy = policy


class TasksUnreachableError(StrategyError, FailoverError):
    """Some worker or PS never accepted connections within `connect_timeout_seconds`.

    Usually pods still being scheduled or started, so retrying the chief is
    the fix: uncaught, it ends the chief with exit status
    `RESTART_EXIT_CODE` (138) and one line, which the launcher's
    `--restart-failed` and a TFJob's `restartPolicy: ExitCode` retry (exit
    1 would be a permanent failure there). Also a `StrategyError`, so code
    that catches that still does.
    """

    exit_code = RESTART_EXIT_CODE


class ModelDirError(ValueError):
    """The model directory cannot be used; the message names the path and the fix."""

    def __init__(self, path: Any, problem: str, fix: str):
        self.path = path
        self.problem = problem
        self.fix = fix
        super().__init__(f"model_dir {path!r}: {problem}. Fix: {fix}.")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or restored; the message says why and what to do."""


class ServingError(CheckpointError):
    """The export cannot follow this model directory; the message names the fix."""


class InputStateError(RuntimeError):
    """The input position was restored on some workers only."""


class EvaluatorError(RuntimeError):
    """The evaluator cannot run as configured; the message names the fix."""


class ExportError(RuntimeError):
    """The model cannot be exported as asked; the message names the fix."""


class StackingError(ValueError):
    """A stack cannot be updated as its tables would be; the message names the fix."""
