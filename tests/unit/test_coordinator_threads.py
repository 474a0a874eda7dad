"""The coordinator's own threads never die silently, and never wait forever.

Issue 43: under TF's test harness, which replaces `threading.Thread` with a
wrapper that requires ``target=``, the `threading.Timer` the coordinator
used to cancel a failed step's peers raised inside a dispatch thread; the
thread ended and `join()` waited forever. These tests run the dispatch
loops, the peer cancellation and the watchdog with fake steps (no cluster),
under that harness too.
"""

import importlib.util
import os
import queue
import threading
import time

import pytest
import tensorflow as tf

from tf_psplugin.errors import StrategyError
from tf_psplugin.runtime import coordinator as coordinator_lib
from tf_psplugin.runtime import delayed_calls
from tf_psplugin.runtime import step_values
from tf_psplugin.runtime import watchdog as watchdog_lib
from tests.unit.test_failover_unit import _Worker, _errors_coordinator, _step


def _load_checks():
    """tests/cluster/scripts/checks.py, which holds TF's harness thread for the scripts too."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "cluster", "scripts",
                        "checks.py")
    spec = importlib.util.spec_from_file_location("tf_psplugin_script_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checks = _load_checks()

# pylint: disable=protected-access


@pytest.fixture
def harness_threads(monkeypatch):
    """`threading.Thread` replaced as TF's coordinator tests replace it."""
    monkeypatch.setattr(threading, "Thread", checks.HarnessThread)


def test_harness_breaks_threading_timer(harness_threads):  # pylint: disable=unused-argument
    # What the coordinator used before: proves the fixture reproduces the harness.
    with pytest.raises(AssertionError, match="target="):
        threading.Timer(0.1, lambda: None)


@pytest.mark.timeout(60)
def test_delayed_calls_run_in_deadline_order_and_survive_an_error(harness_threads):  # pylint: disable=unused-argument
    ran, errors, done = [], [], threading.Event()

    def boom():
        raise RuntimeError("boom")

    calls = delayed_calls.DelayedCalls("test-delayed", on_error=errors.append)
    calls.call_later(0.3, lambda: (ran.append("late"), done.set()))
    calls.call_later(0.1, boom)
    calls.call_later(0.0, lambda: ran.append("now"))
    assert done.wait(10.0)
    assert ran == ["now", "late"]
    assert [str(e) for e in errors] == ["boom"]
    calls.stop(timeout=5.0)
    calls.call_later(0.0, lambda: ran.append("after stop"))
    time.sleep(0.1)
    assert ran == ["now", "late"] and calls.pending() == 0


def test_delayed_calls_stop_drops_what_did_not_run():
    ran = []
    calls = delayed_calls.DelayedCalls("test-delayed", on_error=pytest.fail)
    calls.call_later(30.0, lambda: ran.append(1))
    assert calls.pending() == 1
    start = time.monotonic()
    calls.stop(timeout=5.0)
    assert time.monotonic() - start < 5.0 and calls.pending() == 0 and ran == []


class _Trace:
    """Stands in for a traced step function (weak-referenceable, as ConcreteFunction is)."""


class _BlockingManager:
    """A step's cancellation manager whose cancel releases the parts waiting on it."""

    def __init__(self):
        self.cancelled = threading.Event()

    def start_cancel(self):
        self.cancelled.set()


def _run_loops(coord, steps, execute):
    """Runs each worker's dispatch loop on its own (harness) thread over `steps`."""
    coord._execute = execute
    threads = []
    for i in range(coord._num_workers):
        q = queue.Queue()
        for step in steps:
            q.put(step_values.StepPart(step, i))
        q.put(coordinator_lib._STOP)
        t = threading.Thread(target=coord._worker_loop, args=(_Worker(i), q), daemon=True)
        t.start()
        threads.append(t)
    return threads


@pytest.mark.timeout(60)  # Before the fix the peer waited forever (and join with it).
def test_a_users_error_on_one_worker_cancels_the_peer_under_the_harness(harness_threads,  # pylint: disable=unused-argument
                                                                        monkeypatch):
    monkeypatch.setattr(coordinator_lib, "_new_sync_executor", lambda: None)
    monkeypatch.setattr(coordinator_lib, "_release_executor", lambda ex: None)
    coord = _errors_coordinator()
    step = _step(coord, 1)
    step.cancellation_manager = _BlockingManager()
    coord._inflight = 1

    def execute(step, worker, ex):  # pylint: disable=unused-argument
        with coord._lock:
            step.sent_at[worker.worker_index] = time.monotonic()
        coord._maybe_cancel(step)  # As `_execute` does once its part is sent.
        if worker.worker_index == 0:
            raise tf.errors.InvalidArgumentError(None, None, "bad record on worker 0")
        # The peer waits in the step's all-reduce until the step is cancelled.
        assert step.cancellation_manager.cancelled.wait(20.0), "never cancelled"
        raise tf.errors.CancelledError(None, None, "cancelled")

    threads = _run_loops(coord, [step], execute)
    assert coord.wait_until_idle(timeout=20.0), "the step never ended"
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad record on worker 0"):
        coord._raise_if_error()
    for t in threads:
        t.join(5.0)
        assert not t.is_alive()
    coord._delayed.stop(timeout=5.0)


@pytest.mark.timeout(60)
def test_an_exception_in_a_dispatch_thread_fails_the_step_and_the_thread_goes_on(monkeypatch):
    monkeypatch.setattr(coordinator_lib, "_new_sync_executor", lambda: None)
    monkeypatch.setattr(coordinator_lib, "_release_executor", lambda ex: None)
    coord = _errors_coordinator()
    first, second = _step(coord, 1), _step(coord, 2, 2)
    coord._inflight = 1
    started = coord._watchdog.started
    broken = {"step": first}

    def started_or_raise(worker_index, step):
        if step is broken["step"] and worker_index == 1:
            raise RuntimeError("a bug in the dispatch thread")
        started(worker_index, step)

    monkeypatch.setattr(coord._watchdog, "started", started_or_raise)
    ran = []

    def execute(step, worker, ex):  # pylint: disable=unused-argument
        ran.append((step.step_id, worker.worker_index))

    threads = _run_loops(coord, [first], execute)
    assert coord.wait_until_idle(timeout=20.0), "the step never ended"
    with pytest.raises(StrategyError, match="internal error in worker 1's dispatch thread") as e:
        coord._raise_if_error()
    assert isinstance(e.value.__cause__, RuntimeError)
    assert first.error is not None and first.done.is_set()
    for t in threads:
        t.join(5.0)
    # The same loop body serves the next step as before.
    second.generation = coord.generation
    coord._inflight = 1
    _run_loops(coord, [second], execute)
    assert coord.wait_until_idle(timeout=20.0)
    coord._raise_if_error()  # No error.
    assert (2, 0) in ran and (2, 1) in ran


@pytest.mark.timeout(60)
def test_the_watchdog_reports_its_own_exception_and_goes_on(monkeypatch):
    from tests.unit.test_failover_unit import _bare_coordinator
    coord = _bare_coordinator(timeout=0.3)
    stopped = threading.Event()
    errors, calls = [], []
    real = coord._watchdog.fail_hung_step

    def flaky(limit):
        calls.append(limit)
        if len(calls) == 1:
            raise RuntimeError("probe failed")
        return real(limit)

    monkeypatch.setattr(coord._watchdog, "fail_hung_step", flaky)
    step = _step(coord, 5)
    coord._watchdog.running = {0: (step, time.monotonic())}
    thread = threading.Thread(target=coord._watchdog.run, args=(0.3, stopped, errors.append),
                              daemon=True)
    thread.start()
    with coord._lock:
        assert coord._idle.wait_for(lambda: coord._error is not None, timeout=10.0)
    assert [str(e) for e in errors] == ["probe failed"]
    assert isinstance(coord._error, tf.errors.DeadlineExceededError)
    stopped.set()
    thread.join(5.0)
    assert not thread.is_alive()


def test_a_step_whose_worker_still_makes_its_input_has_the_input_limit():
    from tests.unit.test_failover_unit import _bare_coordinator
    coord = _bare_coordinator()
    step = _step(coord, 1)
    now = time.monotonic()
    # Worker 1 has its input and waits in the step's collective for worker 0,
    # which is still running its dataset function: 100 s, limit 10 s.
    coord._watchdog.running = {0: (step, now - 100.0), 1: (step, now - 100.0)}
    coord._watchdog._creating_input = {0}
    assert coord._watchdog.fail_hung_step(10.0) is None
    assert step.error is None
    # Once the input exists, the step's limit counts from then, on both workers.
    coord._watchdog._creating_input = set()
    with coord._watchdog.creating_input(0):
        pass
    assert all(time.monotonic() - start < 5.0
               for _, start in coord._watchdog.running.values())
    assert coord._watchdog.fail_hung_step(10.0) is None
    # Past the input's own limit, the message names the input and its fix.
    limit = watchdog_lib.input_limit(10.0)
    assert limit >= watchdog_lib.MIN_INPUT_LIMIT_SECONDS
    coord._watchdog.running = {0: (step, now - limit - 1.0), 1: (step, now - limit - 1.0)}
    coord._watchdog._creating_input = {0}
    error = coord._watchdog.fail_hung_step(10.0)
    assert f"made no progress for {limit:g} s" in error.message
    assert "worker:0 is still creating its input" in error.message
    assert "dataset function return sooner" in error.message


def test_the_cancellation_waits_longer_for_a_workers_first_call_of_a_function():
    coord = _errors_coordinator()
    coord.step_timeout_seconds = 0.0
    trace = _Trace()
    step = _step(coord, 3)
    step.traces = [trace, trace]
    now = time.monotonic()
    step.sent_at = {0: now, 1: now}
    coord._cold_call_seconds = 3.0  # The longest first call measured so far.
    # Neither worker ran the function before: both may still instantiate it.
    assert coord._cancel_grace(step) == pytest.approx(
        now + coordinator_lib.COLD_CALL_GRACE_FACTOR * 3.0)
    coord._warm[0][trace] = True
    coord._warm[1][trace] = True
    assert coord._cancel_grace(step) == pytest.approx(now + coordinator_lib.CANCEL_GRACE_SECONDS)
    # With a watchdog, no longer than half its limit (a hung part fails anyway).
    coord._warm[1] = type(coord._warm[0])()
    coord.step_timeout_seconds = 4.0
    assert coord._cancel_grace(step) == pytest.approx(now + 2.0)


def test_a_workers_first_call_is_measured_once():
    coord = _errors_coordinator()
    trace = _Trace()
    step = _step(coord, 3)
    step.traces = [trace, trace]
    step.sent_at = {0: time.monotonic() - 2.5}
    coord._record_call(0, None, step)
    assert 2.5 <= coord._cold_call_seconds < 4.0 and trace in coord._warm[0]
    step.sent_at = {0: time.monotonic() - 9.0}
    coord._record_call(0, None, step)  # Warm now: not a first call.
    assert coord._cold_call_seconds < 4.0


@pytest.mark.timeout(60)
def test_delayed_calls_thread_ends_when_idle_and_comes_back(monkeypatch):
    # An idle thread would keep its owner (the coordinator, via on_error) alive.
    monkeypatch.setattr(delayed_calls, "IDLE_SECONDS", 0.1)
    ran = []
    calls = delayed_calls.DelayedCalls("test-delayed", on_error=pytest.fail)
    calls.call_later(0.0, lambda: ran.append(1))
    first = calls._thread
    first.join(5.0)
    assert not first.is_alive() and calls._thread is None and ran == [1]
    done = threading.Event()
    calls.call_later(0.0, done.set)
    assert done.wait(5.0) and calls._thread is not first
    calls.stop(timeout=5.0)
