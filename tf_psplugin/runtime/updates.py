"""Updates in a synchronous step: who applies each update, and the end of the step.

`HybridExtended._update` (what optimizers and `assign_*` call through the
strategy) comes here. A replicated variable is updated on every worker with
the same reduced gradient; a table shard is updated by exactly one worker
(its owner, see `variable_creation`), only in that worker's trace of the
step; the rows an update touches are stamped for incremental checkpoints;
hooks run after a shard's update (`DynamicEmbedding`'s admission). Metric
and batch-norm updates (``ON_READ``) go through `on_read_updates`. At the
end of a step every worker passes a barrier that waits for the step's table
updates, then counts the step as committed (for failover).
"""

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.tf_internal import distribute_lib
from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.runtime.variable_creation import _unwrap
from tf_psplugin.sync import replicated
from tf_psplugin.tables import half_precision
from tf_psplugin.tables import stacked_fallback
from tf_psplugin.tables import stacked_updates
from tf_psplugin.tables import stacking


class Updates:
    """A synchronous step's updates, and what runs with them.

    One per `HybridExtended` (its `updates`): TF's `_update` (optimizer
    applies, `assign_*` in a replica context) comes here, and
    `ReplicatedVariable` calls `on_read_update`, `on_read_use` and
    `end_of_step`. Owns the hooks run after a table shard's update
    (`run_after_update`) and the row stamps of incremental checkpoints
    (`track_updated_rows`).

    Example (what `HybridExtended._update` does):

    ```python
    updates = Updates(extended, creation)
    done = updates.update(var, fn, args, kwargs, group, stock_update)
    ```

    Args:
        extended: The `HybridExtended` (modes, tracing state, collective
            group, on-read updates, step counters; TF's value selection).
        creation: Its `VariableCreation` (which variables are table shards,
            and which worker owns each).
    """

    def __init__(self, extended, creation):
        self._extended = extended
        self._creation = creation
        # Table shard -> ops its owner runs after the shard's sync update
        # (layers.DynamicEmbedding admits new keys there).
        self._after_update = IdentityMap()
        # Table shard -> incremental.RowStamps: every optimizer apply to the
        # shard also stamps the rows it touched (incremental checkpoints).
        self._row_stamps = IdentityMap()
        # Table shards whose update was traced without stamps: tracking them
        # now would miss that trace's updates. (Entries die with the shard.)
        self._traced_without_stamps = IdentityMap()

    def _sync_embeddings(self) -> bool:
        return self._extended.embedding_updates == "sync"

    def run_after_update(self, shard, fn) -> None:
        """Makes the worker that updates `shard` in a sync step also run `fn()`.

        `fn` builds ops (it returns an op or None) that run after the shard's
        optimizer update and before the end-of-step barrier, in the updating
        worker's trace only: every worker's forward pass of the step is done
        by then, and none of the next step has started. In any other mode
        `fn` is never called (see `admits_after_update`).
        """
        if not self._creation.is_table_var(shard):
            raise StrategyError(f"run_after_update: {getattr(shard, 'name', shard)!r} is not "
                                "a table shard of this strategy.")
        self._after_update[_unwrap(shard)] = fn

    def track_updated_rows(self, shard, stamps) -> None:
        """Makes every optimizer apply to table `shard` also call `stamps.mark(grad)`.

        Used by incremental checkpoints (`incremental.RowStamps`): the mark is
        one scatter on the shard's own PS, in the same trace as the update.
        Must be called before any step that updates the shard is traced.

        Raises:
            StrategyError: `shard` is not a table shard, is tracked already, or
                a step updating it was already traced (its updates would go
                unrecorded).
        """
        key = _unwrap(shard)
        if not self._creation.is_table_var(shard):
            raise StrategyError(f"track_updated_rows: {getattr(shard, 'name', shard)!r} is not "
                                "a table shard of this strategy.")
        if key in self._traced_without_stamps:
            raise StrategyError(
                f"incremental checkpoints: a training step updating {shard.name!r} was traced "
                "before row tracking was set up, so its updates would be missing from deltas. "
                "Fix: create the CheckpointManager (or pass ChiefCheckpoint to the first fit) "
                "before the first training step.")
        if self._row_stamps.get(key, stamps) is not stamps:
            raise StrategyError(
                f"incremental checkpoints: {shard.name!r} is already tracked for another "
                "ChiefCheckpointManager(full_every_saves=...); steps traced for that one would not "
                "update this one's record. Fix: one incremental manager per model.")
        self._row_stamps[key] = stamps

    def admits_after_update(self) -> bool:
        """True while a sync step is traced whose table updates run `run_after_update` hooks."""
        return self._extended.in_sync_step() and self._sync_embeddings()

    def update(self, var, fn, args, kwargs, group, stock_update):
        """`HybridExtended._update`: applies `fn` to `var` where and by whom it must run.

        Args:
            var: The variable updated (a replica, a table shard or view, a
                slot, a PS variable).
            fn: The update function, called as ``fn(var, *args, **kwargs)``.
            args: Its positional arguments (the gradient first, for an
                optimizer's apply).
            kwargs: Its keyword arguments.
            group: As TF's `_update`: return one grouped result.
            stock_update: Stock `ParameterServerStrategyV2Extended._update`
                (bound), which runs the update on the variable's device.

        Returns:
            As TF's `_update`; in a sync step, for a PS variable, a boolean
            tensor that depends on the update's writes (True where this
            worker applied it).

        Raises:
            stacked_updates.StackingError: a gradient applied to a stacked
                table's view directly (not through a Keras optimizer; a Keras
                optimizer's per-table apply, `stacked_fallback.applying_per_table`,
                writes the view's rows through its methods).
        """
        if isinstance(var, stacking.TableView) and (args or kwargs) \
                and not stacked_fallback.applying_per_table():
            # An optimizer applying a gradient to a view itself would write
            # the view's rows at the wrong place of the stack shard (its
            # kernels take the shard's handle); Keras's are merged first.
            raise stacked_updates.StackingError(
                f"stack_tables=True: {getattr(fn, '__qualname__', fn)} updates "
                f"{var.name}, a stacked table's rows, with a gradient directly; only Keras 2 "
                "optimizers (tf.keras.optimizers, .legacy) update stacked tables. Fix: "
                "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)), "
                "or a Keras optimizer.")
        # A legacy optimizer under a mixed-precision policy updates the layer's
        # AutoCastVariable: the variable inside it decides where the update goes.
        if isinstance(tf_objects.autocast_inner(var), replicated.ReplicatedVariable):
            with distribute_lib.UpdateContext(var.device), replicated.inside_variable_update():
                select = tf_objects.single_value_selector(self._extended)
                result = fn(var, *select(args), **select(kwargs))
            if group:
                return result
            return tf.nest.map_structure(
                tf_objects.local_results_of(self._extended), result)
        if (args or kwargs) and half_precision.is_half(getattr(var, "dtype", None)) \
                and self._creation.is_table_var(var):
            # A half-precision table's apply runs in float32 with its float32 slots.
            fn = half_precision.float32_update(fn)
        stamps = self._row_stamps.get(_unwrap(var))
        if stamps is None and self._creation.is_table_var(var) and not tf.executing_eagerly():
            self._traced_without_stamps[_unwrap(var)] = True
        if not self._extended.in_sync_step():
            return self._stamped(stock_update(var, fn, args, kwargs, group), stamps, args)
        table_owner = self._creation.table_owner(var)
        if table_owner is not None and not self._sync_embeddings():
            return self._stamped(stock_update(var, fn, args, kwargs, group), stamps, args)
        # Every sync update to a PS variable (a table shard, its slots) is
        # applied by one worker only: all workers hold the same reduced
        # gradient, and applying it twice would be wrong.
        owner = 0 if table_owner is None else table_owner

        def apply():
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            with replicated.inside_variable_update():
                result = stock_update(var, fn, args, kwargs, True)
            if stamps is not None:  # A write: `done` below waits for it too.
                stamps.mark(self._gradient_of(args))
            after = self._after_update.get(_unwrap(var))
            if after is not None:
                updated = [op for op in graph.get_operations()[first:] if not op.outputs]
                with tf.control_dependencies(
                        updated + [r for r in tf.nest.flatten(result) if r is not None]):
                    after()
            # `done` must depend on the writes themselves: the end-of-step
            # barrier waits for it, and a write it does not wait for can land
            # after another worker's next-step lookup. Keras's new optimizers
            # return None from their update step (their slot and table writes
            # are only ops in the graph), so depend on the ops the update
            # created that have no outputs: its writes (variable assigns,
            # scatters, resource applies; none of them has an output) and any
            # group of them. Only those, not every op: each control edge from
            # a PS op is a cross-device transfer per step.
            writes = [op for op in graph.get_operations()[first:] if not op.outputs]
            with tf.control_dependencies(
                    writes + [r for r in tf.nest.flatten(result) if r is not None]):
                return tf.constant(True)

        if self._extended.tracing_worker_index is not None and table_owner is not None:
            # One trace per update role (see `update_role`): the table
            # update exists only in the owner's graph. No tf.cond: a cond
            # with its branch on a PS costs every worker a predicate, a pivot
            # and each (dead) input sent to the PS, for every shard and step
            # (benchmarks/README.md: 8.1k -> 14.7k examples/s, 26 tables).
            done = apply() if self._extended.tracing_worker_index == owner else tf.constant(False)
        else:
            # One trace shared by several workers (a concrete function was
            # scheduled, or a PS variable that is not a table: roles only
            # describe table shards).
            worker = replicated.current_worker_index()
            done = tf.cond(tf.equal(worker, owner), apply, lambda: tf.constant(False))
        if table_owner is not None:
            # Also on non-owners: the end-of-step barrier is a collective that
            # every worker must join once the step has any table update.
            replicated.add_pending_table_update(done)
        if group:
            return done
        return [done]

    def _gradient_of(self, args):
        """The gradient an optimizer's update of one variable was given (its first argument)."""
        args = tf_objects.single_value_selector(self._extended)(args)
        return args[0] if args else None

    def _stamped(self, result, stamps, args):
        """`result` of an update outside a sync step, after stamping the rows it touched."""
        if stamps is not None:
            stamps.mark(self._gradient_of(args))
        return result

    def on_read_update(self, var, delta, apply, read_value, subtract=False):
        """An in-step update of an ON_READ replicated variable (see `on_read_updates`)."""
        if not self._extended.in_sync_step():
            return apply(delta)
        return self._extended.on_read_updates.update(var, delta, apply, read_value,
                                                     subtract=subtract)

    def on_read_use(self, var):
        """A traced use of an ON_READ replicated variable: its pending update first."""
        if self._extended.in_sync_step():
            self._extended.on_read_updates.flush_if_pending(var)

    def end_of_step(self, pending_updates):
        """Ops every worker runs after all of a step's updates.

        In ``"sync"`` embedding mode, a collective barrier that depends on the
        step's gated table updates (so nobody reads a table before every
        update landed); then the commit counter.
        """
        deps = list(pending_updates)
        if self._sync_embeddings() and deps:
            deps = [self._extended.collective_group.barrier(deps)]
        committed_steps = self._extended.committed_steps
        if committed_steps is None:
            return deps
        with tf.control_dependencies(deps):
            return [committed_steps.assign_add(1, read_value=False)]
