"""The launcher's restart budget: which task failures earn a restart.

Why this module exists: the rule is subtle (a worker's own crash counts, the
abort the chief's failover gives the surviving workers does not, a chief's
exit 138 is free only after a failure the launcher saw, and a recovery
that never restarted the chief expires) and it decides whether a long job
survives. Kept apart from the processes (`cluster/local_cluster.py`), it
is a pure object: it is told about exits and reads the time from an
injected clock, so its unit tests feed it exits and move the clock instead
of starting and killing processes. It imports no TensorFlow.

Example:

    budget = RestartBudget(max_restarts=2)
    decision = budget.task_failed("worker:0", "worker", -9)
    assert decision.restart and decision.delay == 0.5
"""

import dataclasses
import signal
import time
from typing import Callable, Dict, Optional, Set

from tf_psplugin.errors import ConfigError, RESTART_EXIT_CODE

__all__ = ["RestartBudget", "Decision", "chief_exit_is_retryable"]

# A recovery the chief never restarted for (elastic.run recovers in-process)
# stops making SIGABRT exits free after this long.
INCIDENT_SECONDS = 300.0
# The first restart after an own failure waits this long, doubling with each
# further failure of the task up to MAX_DELAY.
FIRST_DELAY = 0.5
MAX_DELAY = 5.0


def chief_exit_is_retryable(code: int) -> bool:
    """Whether a chief exit asks for a restart.

    `RESTART_EXIT_CODE` (a worker or PS failed: failover.TaskFailedError)
    or killed by SIGKILL (the OOM killer, a node agent). Any other exit
    is the job's result.
    """
    return code in (RESTART_EXIT_CODE, -signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the budget says about one exit.

    Attributes:
      restart: whether the task is restarted.
      counted: whether the exit was charged to the task's budget (False for
        the restarts the plugin causes itself).
      delay: seconds to wait before restarting (0 when not restarting).
      reason: why, for the launcher's log line: the refusal ("no restarts
        left (2 used)"), the charge ("restart 1/2") or why it is free.
    """

    restart: bool
    counted: bool
    delay: float
    reason: str


class RestartBudget:
    """Counts each task's own failures and says which exits earn a restart.

    The rule: a task is restarted after at most `max_restarts` of its own
    failures (and the whole cluster after `max_total_restarts`, if set).
    Restarts the plugin causes itself are free: after a worker or PS
    failed (an open *recovery*), the chief's exit 138 and the SIGABRT its
    failover gives each surviving worker (once per worker and recovery).
    The first counted ps/worker failure opens a recovery; the chief's
    restart closes it; one older than `incident_seconds` is dropped (the
    chief recovered in-process and never exited).

    Args:
      max_restarts: own failures per task that are restarted (>= 0).
      max_total_restarts: own failures summed over every task that are
        restarted (>= 0), or None for no cluster-wide limit.
      clock: monotonic time in seconds (tests inject a fake one).
      incident_seconds: how long a recovery without a chief restart stays
        open.

    Raises:
      ConfigError: a negative budget.
    """

    def __init__(self, max_restarts: int, max_total_restarts: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic,
                 incident_seconds: float = INCIDENT_SECONDS):
        for field, value in (("max_restarts", max_restarts),
                             ("max_total_restarts", max_total_restarts)):
            if value is not None and value < 0:
                raise ConfigError(field, f"is negative ({value})", "pass a value >= 0")
        self.max_restarts = max_restarts
        self.max_total_restarts = max_total_restarts
        self._clock = clock
        self._incident_seconds = incident_seconds
        self._failures: Dict[str, int] = {}
        self.total_failures = 0  # Own failures restarted, all tasks.
        # The task whose failure started the recovery in progress: set by the
        # first counted ps/worker failure, cleared when the chief restarts.
        self._incident: Optional[str] = None
        self._incident_start = 0.0
        self._incident_free: Set[str] = set()  # Workers restarted free in this one.

    def failures(self, role: str) -> int:
        """Own failures of `role` ("worker:0", "chief", ...) restarted so far."""
        return self._failures.get(role, 0)

    def recovery(self) -> Optional[str]:
        """The task whose failure the open recovery is about, or None."""
        if (self._incident is not None
                and self._clock() - self._incident_start > self._incident_seconds):
            self._incident = None  # E.g. elastic.run recovered in-process: no chief restart.
        return self._incident

    def task_failed(self, role: str, task_type: str, code: int) -> Decision:
        """A ps, worker or evaluator exited and is to be restarted if the budget allows.

        Args:
          role: the task's role ("worker:1", "ps:0", "evaluator").
          task_type: "ps", "worker" or "evaluator".
          code: its exit code as `Popen.returncode` gives it (-N: signal N).

        Returns:
          The decision; a counted restart of a ps or worker opens a
          recovery if none is open.
        """
        incident = self.recovery()
        if (task_type == "worker" and incident is not None and code == -signal.SIGABRT
                and role not in self._incident_free):
            self._incident_free.add(role)
            return Decision(True, False, FIRST_DELAY,
                            f"aborted by the chief's failover after {incident} failed; "
                            "not counted against its budget")
        refused = self._charge(role)
        if refused:
            return Decision(False, False, 0.0, refused)
        if task_type != "evaluator" and incident is None:
            self._incident, self._incident_start = role, self._clock()
            self._incident_free = set()
        failures = self.failures(role)
        return Decision(True, True, min(FIRST_DELAY * 2 ** (failures - 1), MAX_DELAY),
                        f"restart {failures}/{self.max_restarts}")

    def chief_exited(self, code: int) -> Decision:
        """The chief exited with a retryable code (see `chief_exit_is_retryable`).

        Exit 138 during a recovery is the plugin's own coordinated restart
        and is free; exit 138 with no failure seen, and SIGKILL, count
        against the chief's budget. A granted restart closes the recovery.

        Args:
          code: the chief's exit code.

        Returns:
          The decision.
        """
        incident = self.recovery()
        if code == RESTART_EXIT_CODE and incident is not None:
            decision = Decision(True, False, 0.0,
                                f"{incident} failed; not counted against the chief's budget")
        else:
            refused = self._charge("chief")
            if refused:
                return Decision(False, False, 0.0, refused)
            cause = "a task failed" if code == RESTART_EXIT_CODE else "killed"
            decision = Decision(True, True, 0.0,
                                f"{cause}, restart {self.failures('chief')}/{self.max_restarts}")
        self._incident = None  # The restarted chief starts a new recovery cycle.
        return decision

    def _charge(self, role: str) -> Optional[str]:
        """Counts one own failure of `role`; returns why it may not restart, or None."""
        if self.failures(role) >= self.max_restarts:
            return f"no restarts left ({self.max_restarts} used)"
        if self.max_total_restarts is not None and (
                self.total_failures >= self.max_total_restarts):
            return (f"the cluster's restart budget is spent ({self.max_total_restarts} task "
                    "failures restarted)")
        self._failures[role] = self.failures(role) + 1
        self.total_failures += 1
        return None
