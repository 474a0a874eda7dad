"""Fixtures for cluster tests: tagged subprocesses and LocalClusters, always cleaned up.

`procs`        a `_cluster_util.ProcessTracker`: `procs.run(cmd, timeout)`,
               `procs.popen(cmd)`, `procs.env()`, `procs.tag`. At teardown it
               kills every process group it started and every process that
               carries its tag, even if the test failed.
`make_cluster` factory for `tf_psplugin.launch.LocalCluster` with the same
               tag: `cluster = make_cluster(num_workers=2, num_ps=1, ...)`.
               Every cluster is stopped at teardown, and teardown fails the
               test if any process it started is still alive after `stop()`.

See tests/cluster/_cluster_util.py for the helpers and a usage example.
"""

import pytest

from tests.cluster import _cluster_util as cu


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
