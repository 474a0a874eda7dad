"""Failover and the step watchdog, without a cluster.

The watchdog and the no-restart path are decided by a few lines of logic
each; these tests drive them with fake steps and a fake strategy (one
listening socket stands in for a healthy task, a closed port for a dead one).
The multi-process behaviour is in tests/cluster/test_failover.py.
"""

import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import tensorflow as tf

from tf_psplugin import errors
from tf_psplugin._internal import identity
from tf_psplugin.cluster import liveness
from tf_psplugin.cluster import restarts as restarts_lib
from tf_psplugin.fault import elastic
from tf_psplugin.fault import failover
from tf_psplugin.runtime import coordinator as coordinator_lib
from tf_psplugin.runtime import delayed_calls
from tf_psplugin.runtime import step_values
from tf_psplugin.runtime import watchdog as watchdog_lib
from tf_psplugin.state import checkpoint as checkpoint_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bare_coordinator(num_workers=2, timeout=5.0, ps_addresses=(), worker_addresses=()):
    """A HybridClusterCoordinator with only the state the watchdog reads, and its watchdog."""
    # ClusterCoordinator.__new__ wants a strategy; the watchdog needs none.
    coord = object.__new__(coordinator_lib.HybridClusterCoordinator)
    coord._lock = threading.Lock()  # pylint: disable=protected-access
    coord._idle = threading.Condition(coord._lock)  # pylint: disable=protected-access
    coord._error = None  # pylint: disable=protected-access
    coord._inflight = 0  # pylint: disable=protected-access
    coord._num_workers = num_workers  # pylint: disable=protected-access
    coord.step_timeout_seconds = timeout
    coord.recovering = False
    coord._watchdog = watchdog_lib.StepWatchdog(  # pylint: disable=protected-access
        coord._lock, coord._on_hung_step, ps_addresses,  # pylint: disable=protected-access
        worker_addresses)
    coord._delayed = delayed_calls.DelayedCalls(  # pylint: disable=protected-access
        "test-cancel-peers", on_error=lambda e: coord._on_internal_error(e, "test"))  # pylint: disable=protected-access
    coord._warm = [identity.IdentityMap() for _ in range(num_workers)]  # pylint: disable=protected-access
    coord._cold_call_seconds = 0.0  # pylint: disable=protected-access
    return coord


@pytest.fixture
def listening(monkeypatch):
    """Two addresses: one that accepts connections, one that does not (probes faked)."""
    alive, dead = "10.0.0.1:1", "10.0.0.2:1"
    monkeypatch.setattr(liveness, "accepts_connections", lambda address, timeout=1.0: {
        alive: True, dead: False}[address])
    return alive, dead


def _stuck_step_message(coord, **state):
    for name, value in state.items():
        setattr(coord._watchdog, name, value)  # pylint: disable=protected-access
    step = _step(coord, 3)
    now = time.monotonic()
    # Past the step's limit of 10 s, or the input's while a worker makes its input.
    age = watchdog_lib.input_limit(10.0) if state.get("_creating_input") else 10.0
    running = {0: (step, now - age - 2.0), 1: (step, now - age - 1.0)}
    coord._watchdog.running = running  # pylint: disable=protected-access
    return coord._watchdog.fail_hung_step(10.0).message  # pylint: disable=protected-access


def test_watchdog_says_what_a_stuck_first_step_waits_for(listening):
    alive, dead = listening
    message = _stuck_step_message(_bare_coordinator(ps_addresses=[alive, dead],
                                                    worker_addresses=[alive, alive]))
    assert "ps:1 at %s does not accept connections" % dead in message
    message = _stuck_step_message(_bare_coordinator(ps_addresses=[alive],
                                                    worker_addresses=[alive, alive]),
                                  _creating_input={1})
    assert "worker:1 is still creating its input" in message
    message = _stuck_step_message(_bare_coordinator(ps_addresses=[alive],
                                                    worker_addresses=[alive, alive]))
    assert "no step has finished yet" in message
    assert "input has not produced its first batch" in message
    message = _stuck_step_message(_bare_coordinator(ps_addresses=[alive],
                                                    worker_addresses=[alive, alive]),
                                  finished_steps=5)
    assert "no step has finished yet" not in message, message
    assert "input is stalled" in message, message


def _step(coord, step_id, num_workers=2):
    return step_values.SyncStep(
        coord, step_id, [None] * num_workers, (), {}, tf.TensorSpec([], tf.float32), num_workers)


def test_watchdog_fails_a_step_stuck_longer_than_the_limit_and_names_its_workers():
    coord = _bare_coordinator()
    step = _step(coord, 7)
    now = time.monotonic()
    coord._watchdog.running = {0: (step, now - 12.0), 1: (step, now - 11.0)}  # pylint: disable=protected-access
    error = coord._watchdog.fail_hung_step(10.0)  # pylint: disable=protected-access
    assert isinstance(error, tf.errors.DeadlineExceededError)
    assert "step 7 made no progress for 10 s" in error.message
    assert liveness.is_task_failure(error)
    assert liveness.tasks_named_in(error) == {("worker", 0), ("worker", 1)}
    assert coord._error is error and step.error is error  # pylint: disable=protected-access
    # Worker 0's part carries the step's result: its RemoteValue fails too.
    assert step.remote_value._status_available_event.is_set()  # pylint: disable=protected-access
    # A hang is reported once, not at every poll.
    assert coord._watchdog.fail_hung_step(10.0) is None  # pylint: disable=protected-access


def test_watchdog_leaves_steps_within_the_limit_alone():
    coord = _bare_coordinator()
    step = _step(coord, 1)
    coord._watchdog.running = {0: (step, time.monotonic() - 3.0)}  # pylint: disable=protected-access
    assert coord._watchdog.fail_hung_step(10.0) is None  # pylint: disable=protected-access
    assert coord._error is None and step.error is None  # pylint: disable=protected-access


def test_watchdog_names_only_the_workers_still_in_the_oldest_hung_step():
    coord = _bare_coordinator(num_workers=3)
    old, new = _step(coord, 3, 3), _step(coord, 4, 3)
    now = time.monotonic()
    coord._watchdog.running = {1: (old, now - 30.0), 2: (old, now - 29.0),  # pylint: disable=protected-access
                      0: (new, now - 20.0)}
    error = coord._watchdog.fail_hung_step(10.0)  # pylint: disable=protected-access
    assert "step 3 " in error.message
    assert liveness.tasks_named_in(error) == {("worker", 1), ("worker", 2)}
    # Worker 0 is not in the failed step: step 3's result is not worker 0's to fail.
    assert not old.remote_value._status_available_event.is_set()  # pylint: disable=protected-access


def test_a_finished_part_is_no_longer_watched():
    coord = _bare_coordinator(num_workers=1)
    step = _step(coord, 1, 1)
    coord._inflight = 1  # pylint: disable=protected-access
    coord._watchdog.running = {0: (step, time.monotonic() - 60.0)}  # pylint: disable=protected-access
    coord._finish_part(step, 0, None, None)  # pylint: disable=protected-access
    assert coord._watchdog.running == {}  # pylint: disable=protected-access
    assert coord._watchdog.fail_hung_step(10.0) is None  # pylint: disable=protected-access


def test_watchdog_thread_fires_within_the_limit_plus_one_poll():
    coord = _bare_coordinator(timeout=0.5)
    coord._stopped = threading.Event()  # pylint: disable=protected-access
    step = _step(coord, 2)
    coord._watchdog.running = {0: (step, time.monotonic())}  # pylint: disable=protected-access
    watchdog, stopped = coord._watchdog, coord._stopped  # pylint: disable=protected-access
    thread = threading.Thread(target=watchdog.run, args=(coord.step_timeout_seconds, stopped),
                              daemon=True)
    start = time.monotonic()
    thread.start()
    with coord._lock:  # pylint: disable=protected-access
        assert coord._idle.wait_for(lambda: coord._error is not None, timeout=5.0)  # pylint: disable=protected-access
    assert 0.5 <= time.monotonic() - start < 2.0
    coord._stopped.set()  # pylint: disable=protected-access
    thread.join(2.0)
    assert not thread.is_alive()


class _Worker:
    """What the dispatch loop reads of a stock Worker."""

    def __init__(self, index):
        self.worker_index = index
        self.device_name = f"/job:worker/replica:0/task:{index}"


def _errors_coordinator():
    coord = _bare_coordinator()
    coord._generation = 0  # pylint: disable=protected-access
    coord._synchronous = True  # pylint: disable=protected-access
    coord.failover = None
    return coord


@pytest.mark.timeout(60)  # Before the fix this waited forever.
def test_a_fetch_behind_a_failed_step_raises_its_error_instead_of_waiting_forever():
    # Step 8's value is set by worker 0's thread, which is stuck in step 7.
    coord = _errors_coordinator()
    later = _step(coord, 8)
    error = tf.errors.DeadlineExceededError(None, None, "step 7 made no progress")
    coord._error = error  # pylint: disable=protected-access
    start = time.monotonic()
    with pytest.raises(tf.errors.DeadlineExceededError, match="step 7"):
        later.remote_value.fetch()
    assert time.monotonic() - start < 5.0
    assert coord._error is None and coord.generation == 1  # Raised once.  # pylint: disable=protected-access


@pytest.mark.timeout(60)  # Before the fix this waited forever.
def test_a_fetch_of_a_step_scheduled_before_a_raised_error_is_cancelled():
    coord = _errors_coordinator()
    old = _step(coord, 3)  # generation 0, never finished
    coord._generation = 1  # An error was raised to the user since.  # pylint: disable=protected-access
    with pytest.raises(tf.errors.CancelledError, match="earlier step failed"):
        old.remote_value.fetch()


@pytest.mark.timeout(60)  # Before the fix this waited forever.
def test_a_step_started_on_one_worker_runs_on_every_worker_despite_a_later_error(monkeypatch):
    coord = _errors_coordinator()
    coord._generation = 0  # pylint: disable=protected-access
    ran = []
    monkeypatch.setattr(coordinator_lib, "_new_sync_executor", lambda: None)
    monkeypatch.setattr(coordinator_lib, "_release_executor", lambda ex: None)
    monkeypatch.setattr(coord, "_execute", lambda step, worker, ex: ran.append(
        (step.step_id, worker.worker_index)), raising=False)

    started, later = _step(coord, 1), _step(coord, 2)
    coord._inflight = 2  # pylint: disable=protected-access

    def run_parts(worker_index, *steps):
        q = __import__("queue").Queue()
        for step in steps:
            q.put(step_values.StepPart(step, worker_index))
        q.put(coordinator_lib._STOP)  # pylint: disable=protected-access
        coord._worker_loop(_Worker(worker_index), q)  # pylint: disable=protected-access

    run_parts(0, started)  # Worker 0 starts step 1 before anything failed.
    coord._error = tf.errors.UnavailableError(None, None, "worker:1 gone")  # pylint: disable=protected-access
    run_parts(1, started, later)  # Then a failure is recorded.
    run_parts(0, later)
    # Step 1 ran on both workers (a lone part would wait in its collectives
    # forever); step 2, reached after the failure, is cancelled on both.
    assert ran == [(1, 0), (1, 1)]
    assert started.cancelled is False and later.cancelled is True


class _Manager:
    def __init__(self):
        self.cancelled_at = None

    def start_cancel(self):
        self.cancelled_at = time.monotonic()


@pytest.mark.timeout(60)
def test_a_part_sent_after_a_peer_failed_runs_and_the_cancellation_waits_for_it():
    # Worker 0 failed step 4 (a bad record) while worker 1 was still busy
    # with step 3. Worker 1's part still runs, so its input advances like
    # worker 0's whatever the timing; the step's cancellation is sent only
    # once that part was sent (sent earlier, it would stop the part from
    # running; sent too soon after, TF could lose it), a grace later.
    coord = _errors_coordinator()
    calls = []
    step = _step(coord, 4)
    step.cancellation_manager = _Manager()
    step.functions = [lambda: None,
                      lambda: calls.append(step.cancellation_manager.cancelled_at)]
    error = tf.errors.InvalidArgumentError(None, None, "bad record on worker 0")
    coord._finish_part(step, 0, None, error)  # pylint: disable=protected-access
    time.sleep(0.2)
    assert step.cancellation_manager.cancelled_at is None  # Worker 1 was not sent yet.
    executor = coordinator_lib._new_sync_executor()  # pylint: disable=protected-access
    coord._execute(step, _Worker(1), executor)  # pylint: disable=protected-access
    assert calls == [None] and set(step.sent_at) == {1}  # Ran, not cancelled first.
    deadline = time.monotonic() + 10.0
    while step.cancellation_manager.cancelled_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    waited = step.cancellation_manager.cancelled_at - step.sent_at[1]
    assert coordinator_lib.CANCEL_GRACE_SECONDS - 0.05 <= waited


@pytest.mark.parametrize("sent_ago,expected_delay", [
    (None, 0.0),  # No part was sent: nothing can miss the cancellation.
    (5.0, 0.0),  # Sent long ago: the worker runs the call, cancel at once.
    (0.0, coordinator_lib.CANCEL_GRACE_SECONDS),  # Just sent: give it time to start.
])
def test_a_peer_is_cancelled_only_once_its_call_has_had_time_to_start(sent_ago, expected_delay):
    coord = _errors_coordinator()
    step = _step(coord, 4)
    step.cancellation_manager = _Manager()
    start = time.monotonic()
    step.finished_parts.add(1)  # Worker 1's part failed.
    if sent_ago is not None:
        step.sent_at[0] = start - sent_ago
    else:
        step.finished_parts.add(0)  # Ended without sending (its input failed).
    coord._cancel_waiting_peers(  # pylint: disable=protected-access
        step, tf.errors.InvalidArgumentError(None, None, "bad record on worker 1"))
    deadline = time.monotonic() + expected_delay + 5.0
    while step.cancellation_manager.cancelled_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    delay = step.cancellation_manager.cancelled_at - start
    assert expected_delay - 0.05 <= delay < expected_delay + 1.0


def test_a_task_failure_is_left_to_failover_not_cancelled():
    coord = _errors_coordinator()
    step = _step(coord, 4)
    step.cancellation_manager = _Manager()
    coord._cancel_waiting_peers(  # pylint: disable=protected-access
        step, tf.errors.UnavailableError(None, None, "worker:1 gone: Socket closed"))
    time.sleep(0.1)
    assert step.cancellation_manager.cancelled_at is None


@pytest.mark.parametrize("policy,env,expected", [
    (failover.FailoverPolicy(), None, True),
    (failover.FailoverPolicy(), "0", False),
    (failover.FailoverPolicy(), "1", True),
    (failover.FailoverPolicy(task_restarts=True), "0", True),
    (failover.FailoverPolicy(task_restarts=False), "1", False),
])
def test_restarts_expected_from_policy_then_launcher(policy, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv(failover.TASK_RESTARTS_ENV, raising=False)
    else:
        monkeypatch.setenv(failover.TASK_RESTARTS_ENV, env)
    assert policy.restarts_expected() is expected


class _FakeResolver:
    def __init__(self, spec):
        self._spec = spec

    def cluster_spec(self):
        return tf.train.ClusterSpec(self._spec)


class _FakeStrategy:
    def __init__(self, spec):
        self._cluster_resolver = _FakeResolver(spec)


class _FakeExtended:
    committed_steps = None


class _FakeCoordinator:
    num_workers = 2
    preferred_replica = 0

    def wait_until_idle(self, timeout):
        return True

    def running_parts(self):
        return {}


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_restarts_recovery_stops_at_once_naming_the_dead_task(monkeypatch):
    healthy = socket.socket()
    healthy.bind(("127.0.0.1", 0))
    healthy.listen(16)
    up = f"127.0.0.1:{healthy.getsockname()[1]}"
    dead = f"127.0.0.1:{_closed_port()}"
    spec = {"chief": [up], "worker": [up, dead], "ps": [up]}
    aborts = []
    # The listening socket stands for a healthy task of another process.
    monkeypatch.setattr(liveness, "served_by_this_process", lambda address: False)
    controller = failover.FailoverController(
        _FakeStrategy(spec), failover.FailoverPolicy(task_restarts=False,
                                                     recovery_timeout_seconds=300))
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])
    monkeypatch.setattr(controller, "_restart_surviving_workers",
                        lambda *a: aborts.append(a) or set())
    error = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 is gone")
    start = time.monotonic()
    try:
        with pytest.raises(failover.FailoverError) as raised:
            controller.recover(_FakeCoordinator(), error)
    finally:
        healthy.close()
    message = str(raised.value)
    assert time.monotonic() - start < 10.0  # Not recovery_timeout_seconds.
    assert f"worker:1 at {dead} failed and nothing will restart it" in message
    assert "no checkpoint was written" in message and "Fix:" in message
    assert "worker:0" not in message
    assert raised.value.__cause__ is error
    assert not isinstance(raised.value, failover.TaskFailedError)
    assert raised.value.exit_code == 1  # Restarting the chief alone would not help.
    assert not aborts  # Healthy workers live on.


class _StuckCoordinator(_FakeCoordinator):
    """A survivor's part never ends (blocked in a collective with the dead peer)."""

    def __init__(self):
        self.waits = []

    def wait_until_idle(self, timeout):
        self.waits.append(timeout)
        return False

    def running_parts(self):
        return {0: (5, 3.0)}


@pytest.mark.parametrize("policy, waited", [
    (failover.FailoverPolicy(task_restarts=False), 10.0),  # The default.
    (failover.FailoverPolicy(task_restarts=False, settle_seconds=0.5), 0.5),
    (failover.FailoverPolicy(task_restarts=False, settle_seconds=0), 0),
])
def test_recovery_waits_settle_seconds_for_the_failed_steps_parts(monkeypatch, policy, waited):
    healthy = socket.socket()
    healthy.bind(("127.0.0.1", 0))
    healthy.listen(16)
    up = f"127.0.0.1:{healthy.getsockname()[1]}"
    spec = {"chief": [up], "worker": [up, f"127.0.0.1:{_closed_port()}"], "ps": [up]}
    monkeypatch.setattr(liveness, "served_by_this_process", lambda address: False)
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])
    said = []
    monkeypatch.setattr(failover, "_say", said.append)
    controller = failover.FailoverController(_FakeStrategy(spec), policy)
    coordinator = _StuckCoordinator()
    error = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 is gone")
    try:
        with pytest.raises(failover.FailoverError):
            controller.recover(coordinator, error)
    finally:
        healthy.close()
    assert coordinator.waits == [waited]
    assert any("worker:0 (step 5, 3 s); going on without them" in m for m in said), said


@pytest.mark.parametrize("value", [-1.0, "10", None, True])
def test_failover_policy_refuses_a_bad_settle_seconds(value):
    with pytest.raises(errors.StrategyError, match=r"settle_seconds=.*>= 0\. Fix: "):
        failover.FailoverPolicy(settle_seconds=value)


def test_with_restarts_recovery_raises_task_failed_at_once_for_the_restart(monkeypatch):
    """The library never waits for the task or replaces the process itself."""
    healthy = socket.socket()
    healthy.bind(("127.0.0.1", 0))
    healthy.listen(16)
    up = f"127.0.0.1:{healthy.getsockname()[1]}"
    dead = f"127.0.0.1:{_closed_port()}"
    spec = {"chief": [up], "worker": [up, dead], "ps": [up]}
    # The listening socket stands for a healthy task of another process.
    monkeypatch.setattr(liveness, "served_by_this_process", lambda address: False)
    controller = failover.FailoverController(
        _FakeStrategy(spec), failover.FailoverPolicy(task_restarts=True,
                                                     recovery_timeout_seconds=300))
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])
    monkeypatch.setattr(controller, "_restart_surviving_workers",
                        lambda *a: {("worker", 0)})
    execs = []
    monkeypatch.setattr(failover.os, "execv", lambda *a: execs.append(a), raising=False)
    error = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 is gone")
    start = time.monotonic()
    try:
        with pytest.raises(failover.TaskFailedError) as raised:
            controller.recover(_FakeCoordinator(), error)
    finally:
        healthy.close()
    e = raised.value
    assert time.monotonic() - start < 10.0
    assert e.exit_code == failover.RESTART_EXIT_CODE == 138
    assert e.failed_tasks == ["worker:1"]
    assert e.addresses == {"worker:0": up, "worker:1": dead}  # What elastic.run waits for.
    assert e.checkpoint is None and "starts over" in str(e)
    assert f"worker:1 at {dead} failed" in str(e) and "status 138" in str(e)
    assert "Fix:" in str(e) and "elastic.run" in str(e)
    assert e.__cause__ is error and not execs


class _Counters:
    """Stands for the strategy's per-worker step counters (read by `_read_replica`)."""

    def __init__(self, per_worker):
        self.per_worker = per_worker  # {worker: (reduced, committed)}, or an error.
        self.reduced_steps, self.committed_steps = "reduced", "committed"

    def read(self, var, worker):
        value = self.per_worker[worker]
        if isinstance(value, Exception):
            raise value
        return value[0] if var == "reduced" else value[1]


class _Saver:
    def __init__(self, coordinator):
        self.coordinator, self.saved_from = coordinator, []

    def save_emergency(self):
        self.saved_from.append(self.coordinator.preferred_replica)
        return "/m/ckpt-emergency"


@pytest.mark.parametrize("survivors,saved_from", [
    ({0: (7, 7), 2: (7, 7)}, [0]),  # Consistent: saved, labelled 7.
    # worker:0 read first looks clean, but worker:2 applied part of step 8
    # (its table rows are on the PS): a checkpoint labelled 7 would hold them.
    ({0: (7, 7), 2: (8, 7)}, []),
    ({0: (8, 8), 2: (7, 7)}, []),  # Survivors one step apart: no single label.
    ({0: (7, 7), 2: tf.errors.UnavailableError(None, None, "gone")}, []),  # Unknown.
])
def test_emergency_checkpoint_needs_every_survivor_at_the_same_committed_step(
        monkeypatch, survivors, saved_from):
    spec = {"chief": ["h:0"], "worker": ["h:1", "h:2", "h:3"], "ps": ["h:4"]}
    strategy = _FakeStrategy(spec)
    strategy.extended = counters = _Counters(survivors)
    monkeypatch.setattr(failover, "_read_replica", counters.read)
    controller = failover.FailoverController(strategy, failover.FailoverPolicy())
    coordinator = _FakeCoordinator()
    coordinator.num_workers = 3
    saver = _Saver(coordinator)
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])
    checkpoint_lib.register_checkpointer(saver)
    path = controller._save_what_survives(coordinator, {("worker", 1)})
    assert saver.saved_from == saved_from
    assert path == ("/m/ckpt-emergency" if saved_from else None)


def _run_python(code, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    # PYTHONPATH: the package of this checkout, not whichever one is installed.
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                                PYTHONPATH=REPO_ROOT))


def test_uncaught_task_failed_error_exits_138_with_one_line_after_cleanup(tmp_path):
    result = _run_python("""
        import atexit
        from tf_psplugin.fault import failover
        atexit.register(lambda: print("atexit ran", flush=True))
        from tf_psplugin._internal import patches
        patches.install("exit_on_failover_error")
        patches.install("exit_on_failover_error")  # Idempotent.
        try:
            raise failover.TaskFailedError("worker:1 at h:1 failed; Fix: restart",
                                           ["worker:1"], {"worker:1": "h:1"}, None)
        finally:
            print("finally ran", flush=True)
    """, tmp_path)
    assert result.returncode == 138, result.stderr
    assert "finally ran" in result.stdout and "atexit ran" in result.stdout
    # One line of ours, no traceback. (TensorFlow's own import lines may come
    # first: TF >= 2.16 prints them whatever TF_CPP_MIN_LOG_LEVEL says, and a
    # program importing tf_psplugin sees TF's import output unchanged.)
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if "tf_psplugin" in line]
    assert ours == ["tf_psplugin: worker:1 at h:1 failed; Fix: restart"], result.stderr
    assert result.stderr.strip().splitlines()[-1] == ours[0]


def test_uncaught_other_errors_keep_their_traceback_and_status(tmp_path):
    result = _run_python("""
        from tf_psplugin._internal import patches
        patches.install("exit_on_failover_error")
        raise ValueError("a user bug")
    """, tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: a user bug" in result.stderr


def _task_failed(addresses, checkpoint=None):
    return failover.TaskFailedError("worker:1 failed", sorted(addresses), addresses, checkpoint)


def test_elastic_run_calls_again_after_a_task_failure_once_the_task_is_back(monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(elastic.time, "sleep", lambda s: None)
    calls = []

    def train(x, y=0):
        calls.append(os.environ[restarts_lib.CHIEF_RESTARTS_ENV])
        if len(calls) < 3:
            raise _task_failed({"worker:1": address})
        return x + y

    try:
        assert elastic.run(train, 4, y=1, recovery_timeout_seconds=5) == 5
    finally:
        listener.close()
    assert calls == ["0", "1", "2"]


def test_elastic_run_gives_up_when_the_task_never_returns(monkeypatch):
    dead = f"127.0.0.1:{_closed_port()}"

    def train():
        raise _task_failed({"worker:1": dead}, checkpoint="/m/ckpt-7")

    start = time.monotonic()
    with pytest.raises(failover.FailoverError) as raised:
        elastic.run(train, recovery_timeout_seconds=1, poll_seconds=0.1)
    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert f"worker:1 at {dead} did not come back within 1 s" in message
    assert "resumes from checkpoint /m/ckpt-7" in message and "Fix:" in message
    assert not isinstance(raised.value, failover.TaskFailedError)


def test_elastic_run_waits_as_the_strategys_failover_policy_says(monkeypatch):
    waits = []
    monkeypatch.setattr(elastic, "_wait_for_tasks", lambda e, t, p: waits.append((t, p)))
    policy = failover.FailoverPolicy(recovery_timeout_seconds=42.0, poll_seconds=0.25)

    def failing(*errors):
        pending = list(errors)

        def train():
            if pending:
                raise pending.pop(0)
            return "done"

        return train

    def with_policy():  # What a strategy built with `failover=policy` raises.
        return failover.TaskFailedError("worker:1 failed", ["worker:1"], {}, None, policy=policy)

    assert elastic.run(failing(with_policy(), _task_failed({}))) == "done"
    assert waits == [(42.0, 0.25), (300.0, 0.5)]  # The policy's values, else the defaults.
    waits.clear()
    assert elastic.run(failing(with_policy()), recovery_timeout_seconds=7.0,
                       poll_seconds=0.1) == "done"
    assert waits == [(7.0, 0.1)]  # Explicit arguments win.


def test_elastic_run_spends_its_budget_then_stops(monkeypatch):
    monkeypatch.setattr(elastic, "_wait_for_tasks", lambda *a: None)
    calls = []

    def train():
        calls.append(1)
        raise _task_failed({})

    with pytest.raises(failover.FailoverError, match="after 2 recoveries") as raised:
        elastic.run(train, max_restarts=2)
    assert len(calls) == 3 and isinstance(raised.value.__cause__, failover.TaskFailedError)


def test_elastic_run_passes_other_errors_through_unchanged():
    def train():
        raise ValueError("a user bug")

    with pytest.raises(ValueError, match="a user bug"):
        elastic.run(train)


def test_registered_checkpointers_do_not_outlive_their_owner(monkeypatch):
    """A notebook that builds many models must not keep every one alive."""
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])

    class Checkpointer:
        def save_emergency(self):
            return None

    kept, dropped = Checkpointer(), Checkpointer()
    checkpoint_lib.register_checkpointer(kept)
    checkpoint_lib.register_checkpointer(dropped)
    checkpoint_lib.register_checkpointer(kept)  # Once only.
    assert checkpoint_lib.live_checkpointers() == [kept, dropped]
    probe = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert probe() is None
    assert checkpoint_lib.live_checkpointers() == [kept]


def test_served_by_this_process_tells_an_in_process_task_from_another_process():
    mine = socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen(1)
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import socket, sys, time
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
            print(s.getsockname()[1], flush=True); time.sleep(60)""")],
        stdout=subprocess.PIPE, text=True)
    try:
        other_port = int(other.stdout.readline())
        assert liveness.served_by_this_process(f"127.0.0.1:{mine.getsockname()[1]}")
        assert liveness.served_by_this_process(f"localhost:{mine.getsockname()[1]}")
        assert not liveness.served_by_this_process(f"127.0.0.1:{other_port}")
        assert not liveness.served_by_this_process(f"127.0.0.1:{_closed_port()}")
        assert not liveness.served_by_this_process("no-port")
    finally:
        other.kill()
        other.wait(10)
        mine.close()


def test_an_in_process_cluster_stops_with_the_error_instead_of_aborting_its_workers(
        monkeypatch):
    # TF's tests and its PSS tutorial serve every task in the chief's own
    # process: aborting a "surviving worker" for a restart ended the chief
    # (SIGABRT), so join() never raised (TF's testCancellation).
    inside = socket.socket()
    inside.bind(("127.0.0.1", 0))
    inside.listen(16)
    up = f"127.0.0.1:{inside.getsockname()[1]}"
    spec = {"chief": [up], "worker": [up, up], "ps": [up]}
    strategy = _FakeStrategy(spec)
    strategy.extended = _FakeExtended()  # No step counters to probe the workers with.
    controller = failover.FailoverController(strategy, failover.FailoverPolicy(task_restarts=True))
    monkeypatch.setattr(checkpoint_lib, "_checkpointers", [])
    aborts = []
    monkeypatch.setattr(controller, "_restart_surviving_workers",
                        lambda *a: aborts.append(a) or set())
    error = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1 is gone")
    try:
        with pytest.raises(failover.FailoverError) as raised:
            controller.recover(_FakeCoordinator(), error)
    finally:
        inside.close()
    assert not aborts
    assert not isinstance(raised.value, failover.TaskFailedError)
    assert "run in this process (an in-process cluster)" in str(raised.value)
    assert "collective_timeout_seconds" in str(raised.value)
    assert raised.value.__cause__ is error
