"""Variable creation under the hybrid strategy: where each variable goes.

`HybridExtended._create_variable` (what TF calls for every variable made in
the strategy's scope) hands the decision here: an embedding table is sharded
over the PS tasks (interleaved, contiguous, or into a stack), an optimizer
slot follows its variable, any other variable becomes a `ReplicatedVariable`
on the workers (or stays on a PS with ``dense_placement="ps"``). This module
also keeps what that placement produced and other parts read: the placement
records (the report), and which worker owns the sync updates of each table
shard (its PS index mod the workers; see `update_role`).
"""

import contextlib
import dataclasses
import functools
from typing import List, Optional

import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.tf_internal import ps_values
from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.cluster.devices import ps_device
from tf_psplugin.sync import outside_writes
from tf_psplugin.sync import replicated
from tf_psplugin.tables import half_precision
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables import shard_init
from tf_psplugin.tables import sharded
from tf_psplugin.tables import stacking

# The coordinator's own device (it joins the cluster as job "chief").
CHIEF_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"


class VariableCreation:
    """Where each variable made in the strategy's scope goes, and what that produced.

    One per `HybridExtended` (its `creation`): TF calls the Extended's
    `_create_variable`, which hands the variable here. Keeps the placement
    records (`strategy.placement_report()`), the table stacks
    (``stack_tables=True``) and, for every table shard, view and table slot,
    the worker that applies its sync updates.

    Example (what `HybridExtended._create_variable` does):

    ```python
    creation = VariableCreation(extended, num_workers=2, num_ps=2)
    var = creation.create_variable(next_creator, stock_create, **kwargs)
    creation.table_owner(var)  # 0 or 1 for a table shard, else None
    ```

    Args:
        extended: The `HybridExtended` (its configuration: placement,
            partitioner, modes; its stock creation hooks; its `updates`).
        num_workers: Workers in the cluster.
        num_ps: PS tasks in the cluster.
    """

    def __init__(self, extended, num_workers: int, num_ps: int):
        self._extended = extended
        self._num_workers = num_workers
        self._num_ps = num_ps
        self.placement_records: List[placement_lib.PlacementRecord] = []
        # A stacked table -> its index in placement_records (for `_restacked`).
        self._record_of_table: IdentityMap[int] = IdentityMap()
        # Shard variable, view or slot -> owning worker; an entry dies with its variable.
        self._table_shard_owner: IdentityMap[int] = IdentityMap()
        self._creating_table = False
        self._creating_plain = False
        self._creating_internal = False
        # Set by `enable_table_stacking` (the strategy's stack_tables=True).
        self.table_stacks: Optional[stacking.TableStacks] = None

    def enable_table_stacking(self) -> None:
        """Stores eligible tables in stacks from now on (see `tables/stacking.py`)."""
        if self.table_stacks is None:
            self.table_stacks = stacking.TableStacks(
                shard_devices=self.table_shard_device, on_restack=self._restacked)
            # Each table's gradient (Keras sees its own rows) merged into one
            # apply per stack shard.
            patches.install("keras_stacked_updates")

    def _restacked(self, table, stack_name: str, unstacked: str = "") -> None:
        """A table moved to another stack before it was made (`TableStacks.separate`).

        An empty `stack_name`: the table is alone, with storage of its own,
        for the reason `unstacked` (the placement report shows it).
        """
        index = self._record_of_table.get(table)
        if index is not None:
            record = self.placement_records[index]
            self.placement_records[index] = dataclasses.replace(
                record, stack=stack_name, unstacked="" if stack_name else unstacked)

    @property
    def creates_unwrapped(self) -> bool:
        """Whether the variable being made now gets no PSS wrapper (`_create_var_creator`).

        Table shards are plain variables on their PS (no aggregation
        wrapper): updates to them are routed by `HybridExtended._update`.
        """
        return self._creating_table or self._creating_plain

    def create_variable(self, next_creator, stock_create, **kwargs):
        """`HybridExtended._create_variable`: a table, a slot, a replica or a PS variable.

        Args:
            next_creator: The next variable creator (TF's creator stack).
            stock_create: Stock `ParameterServerStrategyV2Extended._create_variable`
                (bound), for what stays stock: per-worker variables, slots of
                PS variables, contiguous tables, dense variables in ``"ps"`` mode.
            **kwargs: The variable's arguments.

        Returns:
            The variable.

        Raises:
            StrategyError: a variable made inside `embedding_table_scope()`
                that cannot be sharded.
        """
        if kwargs.get("per_worker_variable", False):
            return stock_create(next_creator, **kwargs)
        if self._creating_plain:
            return next_creator(**kwargs)
        # A legacy optimizer's slot of a layer's AutoCastVariable (mixed
        # precision) follows the variable inside it.
        colocate_with = tf_objects.autocast_inner(kwargs.get("colocate_with", None))
        if isinstance(colocate_with, replicated.ReplicatedVariable):
            kwargs.pop("colocate_with")
            return self._create_replicated(next_creator, kind="dense-slot", **kwargs)
        if colocate_with is not None:
            if (half_precision.is_half(getattr(colocate_with, "dtype", None))
                    and self.is_table_var(colocate_with)):
                # A half-precision table's slots are float32 (half_precision).
                kwargs = half_precision.slot_kwargs(kwargs)
            if self.is_table_var(colocate_with):
                # A constant slot (Adagrad's accumulator, Adam's moments) is
                # filled on its PS, not shipped from the chief (shard_init).
                kwargs = shard_init.constant_fill_on_device(kwargs)
            var = stock_create(next_creator, **kwargs)
            if self.table_stacks is not None:
                # An optimizer slot of a stack: no table joins that stack now
                # (nor is it split while the slot lives: `Stack.held_by`).
                self.table_stacks.seal(_unwrap(colocate_with), slot=var)
            kind = "table-slot" if _unwrap(colocate_with) in self._table_shard_owner else "ps"
            if kind == "table-slot":
                self._own(var, self._table_shard_owner[_unwrap(colocate_with)])
            else:
                outside_writes.watch_levels(var)
            self._record(var, kind)
            return var
        name = kwargs.get("name")
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        dtype_size = dtype.size if dtype is not None else 4
        if placement_lib.in_embedding_table_scope() and (
                shape is None or not shape.rank or shape[0] is None):
            raise StrategyError(
                f"variable {name!r} with shape {shape} was created inside "
                "embedding_table_scope(), but only variables of rank >= 1 with a known first "
                "dimension can be sharded across PS tasks. Fix: create scalars and "
                "unknown-shape variables outside embedding_table_scope(), or pass an explicit "
                "`shape=` with the number of rows.")
        placement = self._extended.placement
        if shape is not None and shape.rank and shape.rank >= 1 and placement.is_table(
                name, shape.as_list(), dtype_size):
            return self._create_table(next_creator, stock_create, **kwargs)
        if self._extended.dense_allreduce:
            return self._create_replicated(next_creator, kind="dense",
                                           record=not self._creating_internal, **kwargs)
        var = stock_create(next_creator, **kwargs)
        outside_writes.watch_levels(var)
        self._record(var, "ps")
        return var

    def _create_replicated(self, next_creator, kind: str, record: bool = True, **kwargs):
        kwargs.pop("caching_device", None)
        # The primary copy belongs on the chief even when the variable is
        # created while a step is traced under a worker's device (optimizer
        # slots are created in the first trace; see `tracing_worker_index`).
        with tf.device(CHIEF_DEVICE):
            extended, updates = self._extended, self._extended.updates
            var = replicated.ReplicatedVariable(
                tf_objects.extended_container_strategy(extended), next_creator,
                end_of_step_fn=updates.end_of_step, update_reduce_fn=updates.on_read_update,
                graph_use_fn=updates.on_read_use, **kwargs)
        if record:
            self._record(var, kind, devices=var.worker_devices())
        return var

    def table_shard_device(self, shard: int) -> str:
        """Shard `shard` of an interleaved table (or stack): round-robin from ps:0.

        Every table with n shards has its shard s on the same PS, which fused
        lookups, stacks and DynamicEmbedding's admission rely on.
        """
        return ps_device(shard % self._num_ps)

    def _create_table(self, next_creator, stock_create, **kwargs):
        """Creates an embedding table sharded over the PS tasks.

        One shard per PS task, or as many as `table_partitioner` says
        (`placement.table_shard_count`).
        """
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        stored = half_precision.storage_dtype(dtype, self._extended.table_dtype)
        if stored is not None:  # HybridOptions.table_dtype: float32 rows stored as half.
            kwargs = dict(kwargs, dtype=stored)
            if kwargs.get("initial_value") is not None:
                kwargs["initial_value"] = half_precision.cast_initial_value(
                    kwargs["initial_value"], stored)
            dtype = stored
        num_shards = placement_lib.table_shard_count(
            shape, dtype if dtype is not None else tf.float32, self._num_ps,
            partitioner=self._extended.table_partitioner, name=kwargs.get("name"))
        scheme = self._extended.placement.sharding
        unstacked = ""
        if self.table_stacks is not None:
            if scheme != placement_lib.SHARDING_INTERLEAVED:
                unstacked = f"{scheme} sharding"
            elif kwargs.get("initial_value") is None:
                unstacked = "no initial value"
            else:
                unstacked = self.table_stacks.why_not(shape, dtype, num_shards, kwargs) or ""
        if num_shards < 2:
            var = tf_objects.round_robin_creator(self._extended)(
                next_creator, **kwargs)
            self._own(var, self._table_shard_owner_of(var))
            self._record(var, "table", unstacked=unstacked)
            return var
        self._creating_table = True
        try:
            if (scheme == placement_lib.SHARDING_INTERLEAVED and self.table_stacks is not None
                    and kwargs.get("initial_value") is not None
                    and self.table_stacks.eligible(shape, dtype, num_shards, kwargs)):
                var = self.table_stacks.add(
                    kwargs.get("name"), shape, dtype, num_shards,
                    shard_values=functools.partial(
                        sharded.shard_value_fn, kwargs.get("initial_value"), shape, dtype,
                        num_shards=num_shards, name=kwargs.get("name")),
                    creator=functools.partial(shard_init.create_shard, next_creator, kwargs),
                    on_replace=self._replace_table_shard)
            elif scheme == placement_lib.SHARDING_INTERLEAVED:
                var = sharded.create_interleaved(
                    name=kwargs.get("name"), shape=shape, dtype=dtype,
                    initial_value=kwargs.get("initial_value"), num_shards=num_shards,
                    device_fn=self.table_shard_device,
                    creator=functools.partial(shard_init.create_shard, next_creator, kwargs))
            else:
                # Stock partitions it, told the shard count for this table only.
                tf_objects.set_variable_partitioner(
                    self._extended, sharded_variable.FixedShardsPartitioner(num_shards))
                try:
                    var = stock_create(next_creator, **kwargs)
                finally:
                    tf_objects.set_variable_partitioner(self._extended, None)
        finally:
            self._creating_table = False
        if not isinstance(var, stacking.StackedTable):
            # (A stack's shards are registered when they get their variables:
            # `_replace_table_shard`.)
            for shard in var.variables:
                self._own(shard, self._table_shard_owner_of(shard))
        else:
            # Its views: what Keras lists, reduces and (weight decay) updates.
            for view in var.views:
                self._table_shard_owner[view] = self._table_shard_owner_of(view)
        # A contiguous table (stock's ShardedVariable) has no stack.
        stack = var.stack if isinstance(var, sharded.InterleavedShardedVariable) else None
        self._record(var, "table", devices=[v.device for v in var.variables],
                     stack=stack.name if stack is not None else "", unstacked=unstacked)
        if isinstance(var, stacking.StackedTable):
            self._record_of_table[var] = len(self.placement_records) - 1
        return var

    def _replace_table_shard(self, old, new) -> None:
        """A stack shard got its variable, or a bigger one than `old` (tables/stacking.py)."""
        if old is not None:
            self._table_shard_owner.pop(old, None)
        if new is not None:  # (None: the stack was split and its variable freed.)
            self._own(new, self._table_shard_owner_of(new))

    def _own(self, var, owner: int) -> None:
        """Records `owner` as the worker updating table variable `var` (a shard, a stack's
        variable or a table slot), and numbers its writes outside a step (`outside_writes`).
        """
        self._table_shard_owner[_unwrap(var)] = owner
        outside_writes.watch_levels(var)

    def _table_shard_owner_of(self, var) -> int:
        """The worker that applies sync updates to a table shard: its PS index mod workers.

        With as many workers as PS tasks, worker i updates exactly the shards
        on ps:i; with more workers than PS tasks the extra workers update
        nothing and share one trace of the step (see `update_role`).
        """
        return self.owner_of_ps(tf.DeviceSpec.from_string(_unwrap(var).device or "").task or 0)

    def owner_of_ps(self, ps_index: int) -> int:
        """The worker that applies sync updates to the table shards on ps:`ps_index`."""
        return int(ps_index) % max(self._num_workers, 1)

    def update_role(self, worker_index: int) -> tuple:
        """The PS tasks whose table shards `worker_index` updates in sync mode.

        Workers with equal roles run the same trace of a synchronous step,
        so a step is traced at most min(workers, PS) + 1 times.
        """
        if self._extended.embedding_updates != "sync":
            return ()
        return tuple(p for p in range(self._num_ps) if self.owner_of_ps(p) == worker_index)

    def create_plain_variable(self, device: str, **kwargs) -> tf.Variable:
        """A plain variable on `device`, even in this strategy's scope (not a table or replica)."""
        self._creating_plain = True
        try:
            with tf.device(device):
                return tf.Variable(**kwargs)
        finally:
            self._creating_plain = False

    def _record(self, var, kind: str, devices=None, stack: str = "", unstacked: str = ""):
        try:
            shape = tuple(int(d) if d is not None else -1 for d in var.shape.as_list())
        except (ValueError, AttributeError):
            shape = ()
        dtype = tf.as_dtype(var.dtype)
        n = 1
        for d in shape:
            n *= max(d, 0)
        self.placement_records.append(placement_lib.PlacementRecord(
            name=getattr(var, "name", "?"), kind=kind, shape=shape, dtype=dtype.name,
            num_bytes=n * dtype.size, devices=tuple(devices or [getattr(var, "device", "")]),
            stack=stack, unstacked="" if stack else unstacked))

    def is_table_var(self, var) -> bool:
        """Whether `var` (or the variable it wraps) is a table shard, a view or a table slot."""
        return _unwrap(var) in self._table_shard_owner

    def table_owner(self, var) -> Optional[int]:
        """The worker that applies `var`'s sync updates: a table shard's (or slot's), else None."""
        return self._table_shard_owner.get(_unwrap(var))

    @contextlib.contextmanager
    def internal_variables(self):
        """Variables made inside are the plugin's own: replicated, but not recorded."""
        self._creating_internal = True
        try:
            yield
        finally:
            self._creating_internal = False


def _unwrap(var):
    """The underlying resource variable of PSS wrappers (Aggregating/Caching)."""
    seen = 0
    while seen < 4:
        seen += 1
        if isinstance(var, ps_values.AggregatingVariable):
            var = var.get()
        elif isinstance(var, ps_values.CachingVariable):
            var = tf_objects.aggregating_inner(var)
        else:
            break
    return var
