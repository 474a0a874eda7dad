"""Long runs: thousands of synchronous steps with every task's threads watched.

Why this test exists: a job of 1,200 steps once died at step ~700 because
every collective op with a timeout started a sleeping OS thread in TF's
collective executor (13,860 threads per worker after 30 s). Every other test
runs a few hundred steps at most, far too few to see growth, so this one runs
3,000 steps of a small model and samples `/proc/<pid>/task` of the chief,
the workers and the PS tasks once a second.

The bound is not a number copied from one run. A TF task's threads come from
pools sized by the CPU count (the inter-op and intra-op pools, tf.data's
private pool, the eager executors of each client stream, the collective
executor's queue) or fixed in number (gRPC's completion-queue threads, the
plugin's dispatch threads: a few per worker). They are created when a task
starts or at its first steps; none is per step. So each task may add at most
`_POOLS_PER_TASK` pools of `nproc` threads plus `_FIXED_PER_TASK` threads to
the count it had when it was idle (servers: up and reachable, before the chief
connects; chief: strategy built, before its first step), however long it
runs. A per-op or per-step leak passes that within seconds.
"""

import os
import threading
import time

import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "long_run.py")
TOTAL_STEPS = 3000
STEPS_PER_EXECUTION = 10
_POOLS_PER_TASK = 8
_FIXED_PER_TASK = 32

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


class _Sampler:
    """Samples the thread count of every task of a LocalCluster once a second."""

    def __init__(self, cluster):
        self._cluster = cluster
        self.samples = {}  # role -> [(t, threads)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(10)

    def _run(self):
        start = time.monotonic()
        while not self._stop.wait(1.0):
            for role, pid in self._cluster.pids().items():
                count = _threads(pid)
                if count:
                    self.samples.setdefault(role, []).append((time.monotonic() - start, count))


def _steps(cluster):
    return [int(line.split("STEP ")[1]) for line in cluster.output("chief") if "STEP " in line]


@pytest.mark.timeout(900)
def test_thousands_of_steps_keep_every_task_thread_count_bounded(make_cluster):
    nproc = os.cpu_count() or 1
    allowance = _POOLS_PER_TASK * nproc + _FIXED_PER_TASK
    cluster = make_cluster(num_workers=2, num_ps=2)
    cluster.start_servers()
    addresses = cluster.config.cluster
    for job in ("worker", "ps"):
        for address in addresses[job]:
            host, _, port = address.rpartition(":")
            assert cu.wait_for_port(host, int(port), 120), f"{job} at {address} never came up"
    time.sleep(2.0)  # Servers listen before their pools are all up.
    idle = {role: _threads(pid) for role, pid in cluster.pids().items()}
    sampler = _Sampler(cluster)
    sampler.start()
    result = []
    runner = threading.Thread(target=lambda: result.append(cluster.run_chief(
        [cu.PYTHON, SCRIPT, str(TOTAL_STEPS), str(STEPS_PER_EXECUTION)], timeout=800)),
        daemon=True)
    runner.start()
    assert cu.wait_until(lambda: 0 in _steps(cluster) or not runner.is_alive(), 300)
    idle["chief"] = _threads(cluster.pids()["chief"])
    runner.join(820)
    sampler.stop()
    assert result, "the chief did not finish"
    log = result[0].stdout
    assert result[0].returncode == 0, log[-6000:]
    assert f"DONE {TOTAL_STEPS}" in log, log[-6000:]
    report = {}
    for role, samples in sampler.samples.items():
        peak = max(count for _, count in samples)
        report[role] = (idle.get(role), peak, samples[-1][1])
    print("threads (idle, peak, last) per task:", report)
    assert set(report) >= {"chief", "worker:0", "worker:1", "ps:0", "ps:1"}, report
    over = {role: r for role, r in report.items()
            if r[0] is not None and r[1] > r[0] + allowance}
    assert not over, (
        f"thread counts grew past idle + {allowance} ({_POOLS_PER_TASK} pools of {nproc} "
        f"threads + {_FIXED_PER_TASK}): (idle, peak, last) = {over}")
