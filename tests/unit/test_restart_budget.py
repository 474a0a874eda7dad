"""The launcher's restart budget as a pure object: exits fed in, a fake clock, no processes."""

import signal

import pytest

from tf_psplugin.cluster.restart_budget import RestartBudget, chief_exit_is_retryable
from tf_psplugin.errors import ConfigError, RESTART_EXIT_CODE

KILLED, ABORTED = -signal.SIGKILL, -signal.SIGABRT


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _budget(max_restarts=2, max_total_restarts=None, incident_seconds=300.0):
    clock = _Clock()
    return RestartBudget(max_restarts, max_total_restarts, clock=clock,
                         incident_seconds=incident_seconds), clock


def test_own_failures_are_counted_with_a_doubling_capped_delay():
    budget, _ = _budget(max_restarts=6)
    decisions = [budget.task_failed("worker:0", "worker", 1) for _ in range(7)]
    assert [d.restart for d in decisions] == [True] * 6 + [False]
    assert [d.delay for d in decisions[:6]] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert all(d.counted for d in decisions[:6])
    assert [d.reason for d in decisions[:2]] == ["restart 1/6", "restart 2/6"]
    assert decisions[6].reason == "no restarts left (6 used)"
    assert budget.failures("worker:0") == 6 and budget.total_failures == 6
    assert budget.failures("worker:1") == 0


def test_the_failovers_abort_is_free_once_per_worker_and_recovery():
    budget, _ = _budget()
    assert budget.task_failed("worker:0", "worker", KILLED).counted  # Opens a recovery.
    assert budget.recovery() == "worker:0"
    free = budget.task_failed("worker:1", "worker", ABORTED)
    assert (free.restart, free.counted, free.delay) == (True, False, 0.5)
    assert free.reason == ("aborted by the chief's failover after worker:0 failed; "
                           "not counted against its budget")
    # A second abort of the same worker in the same recovery is its own.
    assert budget.task_failed("worker:1", "worker", ABORTED).counted
    assert budget.failures("worker:1") == 1
    # A PS is never aborted by the failover: its SIGABRT counts.
    assert budget.task_failed("ps:0", "ps", ABORTED).counted


def test_an_abort_with_no_failure_seen_counts():
    budget, _ = _budget()
    decision = budget.task_failed("worker:0", "worker", ABORTED)  # E.g. a TF check failure.
    assert decision.counted and budget.failures("worker:0") == 1


def test_the_chiefs_138_is_free_after_a_failure_and_closes_the_recovery():
    budget, _ = _budget()
    budget.task_failed("ps:0", "ps", KILLED)
    decision = budget.chief_exited(RESTART_EXIT_CODE)
    assert (decision.restart, decision.counted) == (True, False)
    assert decision.reason == "ps:0 failed; not counted against the chief's budget"
    assert budget.recovery() is None and budget.failures("chief") == 0
    # Nothing failed since: the next 138 counts, as a SIGKILL does.
    assert budget.chief_exited(RESTART_EXIT_CODE).reason == "a task failed, restart 1/2"
    assert budget.chief_exited(KILLED).reason == "killed, restart 2/2"
    refused = budget.chief_exited(RESTART_EXIT_CODE)
    assert not refused.restart and refused.reason == "no restarts left (2 used)"


def test_a_recovery_expires_when_the_chief_never_restarts():
    budget, clock = _budget(incident_seconds=300.0)
    budget.task_failed("worker:0", "worker", KILLED)
    clock.now += 300.0
    assert budget.recovery() == "worker:0"  # Not yet: more than 300 s closes it.
    clock.now += 0.5
    assert budget.recovery() is None
    # The abort that follows an expired recovery is the worker's own.
    assert budget.task_failed("worker:1", "worker", ABORTED).counted
    # ... and, a new failure, it opens the next recovery.
    assert budget.recovery() == "worker:1"


def test_an_evaluator_failure_opens_no_recovery():
    budget, _ = _budget()
    assert budget.task_failed("evaluator", "evaluator", 1).counted
    assert budget.recovery() is None
    assert budget.chief_exited(RESTART_EXIT_CODE).counted


def test_the_cluster_wide_budget_ends_failures_spread_over_tasks():
    budget, _ = _budget(max_restarts=5, max_total_restarts=2)
    assert budget.task_failed("worker:0", "worker", KILLED).restart
    assert budget.chief_exited(RESTART_EXIT_CODE).restart  # Free.
    assert budget.task_failed("worker:1", "worker", KILLED).restart
    refused = budget.task_failed("worker:2", "worker", KILLED)
    assert not refused.restart and not refused.counted
    assert refused.reason == ("the cluster's restart budget is spent (2 task failures "
                              "restarted)")
    assert budget.total_failures == 2 and budget.failures("worker:2") == 0


def test_a_zero_budget_restarts_nothing_but_the_free_restarts():
    budget, _ = _budget(max_restarts=0)
    assert not budget.task_failed("worker:0", "worker", KILLED).restart
    assert not budget.chief_exited(KILLED).restart


@pytest.mark.parametrize("code,retryable", [
    (RESTART_EXIT_CODE, True), (KILLED, True), (0, False), (1, False), (ABORTED, False),
    (-signal.SIGTERM, False)])
def test_which_chief_exits_ask_for_a_restart(code, retryable):
    assert chief_exit_is_retryable(code) is retryable


@pytest.mark.parametrize("kwargs,field", [
    ({"max_restarts": -1}, "max_restarts"),
    ({"max_restarts": 1, "max_total_restarts": -2}, "max_total_restarts")])
def test_a_negative_budget_is_refused(kwargs, field):
    with pytest.raises(ConfigError) as info:
        RestartBudget(**kwargs)
    assert info.value.field == field
