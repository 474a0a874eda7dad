"""The `shared_cluster` fixture's pool: one started cluster lent test after test, never stale.

A lent cluster must show each test only its own chiefs' log (else an earlier
test's `RESULT` or `DONE` line could pass a later test), must be replaced
when a task died, and must leave no process behind.
"""

import json
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


_FAILING_TESTS = '''
    import json, os, sys

    from tests.cluster import _cluster_util as cu

    OUT = os.environ["FIXTURE_CLEANUP_OUT"]
    SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
    # A sleeper that leaves a grandchild in a session of its own (no group kill reaches it).
    FORKER = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
              "[sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
              "time.sleep(600)"]

    def record(name, pids):
        with open(os.path.join(OUT, name + ".json"), "w") as f:
            json.dump(pids, f)

    def test_a_procs_and_make_cluster(procs, make_cluster):
        procs.popen(FORKER)
        cluster = make_cluster(num_workers=1, num_ps=1, servers="command")
        cluster.start_servers(SLEEP)
        # The forker, its grandchild, the ps and the worker all carry the tag.
        assert cu.wait_until(lambda: len(cu.tagged_pids(procs.tag)) >= 4, timeout=60)
        record("a", cu.tagged_pids(procs.tag))
        assert False, "fails on purpose"

    def test_b_shared_cluster(shared_cluster):
        record("b", list(shared_cluster(num_workers=1, num_ps=1).pids().values()))
        assert False, "fails on purpose"

    def test_c_the_failed_tests_processes_are_gone(shared_cluster):
        with open(os.path.join(OUT, "a.json")) as f:
            started = json.load(f)  # Killed by the fixtures' teardown, not at exit.
        assert cu.wait_until(lambda: not [p for p in started if cu.pid_alive(p)], timeout=10)
        with open(os.path.join(OUT, "b.json")) as f:
            old = json.load(f)
        new = list(shared_cluster(num_workers=1, num_ps=1).pids().values())
        assert not set(old) & set(new)  # The failed test's cluster was replaced ...
        assert not [pid for pid in old if cu.pid_alive(pid)]  # ... and stopped whole.
        record("c", new)
'''


@pytest.mark.timeout(240)
def test_the_fixtures_kill_every_process_a_failing_test_started(tmp_path, procs):
    """`procs`, `make_cluster` and `shared_cluster` after a test that failed: nothing left.

    Runs three tests in a pytest of their own with tests/cluster/conftest.py's
    fixtures: the first two start processes (one in a session of its own, as
    a grandchild) and fail; the third checks that the first one's processes
    are gone and that the second one's shared cluster was stopped and
    replaced. When that pytest has ended, no process any of them started
    may be alive.
    """
    session = tmp_path / "session"
    session.mkdir()
    (session / "pytest.ini").write_text("[pytest]\n")
    (session / "conftest.py").write_text(
        "from tests.cluster.conftest import (  # noqa: F401\n"
        "    _cluster_pool, make_cluster, procs, pytest_runtest_makereport,\n"
        "    pytest_runtest_setup, shared_cluster)\n")
    cu.python_script(session, _FAILING_TESTS, "test_failing.py")
    result = procs.run([cu.PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--rootdir", str(session), str(session)], timeout=200,
                       env={"FIXTURE_CLEANUP_OUT": str(tmp_path)}, cwd=str(session))
    summary = result.stdout.strip().splitlines()[-1]
    # Two failures, no teardown error (a leak `make_cluster` or the pool found).
    assert summary.startswith("2 failed, 1 passed in "), result.stdout[-6000:]
    assert result.stdout.count("fails on purpose") >= 2, result.stdout[-6000:]
    started = []
    for name in ("a", "b", "c"):
        with open(tmp_path / f"{name}.json") as f:
            started += json.load(f)
    assert len(started) >= 8, started  # 4 tagged in a, a (1, 1) cluster in b and in c.
    assert cu.wait_until(lambda: not [p for p in started if cu.pid_alive(p)], timeout=10), [
        p for p in started if cu.pid_alive(p)]
