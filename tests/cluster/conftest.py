"""Fixtures for cluster tests: tagged subprocesses and LocalClusters, always cleaned up.

`procs`        a `_cluster_util.ProcessTracker`: `procs.run(cmd, timeout)`,
               `procs.popen(cmd)`, `procs.env()`, `procs.tag`. At teardown it
               kills every process group it started and every process that
               carries its tag, even if the test failed.
`make_cluster` factory for `tf_psplugin.launch.LocalCluster` with the same
               tag: `cluster = make_cluster(num_workers=2, num_ps=1, ...)`.
               Every cluster is stopped at teardown, and teardown fails the
               test if any process it started is still alive after `stop()`.
`shared_cluster` a started cluster kept for the next tests that lend one
               (in any module of tests/cluster), one per shape:
               `cluster = shared_cluster(num_workers=2, num_ps=2)`, then
               `cluster.run_chief(...)` (its stdout is this test's log only).
               For tests that only run chiefs on the cluster: no kills,
               restarts, evaluator, env or per-process measurements (use
               `make_cluster` for those). After a failed test the cluster is
               replaced, so a broken one never fails the next test.

See tests/cluster/_cluster_util.py for the helpers and a usage example.
"""

import pytest

from tests.cluster import _cluster_util as cu


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the item (`item.rep_setup`, `item.rep_call`)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture
def procs():
    tracker = cu.ProcessTracker()
    yield tracker
    tracker.cleanup()


@pytest.fixture
def make_cluster(procs):
    from tf_psplugin.launch import LocalCluster

    clusters = []

    def factory(num_workers=1, num_ps=1, **kwargs):
        env = procs.env(kwargs.pop("env", None))
        cluster = LocalCluster(num_workers, num_ps, env=env, **kwargs)
        clusters.append(cluster)
        return cluster

    yield factory
    leaked = []
    for cluster in clusters:
        cluster.stop()
        leaked += [pid for pid in cluster.all_pids() if cu.pid_alive(pid)]
    assert not leaked, f"LocalCluster.stop() left processes alive: {leaked}"


_POOLS = []  # The package's pool while it lives (for `pytest_runtest_setup`).


# Package-scoped: a started cluster serves the next tests that ask for its
# shape, in this module or the next ones (up to 3 shapes kept, the least
# recently lent stopped first); the pool's clusters are stopped before any
# test that lends none (so no idle server holds memory while such a test
# runs, as with a pool per module), and the pool is closed after the last
# cluster test, before tests/unit runs.
@pytest.fixture(scope="package")
def _cluster_pool():
    tracker = cu.ProcessTracker()
    pool = cu.ClusterPool(tracker, max_clusters=3)
    _POOLS.append(pool)
    yield pool
    _POOLS.remove(pool)
    leaked = pool.close()
    tracker.cleanup()
    assert not leaked, f"LocalCluster.stop() left processes alive: {leaked}"


def pytest_runtest_setup(item):
    """Stops the pool's idle clusters before a test that lends none (see `_cluster_pool`)."""
    if "_cluster_pool" not in item.fixturenames:
        for pool in _POOLS:
            pool.close()  # Its leaks are counted, and asserted when the pool ends.


@pytest.fixture
def shared_cluster(_cluster_pool, request):
    shapes = []

    def factory(num_workers=1, num_ps=1):
        shapes.append((num_workers, num_ps))
        return _cluster_pool.lend(num_workers, num_ps)

    yield factory
    reports = [getattr(request.node, "rep_" + when, None) for when in ("setup", "call")]
    if any(r is None or not r.passed for r in reports):
        for shape in shapes:
            _cluster_pool.discard(shape)
