"""The step watchdog: a synchronous step that makes no progress fails, naming why.

A worker that stops answering (SIGSTOP, a partitioned network, a wedged
host) raises no error; its peers just wait in the step's collectives. One
watchdog thread on the chief (TF's `coordinator/watchdog.py` pattern) fails
any step part that has run longer than the strategy's
`collective_timeout_seconds` with `DeadlineExceededError` naming the step,
the workers still in it and what they most likely wait for; that error goes
through failover like any task failure. This replaces per-op collective
timeouts, which cost one sleeping OS thread per collective op on the workers
(see `collectives.py`).

Creating a worker's input is not a hang: a dataset function that builds a
large shuffle buffer or slices big in-memory arrays can take minutes on its
first step, and a restart would only run into the same limit again. While
a part waits for its per-worker input it has its own, longer limit
(`input_limit`: `INPUT_LIMIT_FACTOR` times the step's, at least
`MIN_INPUT_LIMIT_SECONDS`), with a message naming the input; the step's
limit counts from when the input exists.
"""

import contextlib
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import tf_objects
from tf_psplugin.cluster import liveness

# A part still creating its input fails after max(factor x the step limit, minimum).
INPUT_LIMIT_FACTOR = 10.0
MIN_INPUT_LIMIT_SECONDS = 600.0


def input_limit(limit: float) -> float:
    """How long a part may wait for its per-worker input, for a step limit `limit`."""
    return max(INPUT_LIMIT_FACTOR * limit, MIN_INPUT_LIMIT_SECONDS)


class StepWatchdog:
    """Which step parts run since when, and failing those that hang.

    One per `HybridClusterCoordinator` (its `_watchdog`), sharing the
    coordinator's lock: the dispatch threads report each part's start and
    end (`started`, `finished`, under that lock) and the time a part waits
    for its per-worker input (`creating_input`); `run` is the watchdog
    thread's body, and `fail_hung_step` one look at the running parts.

    Example (what the coordinator does):

    ```python
    watchdog = StepWatchdog(lock, on_hung, ps_addresses, worker_addresses)
    threading.Thread(target=watchdog.run, args=(60.0, stopped), daemon=True).start()
    ```

    Args:
        lock: The coordinator's lock; `started`, `finished` and `on_hung`
            run under it.
        on_hung: Called under the lock with ``(step, error)`` when a step is
            failed: records `error` as the step's and the coordinator's
            first error and wakes its waiters.
        ps_addresses: The PS tasks' ``host:port``, probed for the diagnosis.
        worker_addresses: The workers' ``host:port``, likewise.
    """

    def __init__(self, lock: threading.Lock, on_hung: Callable, ps_addresses: List[str],
                 worker_addresses: List[str]):
        self._lock = lock
        self._on_hung = on_hung
        self._ps_addresses = list(ps_addresses)
        self._worker_addresses = list(worker_addresses)
        # worker index -> (step, monotonic start) of the part it is running.
        self.running: Dict[int, Tuple[object, float]] = {}
        # Workers whose running part still waits for its per-worker input
        # (an iterator whose dataset function has not returned yet).
        self._creating_input: set = set()
        self.finished_steps = 0  # Steps every worker finished (for the message).

    def started(self, worker_index: int, step) -> None:
        """Worker `worker_index` started its part of `step` (call under the lock)."""
        self.running[worker_index] = (step, time.monotonic())

    def finished(self, worker_index: int, step) -> None:
        """Worker `worker_index`'s part of `step` ended (call under the lock)."""
        if self.running.get(worker_index, (None,))[0] is step:
            del self.running[worker_index]

    @contextlib.contextmanager
    def creating_input(self, worker_index: int):
        """Marks worker `worker_index` as waiting for its per-worker input inside.

        The step's limit starts again, for every part of the step, when the
        input exists (peers that had theirs waited for this one).
        """
        with self._lock:
            self._creating_input.add(worker_index)
        try:
            yield
        finally:
            with self._lock:
                self._creating_input.discard(worker_index)
                step = self.running.get(worker_index, (None,))[0]
                now = time.monotonic()
                for i, (s, _) in list(self.running.items()):
                    if s is step:
                        self.running[i] = (s, now)

    def running_parts(self) -> Dict[int, Tuple[int, float]]:
        """Worker index -> (step id, seconds running) of the parts running now."""
        now = time.monotonic()
        with self._lock:
            return {i: (step.step_id, now - start) for i, (step, start) in self.running.items()}

    def run(self, limit: float, stopped: threading.Event,
            on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        """Fails steps whose parts make no progress for `limit` s, until `stopped` is set.

        The body of the watchdog thread. Polls often enough to notice a hang
        within ~10% of the timeout and at most every 5 s; costs one sleeping
        thread on the chief in all. An exception in a look goes to
        `on_error` and the watchdog goes on (a watchdog that died would let
        a hung step wait forever); without `on_error` it ends the thread.
        """
        poll = min(max(limit / 10.0, 0.05), 5.0)
        while not stopped.wait(poll):
            try:
                self.fail_hung_step(limit)
            except BaseException as e:  # noqa: BLE001 - reported; the watchdog goes on.
                if on_error is None:
                    raise
                on_error(e)

    def fail_hung_step(self, limit: float) -> Optional[BaseException]:
        """Fails the oldest step with a part running longer than `limit` s.

        Returns:
            The `DeadlineExceededError` it failed the step with, or None (no
            part hung, or its step was failed already).
        """
        now = time.monotonic()
        slow_input = input_limit(limit)
        with self._lock:
            # A step with a part still creating its input has the input's limit.
            making_input = {id(self.running[i][0]) for i in self._creating_input
                            if i in self.running}
            hung = [(start, i, step) for i, (step, start) in self.running.items()
                    if now - start > (slow_input if id(step) in making_input else limit)
                    and not step.timed_out]
            if not hung:
                return None
            _, _, step = min(hung, key=lambda h: (h[0], h[1]))
            workers = sorted(i for i, (s, _) in self.running.items() if s is step)
            creating = sorted(i for i in workers if i in self._creating_input)
            first_step = self.finished_steps == 0
        if creating:
            limit = slow_input
        # Outside the lock: connection probes take up to a second each.
        why = self.why_no_progress(workers, creating, first_step)
        with self._lock:
            if step.timed_out:
                return None
            step.timed_out = True
            names = ", ".join(f"worker:{i} (/job:worker/replica:0/task:{i})" for i in workers)
            error = tf.errors.DeadlineExceededError(
                None, None,
                f"tf_psplugin: step {step.step_id} made no progress for {limit:g} s on {names}: "
                f"{why} Fix: {_fix(creating)}")
            self._on_hung(step, error)
            set_remote_error = 0 in workers
        logging.error("%s", error.message)
        if set_remote_error:
            tf_objects.remote_value_set_error(step.remote_value, error)
        return error

    def why_no_progress(self, workers: List[int], creating: List[int], first_step: bool) -> str:
        """What a stuck step's workers are most likely waiting for, in one sentence or two.

        Tasks that no longer accept connections are down; a worker whose
        input iterator does not exist yet is still running its dataset
        function; otherwise, on a job's first step, the likeliest wait is the
        input's first batch (a slow source, or a filter that keeps nothing).
        """

        down = [f"ps:{i} at {a}" for i, a in enumerate(self._ps_addresses)
                if not liveness.accepts_connections(a)]
        down += [f"worker:{i} at {self._worker_addresses[i]}" for i in workers
                 if i < len(self._worker_addresses)
                 and not liveness.accepts_connections(self._worker_addresses[i])]
        if down:
            verb = "does" if len(down) == 1 else "do"
            return f"{', '.join(down)} {verb} not accept connections (down or unreachable)."
        if creating:
            return (f"{', '.join(f'worker:{i}' for i in creating)} is still creating its input "
                    "(its dataset function has not returned: a slow file system, a large "
                    "in-memory dataset, a blocking generator).")
        if first_step:
            return ("no step has finished yet and every PS and worker of the step accepts "
                    "connections: most likely a worker's input has not produced its first batch "
                    "(a slow or stalled source, a filter that keeps no element), or a worker is "
                    "hung (stopped, not answering).")
        return ("every PS and worker of the step accepts connections: a worker's input is "
                "stalled, a worker is hung (stopped, not answering), or the step is slower than "
                "collective_timeout_seconds.")


def _fix(creating: List[int]) -> str:
    """What to do about a step that made no progress (`creating`: workers still making input)."""
    if creating:
        return ("make the dataset function return sooner (read files instead of slicing large "
                "in-memory arrays; a smaller shuffle buffer), or raise "
                "HybridOptions(collective_timeout_seconds=...): input creation "
                f"may take {INPUT_LIMIT_FACTOR:g} times that, at least "
                f"{MIN_INPUT_LIMIT_SECONDS:g} s.")
    return ("check those workers and their input (and the network between them); if steps are "
            "legitimately that slow, raise "
            "HybridOptions(collective_timeout_seconds=...).")
