"""What a synchronous step is while it runs: its parts, status and RemoteValue.

TF's `coordinator/` keeps its values (`values.py`, `remote_value.py`) apart
from the dispatch (`cluster_coordinator.py`); so does the plugin. A
`SyncStep` is one function dispatched to every worker (one `StepPart` per
worker, queued on that worker's dispatch thread), with the first error of
any part; its `SyncRemoteValue` holds worker 0's outputs and raises errors
through the coordinator, so fetching a failed step's result starts failover
or raises the step's first error (see `coordinator.py`).
"""

import threading
from typing import Dict, Optional

import tensorflow as tf

from tf_psplugin._internal.tf_internal import coordinator_values

# How often a blocked RemoteValue fetch looks for a coordinator error.
_FETCH_POLL_SECONDS = 0.5


class StepPart:
    """One worker's share of a synchronous step."""

    __slots__ = ("step", "worker_index")

    def __init__(self, step, worker_index):
        self.step = step
        self.worker_index = worker_index


class SyncRemoteValue(coordinator_values.RemoteValueImpl):
    """A step's RemoteValue whose errors go through the coordinator.

    Fetching the result of a failed step (Keras progress callbacks do) must
    start failover, or raise the step's *first* error rather than the
    cancellation of a later step.
    """

    def __init__(self, coordinator, type_spec, generation=0):
        super().__init__(None, type_spec)
        self._coordinator = coordinator
        self._generation = generation

    def _wait_and_maybe_error(self):
        # Worker 0's dispatch thread sets this value. After an earlier step
        # failed, that thread can be stuck in a collective of a step its peers
        # cancelled, so a fetch also wakes on the coordinator's first error
        # (which the watchdog reports for a stuck part) instead of waiting on
        # the value alone forever.
        while not self._status_available_event.wait(_FETCH_POLL_SECONDS):
            if self._coordinator.has_pending_error():
                self._coordinator.check_health()
            elif self._coordinator.generation > self._generation:
                # Scheduled before an error that was already raised: cancelled
                # (its worker thread may never reach it).
                raise tf.errors.CancelledError(
                    None, None, "tf_psplugin: step cancelled after an earlier step failed; "
                    "schedule it again.")
        if self._error is not None:
            self._coordinator.check_health()
        super()._wait_and_maybe_error()


class SyncStep:
    """A function dispatched to every worker, with its result and status."""

    def __init__(self, coordinator, step_id, functions, args, kwargs, output_spec, num_workers,
                 generation=0, cancellation_manager=None):
        self.step_id = step_id
        # Cancels this step's functions on every worker (and no other step's).
        self.cancellation_manager = cancellation_manager
        # Steps of an older generation than the coordinator's were scheduled
        # before an error was raised to the user: they are cancelled.
        self.generation = generation
        self.functions = functions  # One per worker.
        self.args = args
        self.kwargs = kwargs
        self.remote_value = SyncRemoteValue(coordinator, output_spec, generation)
        self.remaining = num_workers
        self.error: Optional[BaseException] = None
        self.timed_out = False  # Set once by the watchdog.
        # Decided by the first worker thread that picks the step up, and then
        # the same for every worker: a part that runs while a peer's part was
        # cancelled waits in the step's collectives forever.
        self.cancelled: Optional[bool] = None
        # Worker index -> when its part sent its remote call (time.monotonic).
        self.sent_at: Dict[int, float] = {}
        # Worker index -> the trace its part runs (set by the coordinator).
        self.traces: Optional[list] = None
        # Workers whose part ended (recorded once, whatever ended it).
        self.finished_parts: set = set()
        # A part failed with the user's error: cancel the others (once every
        # part was sent or ended), and whether that cancellation is on its way.
        self.cancel_requested = False
        self.cancel_scheduled = False
        self.done = threading.Event()
