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
(`_cancel_waiting_peers`), so the user's error is reported at once and the
cluster is usable for the next step, as after a stock PSS step error.
Worker recovery is handled in `failover.py`.

Hung peers: a worker that stops answering (SIGSTOP, a partitioned network, a
wedged host) raises no error; its peers just wait in the step's
collectives. One watchdog thread on the chief (TF's `coordinator/watchdog.py`
pattern) fails any step part that has run longer than the strategy's
`collective_timeout_seconds` with `DeadlineExceededError` naming the step and
the workers still in it, which goes through failover like any task failure.
This replaces per-op collective timeouts, which cost one sleeping OS thread
per collective op on the workers (see `collectives.py`).
"""

import logging as std_logging
import queue
import threading
import time
import warnings
from typing import Dict, List, Optional, Tuple

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin._internal.tf_internal import cancellation, cluster_coordinator, context
from tf_psplugin._internal.tf_internal import coordinator_context, input_ops
from tf_psplugin._internal.tf_internal import coordinator_values, executor
from tf_psplugin.cluster import liveness
from tf_psplugin.runtime import epochs as epochs_lib
from tf_psplugin.sync import replicated as variables_lib

_STOP = object()
# How often a blocked RemoteValue fetch looks for a coordinator error.
_FETCH_POLL_SECONDS = 0.5


class _StepPart:
    """One worker's share of a synchronous step."""

    __slots__ = ("step", "worker_index")

    def __init__(self, step, worker_index):
        self.step = step
        self.worker_index = worker_index


class _SyncRemoteValue(coordinator_values.RemoteValueImpl):
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


class _SyncStep:
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
        self.remote_value = _SyncRemoteValue(coordinator, output_spec, generation)
        self.remaining = num_workers
        self.error: Optional[BaseException] = None
        self.timed_out = False  # Set once by the watchdog.
        # Decided by the first worker thread that picks the step up, and then
        # the same for every worker: a part that runs while a peer's part was
        # cancelled waits in the step's collectives forever.
        self.cancelled: Optional[bool] = None
        self.done = threading.Event()


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
        self._examples_per_step: Optional[int] = None
        self._leaders = None  # See `_role_leaders`.
        # Which worker's replica eager reads pull from (a survivor after a failure).
        self.preferred_replica = 0
        # Set by the strategy: a failover.FailoverController, or None.
        self.failover = None
        self.recovering = False
        # worker index -> (step, monotonic start) of the part it is running.
        self._running: Dict[int, Tuple[_SyncStep, float]] = {}
        # Workers whose running part still waits for its per-worker input
        # (an iterator whose dataset function has not returned yet).
        self._creating_input: set = set()
        self._finished_steps = 0  # Steps every worker finished (for the watchdog's message).
        resolver = strategy._cluster_resolver  # pylint: disable=protected-access
        spec = resolver.cluster_spec().as_dict()
        self._ps_addresses = list(spec.get("ps", []))
        self._worker_addresses = list(spec.get("worker", []))
        self.step_timeout_seconds = float(
            getattr(strategy.extended, "step_timeout_seconds", 0.0) or 0.0)
        self._stopped = threading.Event()
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
                t = threading.Thread(target=self._watchdog_loop, name="tf_psplugin-step-watchdog",
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
            return super().schedule(fn, args=args, kwargs=kwargs)
        self._raise_if_error()
        # Each step its own cancellation manager (not the stock closure
        # queue's): `_cancel_waiting_peers` cancels this step and no other.
        manager = cancellation.CancellationManager()
        closures = self._trace_per_role(fn, args, kwargs, manager)
        used = {}
        for closure in {id(c): c for c in closures}.values():  # Roles share closures.
            concrete = getattr(closure, "_concrete_function", None)
            if concrete is not None:
                for var in variables_lib.replicated_variables_used_by(concrete):
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
            step = _SyncStep(self, self._step_counter,
                             [c._function for c in closures],  # pylint: disable=protected-access
                             first._args, first._kwargs,  # pylint: disable=protected-access
                             first._output_type_spec, self._num_workers,  # pylint: disable=protected-access
                             self._generation, manager)
            self._inflight += 1
        for i, q in enumerate(self._queues):
            q.put(_StepPart(step, i))
        return step.remote_value

    def _trace_per_role(self, fn, args, kwargs, manager):
        """Returns one traced Closure per worker.

        A `tf.function` is traced once per update role (the PS tasks whose
        table shards a worker updates, `extended.update_role`), under the
        device of the role's first worker: the strategy makes the device part
        of the function's cache key, so each role gets its own graph (traced
        once, then looked up) in which `extended.tracing_worker_index` named
        that worker. Workers with the same role share the traced function
        (traced graphs carry no worker device). A concrete function is
        shared by every worker as it is.
        """
        extended = self.strategy.extended
        on_read = extended.on_read_updates
        traced = on_read.step_function(fn)
        while True:
            closures, left_pending = self._trace_each_role(traced, args, kwargs, manager)
            if not left_pending:
                return closures
            # A trace ended with ON_READ updates pending (a metric updated
            # after the gradients and never read in the step): trace a
            # replacement that writes them (see on_read_updates.py).
            traced = on_read.replacement_for(fn, traced, left_pending)

    def _trace_each_role(self, fn, args, kwargs, manager):
        """`_trace_per_role` for one function.

        Returns:
            (closures, names): the closures, or None and the names of the
            ON_READ variables whose updates a trace left pending.
        """
        extended = self.strategy.extended
        per_role = isinstance(fn, tf.types.experimental.GenericFunction) and not isinstance(
            fn, tf.types.experimental.ConcreteFunction)
        on_read = extended.on_read_updates
        with self.strategy.scope():
            extended._being_scheduled = True  # pylint: disable=protected-access
            extended.tracing_sync_step = True
            try:
                if not per_role:
                    closure = self._new_closure(fn, args, kwargs, manager)
                    left = on_read.left_pending()
                    return (None, left) if left else ([closure] * self._num_workers, [])
                by_leader = {}
                with extended.collective_group.same_keys_per_trace():
                    for leader in self._role_leaders():
                        if id(leader) not in by_leader:
                            extended.tracing_worker_index = leader.worker_index
                            with tf.device(leader.device_name):
                                by_leader[id(leader)] = self._new_closure(
                                    fn, args, kwargs, manager)
                            # A trace (if any) is over: nothing may be left pending.
                            left = on_read.left_pending()
                            if left:
                                return None, left
                return [by_leader[id(leader)] for leader in self._role_leaders()], []
            finally:
                on_read.discard()
                extended._being_scheduled = False  # pylint: disable=protected-access
                extended.tracing_sync_step = False
                extended.tracing_worker_index = None

    def _role_leaders(self):
        """For each worker, the first worker with its update role (computed once)."""
        if self._leaders is None:
            first = {}
            self._leaders = [
                first.setdefault(self.strategy.extended.update_role(w.worker_index), w)
                for w in self._cluster.workers]
        return self._leaders

    def _new_closure(self, fn, args, kwargs, manager):
        return cluster_coordinator.Closure(fn, manager, args=args, kwargs=kwargs)

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
        now = time.monotonic()
        with self._lock:
            return {i: (step.step_id, now - start) for i, (step, start) in self._running.items()}

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
        return self._examples_per_step

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
        per_worker = self._create_per_worker_dataset(dataset_fn)
        self._examples_per_step = _static_batch_size(per_worker)
        if self._examples_per_step is not None and self._synchronous:
            self._examples_per_step *= self._num_workers
        return per_worker

    def _create_per_worker_dataset(self, dataset_fn):
        """Builds the per-worker dataset (see `create_per_worker_dataset`)."""
        if not self._synchronous:
            return super().create_per_worker_dataset(dataset_fn)
        evaluation = epochs_lib.building_evaluation_inputs()
        if callable(dataset_fn) and not isinstance(dataset_fn, tf.data.Dataset):
            per_worker = super().create_per_worker_dataset(dataset_fn)
            if _returns_dataset(per_worker):
                # The user's function shards itself: its lengths may differ
                # per worker, so the epoch length is agreed on (epochs.py).
                return epochs_lib.SyncPerWorkerDataset(
                    per_worker._dataset_fn, self, evaluation)  # pylint: disable=protected-access
            return per_worker  # E.g. Keras's DatasetCreator: steps are required.
        original = getattr(dataset_fn, "_original_dataset", dataset_fn)
        if not isinstance(original, tf.data.Dataset):
            return super().create_per_worker_dataset(dataset_fn)
        serialized = coordinator_values.serialize_dataset_to_graph(original)
        element_spec = original.element_spec
        num_workers = self._num_workers
        policy = original.options().experimental_distribute.auto_shard_policy

        def sharded_dataset_fn(by_element=False):
            ds = coordinator_values.deserialize_dataset_from_graph(serialized, element_spec)
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            if by_element:  # Batch i, i+W, ... (AUTO's fallback, see below).
                return ds.shard(num_workers, index)
            # tf.data's auto-shard rewrite, as MultiWorkerMirroredStrategy
            # applies it: by file where the input reads files (each worker
            # opens 1/W of them), else by element (here a batch: worker i
            # reads batches i, i+W, ...); `tf.data.Options` auto-shard
            # settings are honoured (OFF: every worker reads everything).
            if policy == tf.data.experimental.AutoShardPolicy.OFF:
                return ds
            with warnings.catch_warnings():
                # It reads the options in graph mode, which TF warns may be
                # stale; `policy` was read eagerly above.
                warnings.simplefilter("ignore", UserWarning)
                return input_ops.auto_shard_dataset(ds, num_workers, index,
                                                    num_replicas_in_sync=1)

        if policy == tf.data.experimental.AutoShardPolicy.AUTO and not (
                _reads_files(serialized) and self._file_sharding_applies(sharded_dataset_fn)):
            # In-memory input (no file reader: what AUTO would shard by
            # element anyway, without the rewrite), or too few files.
            return epochs_lib.SyncPerWorkerDataset(
                lambda: sharded_dataset_fn(by_element=True), self, evaluation)
        return epochs_lib.SyncPerWorkerDataset(sharded_dataset_fn, self, evaluation)

    def _file_sharding_applies(self, sharded_dataset_fn) -> bool:
        """Whether AUTO sharding of this input works on the workers (tried once).

        tf.data's AUTO policy shards by file when the input reads files, but
        fails (at the first element) when it reads fewer files than there are
        workers, where MultiWorkerMirroredStrategy users must switch the
        policy to DATA by hand. Here each worker builds its shard and takes
        one element; on that error the input is sharded by batch instead.
        """
        @tf.function
        def first_element():  # A tf.function: the worker index is read when it runs.
            return iter(sharded_dataset_fn()).get_next_as_optional().has_value()

        # The stock worker threads log a failed resource closure at ERROR;
        # this failure is expected and handled here.
        quiet = _DropMessages("FILE based sharding")
        tf_logger = std_logging.getLogger("tensorflow")
        tf_logger.addFilter(quiet)
        try:
            remote = self._create_per_worker_resources(first_element)
            for value in remote._values:  # pylint: disable=protected-access
                value.fetch()
        except (tf.errors.InvalidArgumentError, cluster_coordinator.ClosureInputError) as e:
            if "FILE based sharding" not in str(e):
                return True  # Another error: the input's own, raised where TF raises it.
            logging.info("tf_psplugin: the input reads fewer files than there are workers: "
                         "sharding it by batch instead of by file.")
            return False
        finally:
            tf_logger.removeFilter(quiet)
        return True

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
        worker_executor = _new_sync_executor()
        while True:
            part = q.get()
            if part is _STOP:
                _release_executor(worker_executor)
                return
            step = part.step
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
                    self._running[worker.worker_index] = (step, time.monotonic())
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
            # Keep nothing of the step (its inputs hold the user's iterators).
            del part, step, outputs, error

    def _execute(self, step, worker, worker_executor):
        args = cluster_coordinator._select_worker_slice(worker.worker_index, step.args)  # pylint: disable=protected-access
        kwargs = cluster_coordinator._select_worker_slice(worker.worker_index, step.kwargs)  # pylint: disable=protected-access
        # As the stock Closure.execute_on: a per-worker input (iterator) whose
        # creation failed is a ClosureInputError wrapping the original error
        # (the user's dataset error, or a dead worker's UnavailableError).
        with self._lock:
            self._creating_input.add(worker.worker_index)
        try:  # Waits for the worker's input iterators to exist.
            error = (cluster_coordinator._get_error_from_remote_values(args)  # pylint: disable=protected-access
                     or cluster_coordinator._get_error_from_remote_values(kwargs))  # pylint: disable=protected-access
        finally:
            with self._lock:
                self._creating_input.discard(worker.worker_index)
        if error is not None:
            if not isinstance(error, cluster_coordinator.ClosureInputError):
                error = cluster_coordinator.ClosureInputError(error)
            raise error
        args = tf.nest.map_structure(coordinator_context.maybe_get_remote_value, args)
        kwargs = tf.nest.map_structure(coordinator_context.maybe_get_remote_value, kwargs)
        with tf.device(worker.device_name), context.executor_scope(worker_executor):
            with coordinator_context.with_dispatch_context(worker):
                outputs = step.functions[worker.worker_index](*args, **kwargs)
        if worker.worker_index == 0:
            step.remote_value._set_values(outputs)  # pylint: disable=protected-access
            step.remote_value.get()  # Copy to the chief while the worker is alive.
        return outputs

    def _watchdog_loop(self):
        """Fails steps whose parts make no progress (see the module docstring).

        Polls often enough to notice a hang within ~10% of the timeout and at
        most every 5 s; costs one sleeping thread on the chief in all.
        """
        limit = self.step_timeout_seconds
        poll = min(max(limit / 10.0, 0.05), 5.0)
        while not self._stopped.wait(poll):
            self._fail_hung_step(limit)

    def _fail_hung_step(self, limit: float) -> Optional[BaseException]:
        """Fails the oldest step with a part running longer than `limit` s."""
        now = time.monotonic()
        with self._lock:
            hung = [(start, i, step) for i, (step, start) in self._running.items()
                    if now - start > limit and not step.timed_out]
            if not hung:
                return None
            _, _, step = min(hung, key=lambda h: (h[0], h[1]))
            workers = sorted(i for i, (s, _) in self._running.items() if s is step)
            creating = sorted(i for i in workers if i in self._creating_input)
            first_step = self._finished_steps == 0
        # Outside the lock: connection probes take up to a second each.
        why = self._why_no_progress(workers, creating, first_step)
        with self._lock:
            if step.timed_out:
                return None
            step.timed_out = True
            names = ", ".join(f"worker:{i} (/job:worker/replica:0/task:{i})" for i in workers)
            error = tf.errors.DeadlineExceededError(
                None, None,
                f"tf_psplugin: step {step.step_id} made no progress for {limit:g} s on {names}: "
                f"{why} Fix: check those workers and their input (and the network between "
                "them); if steps are legitimately that slow, raise "
                "HybridParameterServerStrategy(collective_timeout_seconds=...).")
            if step.error is None:
                step.error = error
            self._error = self._error or error
            self._idle.notify_all()
            set_remote_error = 0 in workers
        logging.error("%s", error.message)
        if set_remote_error:
            step.remote_value._set_error(error)  # pylint: disable=protected-access
        return error

    def _why_no_progress(self, workers: List[int], creating: List[int], first_step: bool) -> str:
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

    def _finish_part(self, step, worker_index, outputs, error, cancelled=False):
        with self._lock:
            if self._running.get(worker_index, (None,))[0] is step:
                del self._running[worker_index]
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
                self._finished_steps += 1
            # The user's error (a step or input pipeline that failed on this
            # worker) while peers still run the step: they wait in its
            # collectives for a part that will never come.
            cancel_peers = (error is not None and not finished and not cancelled
                            and not isinstance(error, tf.errors.CancelledError))
        if cancel_peers:
            self._cancel_waiting_peers(step, error)
        if error is not None and worker_index == 0:
            step.remote_value._set_error(error)  # pylint: disable=protected-access
        if finished:
            if step.error is not None and step.remote_value._status is not None:  # pylint: disable=protected-access
                step.remote_value._set_error(step.error)  # pylint: disable=protected-access
            step.done.set()
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.notify_all()

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
        skips it. Task failures are left to failover, which abandons the
        parts stuck with a dead peer.
        """

        if step.cancellation_manager is None or liveness.is_task_failure(error):
            return
        step.cancellation_manager.start_cancel()

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


# tf.data's file readers (dataset op names, TF 2.15-2.21): what its FILE
# auto-sharding shards. Other sources are sharded by element.
_FILE_READER_OPS = ("TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
                    "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2")


def _reads_files(serialized_dataset: tf.Tensor) -> bool:
    """Whether a serialized dataset graph has a tf.data file reader (functions included)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized_dataset.numpy())
    ops = {node.op for node in graph.node}
    ops.update(node.op for function in graph.library.function for node in function.node_def)
    return any(op in _FILE_READER_OPS for op in ops)


class _DropMessages(std_logging.Filter):
    """A logging filter that drops records containing `text`."""

    def __init__(self, text: str):
        super().__init__()
        self._text = text

    def filter(self, record) -> bool:
        return self._text not in record.getMessage()


def _static_batch_size(per_worker_dataset) -> Optional[int]:
    """The leading static dimension shared by every tensor of an element, or None."""
    try:
        specs = tf.nest.flatten(per_worker_dataset.element_spec)
    except (AttributeError, TypeError, ValueError):  # No element_spec on this type.
        return None
    sizes = set()
    for spec in specs:
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape.rank < 1:
            return None
        sizes.add(shape[0])
    if len(sizes) != 1 or None in sizes:
        return None
    return int(sizes.pop())


def _returns_dataset(per_worker) -> bool:
    """Whether a stock per-worker dataset's function returns a `tf.data.Dataset`."""
    fn = getattr(per_worker, "_dataset_fn", None)
    return isinstance(getattr(fn, "structured_outputs", None), tf.data.Dataset)


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

