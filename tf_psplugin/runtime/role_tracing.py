"""Tracing a synchronous step: one traced function per update role, one closure per worker.

A synchronous step differs between workers only in which table-shard
updates it applies (`HybridExtended.update_role`). The strategy makes the
calling device part of a tf.function's cache key, so tracing the step under
the device of each role's first worker gives each role its own graph
(traced once, then looked up), in which `extended.tracing_worker_index`
names that worker and `_update` leaves the other roles' table updates out.
While it traces, the strategy's reductions and updates are the synchronous
ones (`extended.tracing_sync_step`), and the step's collectives get the same
instance keys in every role's trace.

Both this tracing and the stock coordinator's (asynchronous mode,
`schedule_async`) go through `stacked_fallback.trace_splitting`: a legacy
optimizer that needs its tables out of a shared stack gets them split apart
and the step traced again.
"""

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import cancellation, cluster_coordinator
from tf_psplugin.tables import stacked_fallback


class RoleTracing:
    """The coordinator's tracing of a step: one stock `Closure` per worker.

    One per `HybridClusterCoordinator` (its `_tracing`), used by `schedule`.

    Example (what `schedule` does):

    ```python
    tracing = RoleTracing(strategy, cluster.workers)
    closures = tracing.closures(train_step, args, kwargs, cancellation_manager)
    ```

    Args:
        strategy: The `HybridParameterServerStrategy` (its scope, and its
            Extended's tracing state, update roles and collective group).
        workers: The stock coordinator's workers (`worker_index`,
            `device_name`), in order.
    """

    def __init__(self, strategy, workers):
        self._strategy = strategy
        self._workers = list(workers)
        self._leaders = None  # See `_role_leaders`.

    def closures(self, fn, args, kwargs, manager):
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
        on_read = self._strategy.extended.on_read_updates
        traced = on_read.step_function(fn)
        while True:
            closures, left_pending = self._trace_splitting(traced, args, kwargs, manager,
                                                           scheduled=fn)
            if not left_pending:
                return closures
            # A trace ended with ON_READ updates pending (a metric updated
            # after the gradients and never read in the step): trace a
            # replacement that writes them (see on_read_updates.py).
            traced = on_read.replacement_for(fn, traced, left_pending)

    def schedule_async(self, schedule, fn, args=None, kwargs=None):
        """`schedule()` (the stock coordinator's, asynchronous mode), traced again after a split.

        The stock `Closure` traces `fn` before it is queued: a legacy
        optimizer not known to update a stack elementwise stops that trace
        (`SplitRequired`), nothing is queued, the tables are split apart and
        `schedule()` is called again, as in synchronous mode
        (`stacked_fallback.trace_splitting`). A function traced before a
        stack it reads was split is traced anew (a `Closure` made and not
        queued) and checked before it is queued.

        Args:
            schedule: Calls the stock `ClusterCoordinator.schedule` with the step.
            fn: The step (`tf.function` or concrete function).
            args: The step's positional arguments, as scheduled.
            kwargs: Its keyword arguments.

        Returns:
            What `schedule()` returned (the stock `RemoteValue`).
        """
        extended = self._strategy.extended

        def probe():
            # As the stock schedule traces: in the strategy's scope, "being scheduled".
            with self._strategy.scope():
                tf_objects.set_being_scheduled(extended, True)
                try:
                    self._new_closure(fn, args, kwargs, cancellation.CancellationManager())
                finally:
                    tf_objects.set_being_scheduled(extended, False)

        return stacked_fallback.trace_splitting(schedule, fn, extended.table_stacks,
                                                probe=probe)

    def _trace_splitting(self, fn, args, kwargs, manager, scheduled=None):
        """`_trace_each_role`, traced again after splitting stacks a legacy optimizer needs apart.

        See `stacked_fallback.trace_splitting`: a legacy optimizer not known
        to update a stack elementwise, applying tables that share a stack (a
        custom loop), stops the trace before it makes any slot; the tables
        are split apart and the step is traced again, as its first call.
        `scheduled`: the function the user scheduled, if `fn` replaces it.
        """
        return stacked_fallback.trace_splitting(
            lambda: self._trace_each_role(fn, args, kwargs, manager), fn,
            self._strategy.extended.table_stacks,
            lambda result: [tf_objects.closure_concrete_function(c) for c in result[0] or ()],
            scheduled=scheduled)

    def _trace_each_role(self, fn, args, kwargs, manager):
        """`closures` for one function.

        Returns:
            (closures, names): the closures, or None and the names of the
            ON_READ variables whose updates a trace left pending.
        """
        extended = self._strategy.extended
        per_role = isinstance(fn, tf.types.experimental.GenericFunction) and not isinstance(
            fn, tf.types.experimental.ConcreteFunction)
        on_read = extended.on_read_updates
        with self._strategy.scope():
            tf_objects.set_being_scheduled(extended, True)
            extended.tracing_sync_step = True
            try:
                if not per_role:
                    closure = self._new_closure(fn, args, kwargs, manager)
                    left = on_read.left_pending()
                    return (None, left) if left else ([closure] * len(self._workers), [])
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
                tf_objects.set_being_scheduled(extended, False)
                extended.tracing_sync_step = False
                extended.tracing_worker_index = None

    def _role_leaders(self):
        """For each worker, the first worker with its update role (computed once)."""
        if self._leaders is None:
            first = {}
            self._leaders = [
                first.setdefault(self._strategy.extended.update_role(w.worker_index), w)
                for w in self._workers]
        return self._leaders

    def _new_closure(self, fn, args, kwargs, manager):
        return cluster_coordinator.Closure(fn, manager, args=args, kwargs=kwargs)
