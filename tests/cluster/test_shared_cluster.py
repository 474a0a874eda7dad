"""The `shared_cluster` fixture's pool: one started cluster lent test after test, never stale.

A lent cluster must show each test only its own chiefs' log (else an earlier
test's `RESULT` or `DONE` line could pass a later test), must be replaced
when a task died, and must leave no process behind.
"""

import os
import signal

import pytest

from tests.cluster import _cluster_util as cu

pytestmark = [pytest.mark.cluster]


@pytest.mark.timeout(180)
def test_a_lent_cluster_shows_each_borrower_its_own_log_and_is_replaced_when_a_task_dies(
        tmp_path):
    tracker = cu.ProcessTracker()
    pool = cu.ClusterPool(tracker, max_clusters=1)
    try:
        first = pool.lend(1, 1)
        servers = first.pids()
        result = first.run_chief([cu.PYTHON, "-c", "print('RESULT first')"], timeout=60)
        assert result.returncode == 0 and cu.result_line(result.stdout) == "first", result.stdout

        second = pool.lend(1, 1)  # The same servers, the earlier chief's lines gone.
        assert {r: p for r, p in second.pids().items() if r != "chief"} == {
            r: p for r, p in servers.items() if r != "chief"}
        result = second.run_chief([cu.PYTHON, "-c", "print('no result')"], timeout=60)
        assert result.returncode == 0 and cu.result_line(result.stdout) is None, result.stdout
        assert all("RESULT first" not in line for line in second.output())
        with pytest.raises(RuntimeError, match="stopped by its pool"):
            second.stop()

        os.kill(servers["worker:0"], signal.SIGKILL)  # A dead task: the next lend starts anew.
        assert cu.wait_until(lambda: not cu.pid_alive(servers["worker:0"]), timeout=10)
        third = pool.lend(1, 1)
        assert third.pids()["worker:0"] != servers["worker:0"]
        assert not cu.pid_alive(servers["ps:0"])  # The old cluster was stopped whole.
        result = third.run_chief([cu.PYTHON, "-c", "print('RESULT third')"], timeout=60)
        assert cu.result_line(result.stdout) == "third", result.stdout

        pool.lend(2, 1)  # max_clusters=1: the (1, 1) cluster is stopped for it.
        assert not cu.pid_alive(third.pids()["ps:0"])
    finally:
        leaked = pool.close()
        tracker.cleanup()
    assert not leaked, leaked
