"""Dense variables replicated on every worker: `ReplicatedVariable`.

Why this exists: TF's `PerWorkerVariable` gives one copy of a variable per
worker, resolved at call time inside scheduled functions, but it is not
trainable and its copy on the coordinator (the chief) never sees what the
workers did. Keras needs both: optimizers and `GradientTape` must treat the
replicas as one trainable variable, and the chief must read and write the
variable eagerly (checkpoints, `get_weights`, callbacks, `set_value(lr)`).

The model here is a primary copy on the chief plus one replica per worker:

* Inside a scheduled function the handle resolves to the running worker's
  replica (one placeholder per function graph, so the tape matches reads and
  gradients). The function graph records which replicated variables it uses.
* When the coordinator dispatches such a function, those variables are marked
  "replicas ahead". An eager read on the chief then waits for the in-flight
  synchronous steps and pulls worker 0's replica into the primary (all
  replicas are identical in synchronous training).
* An eager write on the chief (`assign*`, `scatter_*`, checkpoint restore,
  `set_weights`) marks the variable "primary ahead"; the coordinator pushes
  the primary to every replica before the next function that uses it runs. New variables start "primary ahead", so every replica
  starts from the same initial value.
"""

import contextlib
import functools
import threading
from typing import Callable, List, Optional

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.scopes import ThreadScope
from tf_psplugin._internal.tf_internal import context, coordinator_context, ps_values, save_context
from tf_psplugin.sync import outside_writes

_GRAPH_USES_ATTR = "_tf_psplugin_replicated_uses"
_GRAPH_PENDING_ATTR = "_tf_psplugin_pending_table_updates"

_IN_UPDATE = ThreadScope()  # Inside one variable's optimizer update.


def outermost_function_graph(graph=None):
    """Returns the outermost FuncGraph enclosing `graph` (the traced function)."""
    g = graph if graph is not None else tf.compat.v1.get_default_graph()
    while getattr(g, "outer_graph", None) is not None and _is_func_graph(g.outer_graph):
        g = g.outer_graph
    return g


def _is_func_graph(g) -> bool:
    return type(g).__name__ == "FuncGraph" or hasattr(g, "capture_call_time_value")


def replicated_variables_used_by(concrete_function) -> List["ReplicatedVariable"]:
    """Returns the replicated variables a traced function reads or writes."""
    return list(getattr(concrete_function.graph, _GRAPH_USES_ATTR, {}).values())


_GRAPH_OPEN_ATTR = "_tf_psplugin_step_open"
_GRAPH_CLOSED_IN_ATTR = "_tf_psplugin_step_closed_in"


def _enclosing_graphs(graph) -> list:
    """`graph` and every graph it is nested in, innermost first."""
    out = []
    while graph is not None:
        out.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return out


def open_step() -> None:
    """Marks that the function being traced has reduced this step's gradients.

    The next write to a replicated variable made outside the strategy's
    per-variable updates (every Keras optimizer ends `apply_gradients` with
    `iterations.assign_add`) closes the step: it first waits for the
    strategy's end-of-step ops (the table barrier and the commit counter).
    """
    g = outermost_function_graph()
    if getattr(g, _GRAPH_CLOSED_IN_ATTR, None):
        # The last step was closed in branches (see `_close_step`): what
        # they recorded belongs to them.
        setattr(g, _GRAPH_PENDING_ATTR, [])
    setattr(g, _GRAPH_OPEN_ATTR, True)
    setattr(g, _GRAPH_CLOSED_IN_ATTR, [])


def add_pending_table_update(op) -> None:
    """Records a gated sparse table update in the function being traced.

    The end-of-step barrier depends on these updates, so no worker can start
    reading tables for the next step before all of this step's updates have
    landed on the PS.
    """
    g = outermost_function_graph()
    pending = getattr(g, _GRAPH_PENDING_ATTR, None)
    if pending is None:
        pending = []
        setattr(g, _GRAPH_PENDING_ATTR, pending)
    pending.append((tf.compat.v1.get_default_graph(), op))


def _close_step() -> Optional[list]:
    """Closes the open step of the current function; returns its table updates.

    Closed from a graph nested in the function (a `tf.cond` branch, such as
    those of Keras's LossScaleOptimizer: apply the step, or skip it), the
    step is closed for that branch only: a sibling branch (same enclosing
    graph) closes it too, each with the table updates made in it (or around
    it); no other graph does. Every worker takes the same branch
    (`sync/loss_scaling.py`), so each runs the end of the step once.
    """
    g = outermost_function_graph()
    if not getattr(g, _GRAPH_OPEN_ATTR, False):
        return None
    here = tf.compat.v1.get_default_graph()
    enclosing = _enclosing_graphs(here)
    closed_in = getattr(g, _GRAPH_CLOSED_IN_ATTR, None)
    if closed_in is None:
        closed_in = []
        setattr(g, _GRAPH_CLOSED_IN_ATTR, closed_in)
    outer = getattr(here, "outer_graph", None)
    if closed_in and (here is g or any(c is here or getattr(c, "outer_graph", None) is not outer
                                       for c in closed_in)):
        return None  # Closed already, for this graph: only a sibling branch closes too.
    pending = getattr(g, _GRAPH_PENDING_ATTR, None) or []
    mine = [op for graph, op in pending if any(graph is e for e in enclosing)]
    if here is g:
        setattr(g, _GRAPH_OPEN_ATTR, False)
        setattr(g, _GRAPH_PENDING_ATTR, [])
    else:
        closed_in.append(here)
    return mine


@contextlib.contextmanager
def inside_variable_update():
    """Marks writes as part of one variable's optimizer update (not step end)."""
    with _IN_UPDATE.scope():
        yield


class ReplicatedVariable(ps_values.PerWorkerVariable):
    """A trainable variable with one identical replica on every worker.

    Created by `HybridParameterServerStrategy` for dense variables; users do
    not construct it directly.

    Args:
        strategy: The owning strategy (its coordinator holds the replicas).
        next_creator: The next variable creator.
        end_of_step_fn: Called with the step's pending table-update ops when
            this variable is the first one written after the step's updates
            (see `open_step`); returns ops to wait for (the table barrier and
            the commit counter).
        update_reduce_fn: For ``ON_READ`` variables (metric accumulators,
            batch-norm statistics): called with `(variable, delta, apply,
            read_value)` for an in-step `assign_add`/`assign_sub`, where
            `apply(d)` does the write with delta `d` (keyword ``subtract``:
            the write is an ``assign_sub``); it writes the delta
            reduced across workers (per the variable's aggregation), now or
            later (`on_read_updates`), so every replica applies the global
            update and stays identical, and returns what the write returns.
        graph_use_fn: Called with the variable whenever a traced function
            uses its handle (applies a pending update of it first).
        **kwargs: Variable creation arguments (as for `tf.Variable`).
    """

    def __init__(self, strategy, next_creator, end_of_step_fn: Optional[Callable] = None,
                 update_reduce_fn: Optional[Callable] = None,
                 graph_use_fn: Optional[Callable] = None, **kwargs):
        trainable = kwargs.get("trainable", None)
        synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        if trainable is None:
            trainable = synchronization != tf.VariableSynchronization.ON_READ
        # Workers start from zeros (cheap); the primary's value is pushed to
        # them before first use.
        super().__init__(strategy, next_creator, **kwargs)
        primary = self._coordinator_instance
        self._trainable = bool(trainable)
        self._unique_id = tf_objects.variable_unique_id(primary)
        self._handle_name = tf_objects.variable_handle_name(primary)
        self._distribute_strategy = strategy
        self._synchronization = synchronization
        self._aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        self._constraint = kwargs.get("constraint", None)
        self._save_slice_info = None
        self._end_of_step_fn = end_of_step_fn
        self._update_reduce_fn = (
            update_reduce_fn if synchronization == tf.VariableSynchronization.ON_READ else None)
        self._graph_use_fn = (
            graph_use_fn if synchronization == tf.VariableSynchronization.ON_READ else None)
        self._sync_lock = threading.Lock()
        self._primary_ahead = True
        self._replicas_ahead = False
        # The creator chain captured by PerWorkerVariable may belong to a
        # tf.function trace (optimizer slots are created while the train step
        # is traced); replicas are created later on worker threads, so build
        # them from plain arguments instead, starting at zeros.
        self._var_creator = functools.partial(
            _create_replica, shape=primary.shape, dtype=primary.dtype,
            name=tf_objects.variable_shared_name(primary))
        self._maybe_create_per_worker_vars()

    # -- identity -------------------------------------------------------------

    @property
    def trainable(self):
        return self._trainable

    @property
    def constraint(self):
        return self._constraint

    @property
    def synchronization(self):
        return self._synchronization

    @property
    def aggregation(self):
        return self._aggregation

    @property
    def primary(self) -> tf.Variable:
        """The chief's copy (what eager reads and checkpoints see)."""
        return self._coordinator_instance

    def worker_devices(self) -> List[str]:
        """Devices of the replicas, one per worker."""
        return [w.device_name for w in tf_objects.coordinator_workers(self._coordinator)]

    def __repr__(self):
        return (f"<tf_psplugin.ReplicatedVariable '{self.name}' shape={self.shape} "
                f"dtype={self.dtype.name} "
                f"replicas={len(tf_objects.coordinator_workers(self._coordinator))}>")

    # -- handle resolution ----------------------------------------------------

    @property
    def handle(self):
        if tf.executing_eagerly() or _in_save_context():
            # A SavedModel export (ModelCheckpoint's default) asks for the
            # handle while its v1 export graph is the default graph: the pull
            # from the workers is eager work, so it runs in eager mode
            # (tf.init_scope does not leave a v1 graph).
            with context.eager_mode():
                self._on_eager_access()
            return self._coordinator_instance.handle
        if self._graph_use_fn is not None:
            self._graph_use_fn(self)
        graph = tf.compat.v1.get_default_graph()
        outer = outermost_function_graph(graph)
        uses = getattr(outer, _GRAPH_USES_ATTR, None)
        if uses is None:
            uses = {}
            setattr(outer, _GRAPH_USES_ATTR, uses)
        uses[id(self)] = self
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        # One placeholder per traced function (keyed), so GradientTape sees the
        # same handle for every read and for the gradient source. It lives in
        # the outermost function graph: call-time values are only fed there,
        # and nested graphs (cond branches, loop bodies) capture it normally.
        with outer.as_default():
            placeholder = outer.capture_call_time_value(
                closure, spec, key=("tf_psplugin_replica", id(self)))
        if graph is outer:
            return placeholder
        return graph.capture(placeholder)

    @property
    def device(self):
        if tf.executing_eagerly():
            return self._coordinator_instance.device
        return super().device

    def _mark_written(self):
        if tf.executing_eagerly():
            self._on_eager_access()
            self._primary_ahead = True
            # A write outside a step (set_weights, use_ema's finalize): a
            # checkpoint of this step saved before it is stale.
            outside_writes.note(self)

    def handle_call_time_value(self):
        """The handle a traced function gets when it is called.

        On a worker (inside a dispatch) it is that worker's replica. On the
        chief (a function run locally, e.g. `predict`, or TF's traced
        checkpoint save) it is the primary, brought up to date first.
        """
        worker_closure, spec = super().handle_call_time_value()

        def closure():
            if coordinator_context.get_current_dispatch_context() is None:
                self._on_eager_access()
                return self._coordinator_instance.handle
            return worker_closure()

        return closure, spec

    def _serialize_to_tensors(self):
        # Checkpoints read the primary; TF may trace the read into a function,
        # so bring the primary up to date eagerly first.
        self._on_eager_access()
        return tf_objects.serialize_to_tensors(self._coordinator_instance)

    def _restore_from_tensors(self, restored_tensors):
        self._mark_written()
        return tf_objects.restore_from_tensors(self._coordinator_instance, restored_tensors)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        self._mark_written()
        return super().scatter_update(sparse_delta, use_locking=use_locking, name=name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        self._mark_written()
        return super().scatter_add(sparse_delta, use_locking=use_locking, name=name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        self._mark_written()
        return super().scatter_sub(sparse_delta, use_locking=use_locking, name=name)

    # -- writes inside a synchronous step wait for the table barrier ----------

    def _barrier_deps(self):
        if (tf.executing_eagerly() or self._end_of_step_fn is None
                or _IN_UPDATE.active()):
            return []
        pending = _close_step()
        if pending is None:
            return []
        return list(self._end_of_step_fn(pending))

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self._mark_written()
        with tf.control_dependencies(self._barrier_deps()):
            return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def _update(self, write, delta, read_value, subtract=False):
        """An `assign_add`/`assign_sub` (`write`), reduced first for ON_READ variables."""
        self._mark_written()

        def apply(d):
            with tf.control_dependencies(self._barrier_deps()):
                return write(d)

        if self._update_reduce_fn is None or tf.executing_eagerly():
            return apply(delta)
        return self._update_reduce_fn(self, delta, apply, read_value, subtract=subtract)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        write = functools.partial(super().assign_add, use_locking=use_locking, name=name,
                                  read_value=read_value)
        return self._update(write, delta, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        write = functools.partial(super().assign_sub, use_locking=use_locking, name=name,
                                  read_value=read_value)
        return self._update(write, delta, read_value, subtract=True)

    def _as_graph_element(self):
        # Keras's AutoCastVariable (mixed precision) resolves a control
        # dependency on itself through its variable's `_as_graph_element`;
        # a PerWorkerVariable has no `_graph_element` (TF 2.15-2.21). The op
        # is what `tf.control_dependencies` takes for an uncast variable.
        return self.op

    # -- chief <-> replicas synchronisation ------------------------------------

    def _remote_vars(self):
        return [tf_objects.remote_value_local(rv)
                for rv in tf_objects.per_worker_values(self._per_worker_vars)]

    def _on_eager_access(self) -> None:
        if self._replicas_ahead:
            self.pull()

    def pull(self, worker_index: Optional[int] = None) -> None:
        """Copies one worker's replica into the chief's primary copy.

        Waits for in-flight synchronous steps first, so the value is the one
        after the last scheduled step.

        Args:
            worker_index: Which worker to read (all are identical in sync
                mode); default the coordinator's `preferred_replica` (worker 0,
                or a survivor during failover).
        """
        if not self._replicas_ahead:
            return
        wait = getattr(self._coordinator, "wait_for_sync_steps", None)
        if wait is not None:
            wait()
            # A failed step triggers failover here; outside the lock, because
            # recovery reads this variable again from another thread.
            self._coordinator.check_health()
        if worker_index is None:
            worker_index = getattr(self._coordinator, "preferred_replica", 0)
        with self._sync_lock:
            if not self._replicas_ahead:
                return
            remote = self._remote_vars()[worker_index]
            try:
                value = remote.read_value()
            except tf.errors.OpError as e:
                # The worker died after the last step finished: no step
                # failed, so nothing else will start failover.
                error = e
            else:
                with tf.device(self._coordinator_instance.device):
                    self._coordinator_instance.assign(tf.identity(value))
                self._replicas_ahead = False
                return
        # Outside the lock: recovery reads this variable from a survivor.
        on_error = getattr(self._coordinator, "on_remote_error", None)
        if on_error is None or getattr(self._coordinator, "recovering", False):
            raise error  # During recovery the caller (failover) handles it.
        on_error(error)  # Recovers (restarts the chief) or raises.

    def push_if_needed(self, worker_indices=None) -> bool:
        """Copies the primary to every (or the given) worker replica if stale.

        Returns:
            Whether anything was pushed.
        """
        with self._sync_lock:
            if not self._primary_ahead and worker_indices is None:
                return False
            value = self._coordinator_instance.read_value()
            remotes = self._remote_vars()
            for i, remote in enumerate(remotes):
                if worker_indices is None or i in worker_indices:
                    remote.assign(value)
            if worker_indices is None:
                self._primary_ahead = False
            return True

    def mark_dispatched(self) -> None:
        """Called by the coordinator when a function using this variable runs."""
        self._replicas_ahead = True

    def read_replica(self, worker_index: int) -> tf.Tensor:
        """Reads worker `worker_index`'s replica now, without waiting for steps (failover)."""
        return self._remote_vars()[worker_index].read_value()

    def replica_values(self) -> List[tf.Tensor]:
        """Reads every worker's replica (waits for in-flight steps)."""
        wait = getattr(self._coordinator, "wait_for_sync_steps", None)
        if wait is not None:
            wait()
        return [r.read_value() for r in self._remote_vars()]


def _create_replica(shape, dtype, name):
    """Creates one worker's replica (runs on the worker's dispatch thread)."""
    return tf.Variable(tf.zeros(shape, dtype), name=name, trainable=False)


def _in_save_context() -> bool:
    return save_context.in_save_context()


def current_worker_index() -> tf.Tensor:
    """The index of the worker running the current scheduled function (int64).

    Public TF API since 2.15; outside a dispatched function it is 0. Unlike
    TF's `experimental_get_current_worker_index`, it works inside control
    flow nested in the traced function.
    """
    if coordinator_context.get_current_dispatch_context() is None and tf.executing_eagerly():
        return tf.constant(0, tf.int64)
    graph = tf.compat.v1.get_default_graph()
    outer = outermost_function_graph(graph)
    if outer is graph:
        return tf.distribute.coordinator.experimental_get_current_worker_index()
    # Call-time values are fed to the outermost function graph only: asked
    # for inside a nested graph (a tf.cond branch, such as the one in which
    # Keras's LossScaleOptimizer applies gradients, or a loop body), the
    # index is captured there and the nested graph takes it as an input.
    with outer.as_default():
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
    return graph.capture(index)
