"""The coordinator: synchronous per-worker dispatch on top of ClusterCoordinator.

Stock `ClusterCoordinator.schedule` sends each function to *one* free worker
(asynchronous training). Synchronous hybrid training needs every step to run
on *every* worker at once, because the step contains collectives among the
workers. `HybridClusterCoordinator.schedule` therefore:

1. traces the function once per update role (the strategy keys
   tf.function's cache by device): a synchronous step differs between
   workers only in which table-shard updates it applies,
2. pushes any replicated variable whose chief copy is newer than the
   replicas (e.g. after `set_weights` or a checkpoint restore),
3. queues one part of the step on each worker's own thread, each part
   resolving its per-worker arguments (its own iterator),
4. returns one RemoteValue: worker 0's outputs. Metrics are reduced across
   workers inside the step, so worker 0's logs describe the global batch.

Keras's `model.fit`, `evaluate` and custom loops all call `schedule`; the
strategy installs this coordinator when it is constructed, and
`ClusterCoordinator(strategy)` returns it (TF's `__new__` returns the
strategy's existing coordinator), so no user code changes.

Errors (the stock coordinator's contract): the first failure of any part is
kept and raised once by the next `schedule`, `join` or `done`; every step
scheduled before that raise and not yet finished is cancelled (its
RemoteValue raises `CancelledError`), so the next `schedule`/`join` starts
clean. A step is cancelled on every worker or on none (the first worker
thread to reach it decides), because a part that runs while a peer's part
was cancelled would wait in the step's collectives forever. A `fetch` of a
RemoteValue that is not ready also raises (or recovers from) the first error
once one is pending: its worker thread may be stuck behind the failed step.
An error in a per-worker input (a dataset function that fails on the
workers) is raised as TF's `ClosureInputError` with the original as
`original_exception`, and is a task failure only if the original is one.
When one worker's part fails with the user's error (a bad record in its
input, a failed assertion) while its peers still run the step, the peers
wait in the step's collectives for a part that will never come: the
coordinator cancels the step functions' remote calls
(`_cancel_waiting_peers`; within `CANCEL_GRACE_SECONDS` of the last part's
call, because TF loses a cancellation that reaches a worker before the call
has started there), so the user's error is reported at once and the cluster
is usable for the next step, as after a stock PSS step error.
Worker recovery is handled in `failover.py`.

Hung peers: a worker that stops answering raises no error; its peers just
wait in the step's collectives. The step watchdog (`watchdog.py`) fails a
step part that makes no progress for `collective_timeout_seconds`, which
goes through failover like any task failure. Per-worker datasets (each
worker its shard of the input) are built by `worker_datasets.py`.
"""

import queue
import threading
import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf
from absl import logging

from tf_psplugin import errors
from tf_psplugin._internal import identity
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin._internal.tf_internal import cancellation, cluster_coordinator, context
from tf_psplugin._internal.tf_internal import coordinator_context
from tf_psplugin._internal.tf_internal import executor
from tf_psplugin.cluster import liveness
from tf_psplugin.runtime import delayed_calls
from tf_psplugin.runtime import epochs as epochs_lib
from tf_psplugin.runtime import role_tracing
from tf_psplugin.runtime import step_values
from tf_psplugin.runtime import watchdog as watchdog_lib
from tf_psplugin.runtime import worker_datasets
from tf_psplugin.sync import replicated

_STOP = object()
# How long after a step part's remote call was sent a cancellation of that
# step is sure to reach the worker's running call, once the worker has run
# that function before (see `_cancel_waiting_peers`).
CANCEL_GRACE_SECONDS = 1.0
# A worker's first call of a function first instantiates it there (graph
# optimisation, seconds for a large model on a loaded host): a cancellation
# waits this many times the longest such first call measured so far.
COLD_CALL_GRACE_FACTOR = 2.0


class HybridClusterCoordinator(cluster_coordinator.ClusterCoordinator):
    """ClusterCoordinator whose `schedule` runs a function on every worker.

    In asynchronous dense mode (`dense_placement="ps"`) it behaves exactly
    like the stock coordinator.

    Example:

    ```python
    strategy = tf_psplugin.HybridParameterServerStrategy()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # -> the strategy's HybridClusterCoordinator
    result = coordinator.schedule(train_step, args=(per_worker_iterator,))
    coordinator.join()
    ```
    """

    def __init__(self, strategy):
        if getattr(self, "_has_initialized", False):
            return
        super().__init__(strategy)
        self._synchronous = bool(getattr(strategy.extended, "synchronous_dispatch", False))
        self._num_workers = len(self._cluster.workers)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._error: Optional[BaseException] = None
        self._step_counter = 0
        self._generation = 0  # Bumped each time an error is raised to the user.
        self._queues: List["queue.Queue"] = []
        self._threads: List[threading.Thread] = []
        self._logged_placement = False
        # Which worker's replica eager reads pull from (a survivor after a failure).
        self.preferred_replica = 0
        # Set by the strategy: a failover.FailoverController, or None.
        self.failover = None
        self.recovering = False
        resolver = tf_objects.strategy_cluster_resolver(strategy)
        spec = resolver.cluster_spec().as_dict()
        # Which parts run since when; fails those that hang (the watchdog thread).
        self._watchdog = watchdog_lib.StepWatchdog(
            self._lock, self._on_hung_step, spec.get("ps", []), spec.get("worker", []))
        self._datasets = worker_datasets.WorkerDatasets(
            self, self._synchronous, self._num_workers)
        # One traced closure per worker: one trace per update role.
        self._tracing = role_tracing.RoleTracing(strategy, self._cluster.workers)
        self.step_timeout_seconds = float(
            getattr(strategy.extended, "step_timeout_seconds", 0.0) or 0.0)
        self._stopped = threading.Event()
        # Sends each failed step's peer cancellation when its time comes
        # (one thread, made on first use; never a threading.Timer).
        self._delayed = delayed_calls.DelayedCalls(
            "tf_psplugin-cancel-peers",
            on_error=lambda e: self._on_internal_error(e, "the peer-cancellation thread"))
        # Per worker: the step functions whose call returned there (their
        # next call starts at once), and the longest first call seen (s).
        self._warm = [identity.IdentityMap() for _ in range(self._num_workers)]
        self._cold_call_seconds = 0.0
        if self._synchronous:
            for worker in self._cluster.workers:
                q = queue.Queue()
                t = threading.Thread(target=self._worker_loop, args=(worker, q),
                                     name=f"tf_psplugin-sync-worker-{worker.worker_index}",
                                     daemon=True)
                self._queues.append(q)
                self._threads.append(t)
                t.start()
            if self.step_timeout_seconds > 0:
                on_error = lambda e: self._on_internal_error(e, "the step watchdog")  # noqa: E731
                t = threading.Thread(target=self._watchdog.run,
                                     args=(self.step_timeout_seconds, self._stopped, on_error),
                                     name="tf_psplugin-step-watchdog",
                                     daemon=True)
                self._threads.append(t)
                t.start()

    # -- public API -----------------------------------------------------------

    @property
    def synchronous(self) -> bool:
        """Whether `schedule` dispatches to every worker."""
        return self._synchronous

    @property
    def num_workers(self) -> int:
        """Number of workers in the training cluster."""
        return self._num_workers

    def schedule(self, fn, args=None, kwargs=None):
        """Schedules `fn` on every worker (synchronous mode) or one worker.

        Args:
            fn: A `tf.function` or concrete function.
            args: Positional args; `PerWorkerValues` resolve per worker.
            kwargs: Keyword args, likewise.

        Returns:
            A RemoteValue with worker 0's outputs (synchronous mode), or the
            stock coordinator's RemoteValue.

        Raises:
            Exception: the first error of a previously scheduled step.
        """
        if not isinstance(fn, (tf.types.experimental.GenericFunction,
                               tf.types.experimental.ConcreteFunction)):
            # Stock's message first, word for word (users' `except` clauses
            # and TF's own tests match it), then what to do.
            raise TypeError(
                "`tf.distribute.experimental.coordinator.ClusterCoordinator.schedule` only "
                f"accepts a `tf.function` or a concrete function. Got {type(fn).__name__}; "
                "fix: decorate it with @tf.function.")
        self._maybe_log_placement()
        if not self._synchronous:
            return self._tracing.schedule_async(
                lambda: super(HybridClusterCoordinator, self).schedule(fn, args=args,
                                                                       kwargs=kwargs),
                fn, args, kwargs)
        self._raise_if_error()
        # Each step its own cancellation manager (not the stock closure
        # queue's): `_cancel_waiting_peers` cancels this step and no other.
        manager = cancellation.CancellationManager()
        closures = self._tracing.closures(fn, args, kwargs, manager)
        used = {}
        for closure in {id(c): c for c in closures}.values():  # Roles share closures.
            concrete = tf_objects.closure_concrete_function(closure)
            if concrete is not None:
                for var in replicated.replicated_variables_used_by(concrete):
                    used[id(var)] = var
        try:
            for var in used.values():
                var.push_if_needed()
                var.mark_dispatched()
        except tf.errors.OpError as e:
            self.on_remote_error(e)
        first = closures[0]
        with self._lock:
            self._step_counter += 1
            step = step_values.SyncStep(self, self._step_counter,
                             [tf_objects.closure_function(c) for c in closures],
                             *tf_objects.closure_arguments(first),
                             tf_objects.closure_output_type_spec(first), self._num_workers,
                             self._generation, manager)
            self._inflight += 1
        # What a worker's "has it run this function before" is keyed by: the
        # traced function, the same object for every step of one trace
        # (a closure's callable is a new wrapper per step).
        step.traces = [tf_objects.closure_concrete_function(c) or tf_objects.closure_function(c)
                       for c in closures]
        for i, q in enumerate(self._queues):
            q.put(step_values.StepPart(step, i))
        return step.remote_value

    def wait_for_sync_steps(self, timeout: Optional[float] = None) -> bool:
        """Blocks until no synchronous step is in flight (errors not raised).

        During failover recovery, steps stuck in collectives with a dead peer
        are abandoned, so this returns at once.
        """
        if self.recovering:
            return False
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0 or self._error is not None,
                                       timeout=timeout)

    def wait_until_idle(self, timeout: Optional[float]) -> bool:
        """Blocks until no step is in flight, even after an error (recovery)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def running_parts(self) -> Dict[int, Tuple[int, float]]:
        """Worker index -> (step id, seconds running) of the parts running now."""
        return self._watchdog.running_parts()

    @property
    def generation(self) -> int:
        """How many errors were raised so far (steps of older ones are cancelled)."""
        with self._lock:
            return self._generation

    def has_pending_error(self) -> bool:
        """Whether a step failed and its error has not been raised yet."""
        with self._lock:
            return self._error is not None

    def check_health(self) -> None:
        """Raises (or recovers from) the first error of a finished step, if any."""
        if self._synchronous and not self.recovering:
            self._raise_if_error()

    def join(self):
        """Blocks until every scheduled function finished; raises the first error."""
        if self._synchronous:
            self.wait_for_sync_steps()
            self._raise_if_error()
        with verbosity_lib.quiet_tf_info():  # "Waiting for all global closures ...".
            super().join()

    def done(self):
        """Whether every scheduled function finished; raises the first error."""
        if self._synchronous:
            with self._lock:
                busy = self._inflight > 0
            self._raise_if_error()
            if busy:
                return False
        return super().done()

    @property
    def examples_per_step(self) -> Optional[int]:
        """Examples one scheduled step consumes, from the last per-worker dataset.

        The dataset's static batch dimension times the workers a step runs
        on (all of them in synchronous mode, one otherwise); None when the
        batch dimension is not static (e.g. `batch` without
        `drop_remainder=True`).
        """
        return self._datasets.examples_per_step

    def create_per_worker_dataset(self, dataset_fn):
        """Creates a dataset on every worker; in sync mode each gets a shard.

        A `tf.data.Dataset` (or one distributed with
        `strategy.experimental_distribute_dataset`) is sharded with tf.data's
        auto-shard policy: by file when it reads files (worker `i` of `n`
        opens files `i, i+n, ...`), otherwise by batch (worker `i` reads
        batches `i, i+n, ...`, so one synchronous step consumes `n`
        consecutive batches and the global batch is `n` times the dataset's
        batch); `tf.data.Options().experimental_distribute.auto_shard_policy`
        chooses otherwise (OFF: every worker reads all of it). A dataset
        function runs on each worker and is expected to shard itself
        (`experimental_get_current_worker_index`).
        Finite data ends on every worker at the same step: training input
        is cut to the shortest worker's length, evaluation input padded to
        the longest with empty batches (see `epochs.py`).

        Args:
            dataset_fn: A dataset, distributed dataset, or a function.

        Returns:
            A per-worker dataset, as from the stock coordinator. Also
            records `examples_per_step`.
        """
        return self._datasets.create(dataset_fn, super().create_per_worker_dataset)

    # -- internals ------------------------------------------------------------

    def _maybe_log_placement(self):
        if self._logged_placement:
            return
        self._logged_placement = True
        report = getattr(self.strategy, "placement_summary", None)
        if report is not None and getattr(self.strategy.extended, "log_placement", False):
            logging.info("%s", report())

    def on_remote_error(self, error):
        """A push to or read from the workers failed: recover like a failed step, or raise."""
        with self._lock:
            self._error = self._error or error
        self._raise_if_error()
        raise error

    def _raise_if_error(self):
        with self._lock:
            err, self._error = self._error, None
            if err is not None:
                # Everything scheduled so far belongs to the failed batch.
                self._generation += 1
        if err is None:
            return

        if self.failover is not None and liveness.is_task_failure(err):
            # Recovery lets healthy parts finish; parts stuck in a collective
            # with the dead peer are abandoned by the restart.
            self.recovering = True
            try:
                self.failover.recover(self, err)  # Raises TaskFailedError or FailoverError.
            finally:
                # This strategy cannot train again (a restart, or elastic.run,
                # builds a new one): free its threads so nothing of it stays.
                self.shutdown()
        raise err

    def _worker_loop(self, worker, q):
        """A worker's dispatch thread: runs that worker's part of each step, in order.

        It never ends but on `_STOP`: an exception outside the step's own
        call (a bug of the plugin's, or of an instrumented `threading`)
        fails that part, and so its step, with a `StrategyError` that
        `schedule`/`join` raise; a thread that died here would leave
        `join()` waiting forever.
        """
        worker_executor = _new_sync_executor()
        try:
            while True:
                part = q.get()
                if part is _STOP:
                    return
                try:
                    self._run_part(part.step, worker, worker_executor)
                except BaseException as e:  # noqa: BLE001 - raised to the user via join/schedule.
                    self._on_internal_error(
                        e, f"worker {worker.worker_index}'s dispatch thread", part.step,
                        worker.worker_index)
                # Keep nothing of the step (its inputs hold the user's iterators).
                del part
        finally:
            _release_executor(worker_executor)

    def _run_part(self, step, worker, worker_executor) -> None:
        """Runs (or skips, if cancelled) one worker's part of `step` and records its end."""
        outputs = None
        error = None
        with self._lock:
            if step.cancelled is None:
                step.cancelled = (self._error is not None
                                  or step.generation < self._generation)
            cancelled = step.cancelled
        if cancelled:
            error = tf.errors.CancelledError(
                None, None, "tf_psplugin: step cancelled after an earlier step failed; "
                "schedule it again.")
        else:
            with self._lock:
                self._watchdog.started(worker.worker_index, step)
            try:
                outputs = self._execute(step, worker, worker_executor)
            except Exception as e:  # noqa: BLE001 - reported to the user via join/schedule.
                error = e
                # End of data is how a custom loop's epoch ends, not a
                # failure; a cancellation follows a peer's error (logged).
                log = (logging.info if isinstance(
                    e, (tf.errors.OutOfRangeError, tf.errors.CancelledError))
                    else logging.error)
                log("tf_psplugin: worker %d failed step %d: %r",
                    worker.worker_index, step.step_id, e)
        self._finish_part(step, worker.worker_index, outputs, error, cancelled)

    def _on_internal_error(self, error: BaseException, where: str, step=None,
                           worker_index: Optional[int] = None) -> None:
        """An exception in one of the coordinator's own threads: fail, never hang.

        The steps in flight fail with a `StrategyError` naming the thread
        (raised once by the next `schedule`, `join` or `done`, the original
        exception as its cause); with `step`, that worker's part of it ends
        with the error unless it was recorded already.
        """
        logging.error("tf_psplugin: internal error in %s", where,
                      exc_info=(type(error), error, error.__traceback__))
        wrapped = errors.StrategyError(
            f"tf_psplugin: internal error in {where}: {error!r}; the steps in flight failed. "
            "Fix: this is a bug in tf_psplugin, please report it with the log's traceback; "
            "schedule the steps again to go on.")
        wrapped.__cause__ = error
        if step is not None and worker_index is not None:
            with self._lock:
                recorded = worker_index in step.finished_parts
            if not recorded:
                self._finish_part(step, worker_index, None, wrapped)
                return
        with self._lock:
            self._error = self._error or wrapped
            self._idle.notify_all()

    def _execute(self, step, worker, worker_executor):
        args = tf_objects.select_worker_slice(worker.worker_index, step.args)
        kwargs = tf_objects.select_worker_slice(worker.worker_index, step.kwargs)
        # As the stock Closure.execute_on: a per-worker input (iterator) whose
        # creation failed is a ClosureInputError wrapping the original error
        # (the user's dataset error, or a dead worker's UnavailableError).
        with self._watchdog.creating_input(worker.worker_index):
            # Waits for the worker's input iterators to exist.
            error = (tf_objects.error_from_remote_values(args)
                     or tf_objects.error_from_remote_values(kwargs))
        if error is not None:
            # A dataset function that failed when its length was read: its
            # first error (a second call gets another one, see `epochs`).
            error = epochs_lib.first_input_error((step.args, step.kwargs)) or error
            if not isinstance(error, cluster_coordinator.ClosureInputError):
                error = cluster_coordinator.ClosureInputError(error)
            raise error
        args = tf.nest.map_structure(coordinator_context.maybe_get_remote_value, args)
        kwargs = tf.nest.map_structure(coordinator_context.maybe_get_remote_value, kwargs)
        with self._lock:
            # Sent even when a peer's part failed already: it reads its input
            # as the peers' parts did (a part skipped here would leave this
            # worker's iterators a step behind theirs, depending on timing),
            # then waits in the step's collectives for the cancellation,
            # which is sent only once every part was sent (`_maybe_cancel`).
            step.sent_at[worker.worker_index] = time.monotonic()
        self._maybe_cancel(step)
        function = step.functions[worker.worker_index]
        try:
            with tf.device(worker.device_name), context.executor_scope(worker_executor):
                with coordinator_context.with_dispatch_context(worker):
                    outputs = function(*args, **kwargs)
        finally:
            self._record_call(worker.worker_index, function, step)
        if worker.worker_index == 0:
            tf_objects.remote_value_set_values(step.remote_value, outputs)
            step.remote_value.get()  # Copy to the chief while the worker is alive.
        return outputs

    def _on_hung_step(self, step, error) -> None:
        """The watchdog failed `step` with `error` (called under the lock)."""
        if step.error is None:
            step.error = error
        self._error = self._error or error
        self._idle.notify_all()

    def _record_call(self, worker_index: int, function, step) -> None:
        """Worker `worker_index`'s call of `step`'s function returned (or raised).

        Its first call of a trace there also instantiated the function on
        the worker; that call's length is what a cancellation of a later
        first call waits for (`_cancel_grace`).
        """
        trace = step.traces[worker_index] if step.traces else function
        with self._lock:
            warm = self._warm[worker_index]
            if trace not in warm:
                warm[trace] = True
                self._cold_call_seconds = max(
                    self._cold_call_seconds, time.monotonic() - step.sent_at[worker_index])

    def _finish_part(self, step, worker_index, outputs, error, cancelled=False):
        with self._lock:
            if worker_index in step.finished_parts:
                return
            step.finished_parts.add(worker_index)
            self._watchdog.finished(worker_index, step)
            if error is not None and step.error is None:
                step.error = error
                # Our own cancellations and errors of a batch whose error was
                # already raised add nothing new; a real error replaces a
                # derived CancelledError (a peer's failure seen from afar).
                if step.generation == self._generation and not cancelled and (
                        self._error is None
                        or (isinstance(self._error, tf.errors.CancelledError)
                            and not isinstance(error, tf.errors.CancelledError))):
                    self._error = error
                self._idle.notify_all()
            step.remaining -= 1
            finished = step.remaining == 0
            if finished and step.error is None:
                self._watchdog.finished_steps += 1
            # The user's error (a step or input pipeline that failed on this
            # worker) while peers still run the step: they wait in its
            # collectives for a part that will never come.
            cancel_peers = (error is not None and not finished and not cancelled
                            and not isinstance(error, tf.errors.CancelledError))
        # Whatever raises below, the step ends and leaves the in-flight count
        # (or `join` and failover's wait for idle would wait forever).
        try:
            if cancel_peers:
                self._cancel_waiting_peers(step, error)
            elif not finished:
                self._maybe_cancel(step)  # This part's end may be the one it waited for.
            if error is not None and worker_index == 0:
                tf_objects.remote_value_set_error(step.remote_value, error)
            if finished and step.error is not None and tf_objects.remote_value_status(
                    step.remote_value) is not None:
                tf_objects.remote_value_set_error(step.remote_value, step.error)
        finally:
            if finished:
                step.done.set()
                with self._lock:
                    self._inflight -= 1
                    if self._inflight == 0:
                        self._idle.notify_all()

    def _cancel_grace(self, step) -> Optional[float]:
        """When `step`'s cancellation is sure to reach every part that was sent.

        Returns:
            A `time.monotonic()` time, or None if no part was sent.
        """
        with self._lock:
            deadlines = []
            for i, sent in step.sent_at.items():
                grace = CANCEL_GRACE_SECONDS
                if step.traces and step.traces[i] not in self._warm[i]:
                    # That worker may still be instantiating the function.
                    grace = max(grace, COLD_CALL_GRACE_FACTOR * self._cold_call_seconds)
                    if self.step_timeout_seconds > 0:
                        # Past the watchdog's limit a hung part fails anyway.
                        grace = min(grace, max(CANCEL_GRACE_SECONDS,
                                               self.step_timeout_seconds / 2))
                deadlines.append(sent + grace)
        return max(deadlines, default=None)

    def _cancel_waiting_peers(self, step, error) -> None:
        """Cancels `step` on every worker after one of its parts failed with `error`.

        Without it, the peers of a worker whose part failed before a
        collective (a bad record in its input, a failed assertion, the end of
        its data) would wait in that collective until the step watchdog
        declared them hung, and failover restarted the cluster for the
        user's own error. Each step has its own cancellation manager, so this
        ends the remote calls of this step only (`CancelledError`; the error
        reported is still the first one): an earlier step still running on a
        slower worker completes, and a peer that has not started this step
        yet still runs it up to its first collective, so every worker's input
        advances by the same step whatever the timing. Task failures are left
        to failover, which abandons the parts stuck with a dead peer.
        """

        if step.cancellation_manager is None or liveness.is_task_failure(error):
            return
        with self._lock:
            step.cancel_requested = True
        self._maybe_cancel(step)

    def _maybe_cancel(self, step) -> None:
        """Sends `step`'s requested cancellation once every part was sent or ended."""
        # TF loses a cancellation that reaches a worker before the worker
        # has started executing the call (its eager service registers the
        # call's cancel callback only then; TF 2.15-2.21): that part would
        # wait in a collective forever, and so would every later collective
        # of the group, on every worker (measured on TF 2.21: one such call
        # in ~20 bad-record errors on a loaded 2-core host; the job then
        # failed over after collective_timeout_seconds). So the cancellation
        # waits until every part was sent or ended (a part sent after it
        # would not run at all), and then until each part that was sent has
        # had time to start: `CANCEL_GRACE_SECONDS` where the worker ran the
        # function before, and `COLD_CALL_GRACE_FACTOR` times the longest
        # first call seen where this is its first call (it instantiates the
        # function first).
        with self._lock:
            if not step.cancel_requested or step.cancel_scheduled:
                return
            if len(set(step.sent_at) | step.finished_parts) < len(step.functions):
                return  # Sent by `_execute` or `_finish_part` when the last part is.
            step.cancel_scheduled = True
        deadline = self._cancel_grace(step)
        delay = 0.0 if deadline is None else deadline - time.monotonic()
        self._delayed.call_later(delay, step.cancellation_manager.start_cancel)

    def shutdown(self) -> None:
        """Stops this coordinator's threads for good (idempotent).

        Its dispatch threads and watchdog end once their current part does
        (a part stuck with a dead peer ends when that peer's RPCs fail), and
        the stock worker threads stop (TF's `Cluster.stop`). Used after a
        task failure, when the strategy can no longer train: without it,
        every strategy a process builds (`tf_psplugin.elastic.run` builds one
        per attempt) would keep its threads, and through them itself, alive.
        """
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        for q in self._queues:
            q.put(_STOP)
        self._delayed.stop(timeout=0)
        with verbosity_lib.quiet_tf_info():  # "Stopping cluster, ..." at INFO.
            self._cluster.stop()

    def __del__(self):
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        for q in getattr(self, "_queues", []):
            q.put(_STOP)
        try:
            super().__del__()
        except AttributeError:
            pass


def _release_executor(ex) -> None:
    """Clears an executor's pending error before it is dropped.

    After a failed step it holds the dead peer's error, which its
    `__del__` would raise (Python prints that as an ignored exception with
    a traceback, long after the failure was reported).
    """
    try:
        ex.wait()
    except tf.errors.OpError:
        pass
    ex.clear_error()


def _new_sync_executor():
    # A synchronous executor per dispatch thread, as the stock Worker uses one.
    return executor.new_executor(enable_async=False)

