"""Table stacking: same-width embedding tables stored as one variable per PS.

Why this module exists: a CTR model has one `tf.keras.layers.Embedding` per
feature, and every table costs its own ops in every step on every PS (a
gather per worker, a sparse optimizer apply, a duplicate-row sum) and on
every worker (id routing, gradient plumbing). benchmarks/README.md
("Findings") measured that cost, not the transfers, as what makes 26 small
tables 1.5x slower than one table of the same rows. Stacking stores the
tables of one row width, dtype and PS count as ONE variable per PS (a
"stack"); each table keeps its own logical object, a `StackedTable`, which is
its rows inside the stack.

How no Keras or TF API can tell (issue 29):

* **Keras sees each table's own rows** (`TableView`): a stacked table
  lists, as its weights, one view per stack shard -- named, shaped and
  holding the rows an unstacked table's shard would (``<layer>/embeddings/
  part_<s>``, ``[rows, D]``). `layer.weights`, `get_weights`/`set_weights`,
  `count_params`, `trainable_variables`, `trainable=False`, regularizers
  and `tf.nest` see the table alone; the stack's shards appear nowhere.
* **Each table gets its own gradient**: a view's reads are gathers of the
  stack shard through a custom gradient whose input is the view's own
  handle tensor, so the tape gives each view an `IndexedSlices` of its own
  rows. A functional model's lookups of one stack are still one gather per
  PS (`lookups.lookup_tables`), with the gradient split per view.
* **One apply per stack shard** (`stacked_updates`): the views' gradients
  are merged into one gradient of the stack shard, with one set of slots;
  where one apply would not equal per-table applies, it writes back the
  rows of the tables without a gradient, or applies each table's view on
  its own.
* **Stacks per model**: a model's first traced call splits the stacks it
  uses -- not yet used by any traced function nor given slots -- into its
  trainable tables, its frozen ones and everything else
  (`separate_by_model`), so a second model built in the same scope (a
  target network, a teacher) or a frozen table never shares a stack with
  the tables an optimizer trains. A restore and `build_optimizer_slots`
  make slots before any call is traced: they split first the same way
  (`fusion.separate_before_slots`), so a restarted job has the stacks, and
  the slots, of its fresh run.
* **Everything that names a table sees the `StackedTable`**: lookups
  (`tf.nn.embedding_lookup` and the other APIs `tables/lookups.py` dispatches),
  reads, `assign`, checkpoints (each table saved under its own key, in
  logical row order: it restores into unstacked tables, any PS count and a
  single process), the placement report and export. An id outside
  ``[0, V)`` fails as on an unstacked table.
* **Growth, not planning**: a layer builds its table alone, before the next
  layer exists. The first table of a group opens a stack; each later one is
  appended to it. The stack's shards get their variables, of the full
  size, when first needed (a lookup, a read, a slot, a checkpoint), so
  each PS allocates a stack once. A table made after a slot exists for a
  stack or a traced function used it starts a new stack.

On by default (the strategy's ``stack_tables=True``; ``stack_tables=False``
is the way out): docs/api.md lists what a program can still tell (a
model's optimizer other than Keras's known ones gets its tables unstacked,
a legacy optimizer's slots of a stack are its variables).

Which tables stack (`eligible`): 2-D float tables of a strategy with
``stack_tables=True``, made eagerly (Keras builds layers eagerly),
interleaved over 2 or more PS tasks, trainable, with no constraint, of at
most `MAX_TABLE_BYTES`; a stack stops growing at `MAX_STACK_BYTES`. Not
stacked: `DynamicEmbedding`'s tables (it addresses its own rows), tables
made in graph mode (the Estimator path), contiguous sharding.

Private TF API: a stack shard is a `ps_values.AggregatingVariable` (TF's
forwarding variable, which stock PSS wraps PS variables in) whose inner
variable (`_v`, and the inner's `_aggregating_container`) is set when the
stack is materialized, and which answers `_get_save_slice_info` for
`ShardedVariable`; there is no public variable whose storage is made
later or replaced.
"""

import functools
import itertools
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.scopes import ThreadScope
from tf_psplugin._internal.tf_internal import (
    ps_values, resource_variable_ops, save_context, sharded_variable, tf_dispatch)
from tf_psplugin.sync import outside_writes
from tf_psplugin.tables import stack_rows
from tf_psplugin.tables import shard_init
from tf_psplugin.tables.layout import shard_rows
from tf_psplugin.tables.placement import SHARDING_INTERLEAVED
from tf_psplugin.tables.sharded import InterleavedShardedVariable

__all__ = ["StackedTable", "TableStacks", "TableView", "MAX_TABLE_BYTES", "MAX_STACK_BYTES",
           "unstacked"]

# A table larger than this is not stacked: its own ops are a small share of a
# step next to its rows, and its initial rows would be held twice on its PS
# while the stack is made (pending rows, then the variable).
MAX_TABLE_BYTES = 32 << 20
# A stack stops growing here: a table joining a stack whose variables exist
# copies them, and the pending rows of a stack not yet made are held twice.
MAX_STACK_BYTES = 1 << 30

_UNSTACKED = ThreadScope()
# A table's logical write, per stack shard: a scatter into its rows only.
_SCATTER_OF = {"assign": "scatter_update", "assign_add": "scatter_add",
               "assign_sub": "scatter_sub"}


def unstacked():
    """Tables created inside this scope are never stacked (their owner addresses rows).

    Returns:
        A context manager.
    """
    return _UNSTACKED.scope()


class StackedTable(InterleavedShardedVariable):
    """One logical table stored inside a stack: interleaved rows at an offset.

    Logical row ``i`` lives on stack shard ``i % n`` at row
    ``row_offsets[i % n] + i // n``. It reads, looks up, assigns and
    checkpoints like the `InterleavedShardedVariable` it would otherwise be
    (its checkpoint is the same tensor under the same key); its `variables`
    are the stack's shard variables, shared with the other tables of the
    stack.

    Args:
        variables: The stack's shard variables, one per PS.
        row_offsets: Where this table's rows start in each shard.
        num_rows: The table's logical row count.
        name: The table's name.
        stack: The `_Stack` it belongs to (None for a copy, e.g. of slots).
    """

    def __init__(self, variables, row_offsets: Sequence[int], num_rows: int,
                 name: str = "StackedTable", stack=None):
        # Not InterleavedShardedVariable.__init__: its check is for shards
        # that hold one whole table. ShardedVariable's sets the shards, dtype
        # and, from the stack's shape, `_shape`, fixed below.
        sharded_variable.ShardedVariable.__init__(self, list(variables), name=name)
        n = len(self._variables)
        self._row_offsets = tuple(int(o) for o in row_offsets)
        self._shard_counts = tuple(shard_rows(int(num_rows), n, SHARDING_INTERLEAVED))
        if len(self._row_offsets) != n:
            raise ValueError(f"StackedTable {name!r}: {len(self._row_offsets)} row offsets for "
                             f"{n} shards; pass one per shard.")
        self._shape = tf.TensorShape([int(num_rows)] + self._variables[0].shape[1:].as_list())
        self._stack = stack
        # What Keras lists as the layer's weights (`__iter__`): this table's
        # own rows of each stack shard, one `TableView` per shard. A copy
        # (e.g. a slot's view of the stack's slots) has none.
        self._views = None
        if stack is not None:
            # Named as the shards of an unstacked table made here would be
            # ("<layer>/embeddings/part_<s>"): the variable name in the
            # current name scope.
            self._view_prefix = _scoped_name(name)
            self._views = [TableView(self, s) for s in range(n)]
            for view in self._views:
                tf_objects.set_sharded_container(view, self)
        # ShardedVariable made a saving placeholder of the stack's shape; the
        # table saves (tf.saved_model.save) as its own [V, D].
        self._saving_variable = resource_variable_ops.UninitializedVariable(
            shape=self._shape, dtype=self._dtype, name=name,
            trainable=self._variables[0].trainable,
            synchronization=tf.VariableSynchronization.NONE,
            aggregation=tf.VariableAggregation.NONE)
        # What InterleavedShardedVariable.__init__ does: without it, v1 safe
        # lookups (feature columns) of a process whose first table is
        # stacked would go to TF's ShardedVariable dispatcher, unshifted.
        patches.install("safe_embedding_lookup_v1")

    @property
    def stack(self):
        """The stack this table is in (None for a copy, e.g. a slot's view)."""
        return self._stack

    @property
    def display_name(self) -> str:
        """The table's name with its layer's scope ("item/embeddings"), for messages."""
        return getattr(self, "_view_prefix", None) or self.name

    @property
    def views(self) -> Optional[List["TableView"]]:
        """This table's rows of each stack shard, as Keras lists them (None for a copy)."""
        return self._views

    def rebind(self, stack, row_offsets) -> None:
        """Moves this table into `stack` at `row_offsets` (`TableStacks.separate`)."""
        self._variables = list(stack.shards)
        for shard in self._variables:
            tf_objects.set_sharded_container(shard, self)
        self._row_offsets = tuple(int(o) for o in row_offsets)
        self._stack = stack
        stack.tables.add(self)

    def __iter__(self):
        # Keras lists a sharded variable's weights by iterating it (`Layer.
        # add_weight`, its regularizers): this table's own `[rows, D]` views,
        # never the stack's shards, which hold other tables' rows too.
        return iter(self._views if self._views is not None else self._variables)

    @property
    def shares_shards(self) -> bool:
        """True: the stack's shards hold the other tables' rows too."""
        return True

    @property
    def row_offsets(self) -> tuple:
        """Row of each stack shard where this table's rows start."""
        return self._row_offsets

    @property
    def shard_counts(self) -> tuple:
        """How many of this table's rows each stack shard holds (from `row_offsets` on)."""
        return self._shard_counts

    @property
    def _unique_id(self):
        # Every table of a stack shares shard 0: the id must name the table.
        shard_id = tf_objects.variable_unique_id(self._variables[0])
        return f"{shard_id}_stacked_{self._row_offsets[0]}"

    @property
    def _type_spec(self):
        return StackedTableSpec(
            self._row_offsets, int(self._shape[0]), self.name,
            *(resource_variable_ops.VariableSpec(v.shape, v.dtype) for v in self._variables))

    def with_variables(self, variables, name: Optional[str] = None) -> "StackedTable":
        """The same rows of other shard variables (e.g. an optimizer's slots of the stack)."""
        return StackedTable(variables, self._row_offsets, int(self._shape[0]),
                            name=name or self.name)

    # -- layout ----------------------------------------------------------------

    def _physical_ids(self, ids):
        """Logical ids -> ids whose "mod" lookup on the stack shards finds this table's rows.

        Id ``i`` becomes ``i + n * row_offsets[i % n]``: same shard
        (``i % n``), row ``i // n + row_offsets[i % n]``. Ids outside
        ``[0, V)`` stay invalid, as they are for an unstacked table: a
        negative id stays as it is (the safe lookups drop it as "missing",
        the others fail on it) and an id ``>= V`` becomes the dtype's maximum,
        a row no stack has, so the shard's gather fails instead of reading
        (or a scatter writing) the next table's row.
        """
        ids = tf.convert_to_tensor(ids)
        return stack_rows.shift_valid(ids, ids + len(self._variables) * tf.gather(
            tf.constant(self._row_offsets, dtype=ids.dtype), ids % len(self._variables)),
            int(self._shape[0]))

    def _shape_only_lookup(self, ids, max_norm=None):
        """Zeros of the rows' shape while Keras infers an output shape before the stack exists.

        Keras calls each layer of a functional model as it is built, in a
        scratch graph named ``<layer>_scratch_graph`` (Keras 2.15 and
        tf-keras 2.21, `Layer._infer_output_signature` and the functional
        construction call) whose values are never run: a real lookup there
        would make the stack's variables before the next table joins, and
        appending that table would then copy them (and it would count as a
        traced use, after which the stack is never split: `TableStacks.
        separate`). Anywhere else, None.
        """
        del max_norm
        stack = self._stack
        if stack is None:
            return None
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not graph.name.endswith("_scratch_graph"):
            return None
        ids = tf.convert_to_tensor(ids)
        return tf.zeros(tf.concat([tf.shape(ids), [stack.width]], axis=0), dtype=self.dtype)

    def _logical_value(self) -> tf.Tensor:
        if len(self.variables) == 1:  # tf.saved_model.save's one saving variable.
            return tf.convert_to_tensor(self.variables[0])
        return self._read_rows(0, int(self._shape[0]))

    def sparse_read(self, indices, name=None):
        """Gathers logical rows ``indices``: through the views, for the tape (a copy: the shards)."""
        if self._views is None:
            return super().sparse_read(indices, name=name)
        return tf.compat.v1.nn.embedding_lookup(self._views, indices, "mod", name=name)

    def _write_shard(self, s: int, part, method: str, use_locking) -> None:
        """Writes this table's rows of stack shard ``s`` only (a scatter, not the whole shard)."""
        del use_locking
        start = self._row_offsets[s]
        rows = tf.range(start, start + self._shard_counts[s], dtype=tf.int64)
        getattr(self._variables[s], _SCATTER_OF[method])(tf.IndexedSlices(part, rows))


def _scoped_name(name: str) -> str:
    """`name` in the current name scope, as a variable made here would be named."""
    base = (name or "table").split(":")[0]
    try:
        with tf.name_scope(base) as scope:
            return scope.rstrip("/") or base
    except ValueError:  # Not a valid scope name: the name as it is.
        return base


_VIEW_IDS = itertools.count()
_VIEW_HANDLES_ATTR = "_tf_psplugin_table_view_handles"


class TableView(tf.Variable):
    """One stacked table's rows of one stack shard, as Keras and the tape see them.

    It is what an unstacked interleaved table's shard ``s`` would be -- a
    ``[rows, D]`` variable named ``<table>/part_<s>``, holding logical rows
    ``s, s + n, ...`` -- but its storage is rows ``[offset, offset + rows)``
    of the stack's shard ``s``. Keras lists it as the layer's weight, so
    `layer.weights`, `get_weights`/`set_weights`, `count_params`,
    `trainable_variables`, regularizers and `trainable=False` see the table
    alone.

    Reads are gathers of the stack shard whose gradient the tape gives to
    the view: each view has its own handle tensor (an identity of the
    stack shard's handle, one per traced function), which the read's custom
    gradient takes as input and the tape watches. The gradient is an
    `IndexedSlices` over the view's own rows, exactly what an unstacked
    shard gets. Writes scatter into the view's rows. Optimizers never apply
    to a view: `stacked_updates` merges the views' gradients into one apply
    per stack shard.

    Args:
        table: The `StackedTable`.
        index: The stack shard.
    """

    # pylint: disable=super-init-not-called,missing-function-docstring
    def __init__(self, table: "StackedTable", index: int):
        # Not tf.Variable.__init__: there is no storage of its own.
        self._table = table
        self._index = index
        self._id = next(_VIEW_IDS)
        self._eager_handle = (None, None)  # (stack variable, its identity)

    # -- what it is ------------------------------------------------------------

    @property
    def table(self) -> "StackedTable":
        return self._table

    @property
    def index(self) -> int:
        return self._index

    @property
    def stack(self) -> "_Stack":
        """The stack the view's table is in."""
        return self._table.stack

    @property
    def stack_shard(self):
        """The stack's shard variable whose rows this view is."""
        return tf_objects.sharded_shards(self._table)[self._index]

    @property
    def offset(self) -> int:
        return self._table.row_offsets[self._index]

    @property
    def num_rows(self) -> int:
        return self._table.shard_counts[self._index]

    def _should_act_as_resource_variable(self):
        """Passes `resource_variable_ops.is_resource_variable` (the tape asks)."""

    @property
    def name(self):
        return f"{self._shared_name}:0"

    @property
    def _shared_name(self):
        return f"{self._table._view_prefix}/part_{self._index}"  # pylint: disable=protected-access

    @property
    def _unique_id(self):
        return f"tf_psplugin_table_view_{self._id}"

    @property
    def shape(self):
        return tf.TensorShape([self.num_rows]).concatenate(self._table.shape[1:])

    def get_shape(self):
        return self.shape

    @property
    def dtype(self):
        return self._table.dtype

    @property
    def device(self):
        return self.stack_shard.device

    @property
    def trainable(self):
        return True

    @property
    def synchronization(self):
        return tf.VariableSynchronization.AUTO

    @property
    def aggregation(self):
        return tf.VariableAggregation.NONE

    @property
    def constraint(self):
        return None  # A table with a constraint is never stacked (`TableStacks.eligible`).

    @property
    def _distribute_strategy(self):
        return tf_objects.variable_distribute_strategy(self.stack_shard)

    @property
    def graph(self):
        return tf_objects.aggregating_inner(self.stack_shard).graph

    @property
    def _in_graph_mode(self):
        return False

    def __repr__(self):
        return (f"<TableView {self._shared_name!r} shape={self.shape} dtype={self.dtype.name} "
                f"rows {self.offset}.. of {self.stack_shard.name}>")

    # -- the handle the tape watches -------------------------------------------

    @property
    def handle(self):
        """This view's own handle tensor: an identity of the stack shard's handle.

        The tape keys gradients by tensor, so each view needs its own; it is
        never read as a variable (a read of it would return the whole stack
        shard). Eagerly one per stack variable; in a traced function one per
        graph, made on the stack shard's device so that passing it costs no
        transfer.
        """
        inner = tf_objects.aggregating_inner(self.stack_shard)
        if tf.executing_eagerly():
            var, handle = self._eager_handle
            if var is not inner:
                with tf.device(inner.device):
                    handle = tf.identity(inner.handle)
                self._eager_handle = (inner, handle)
            return handle
        graph = tf.compat.v1.get_default_graph()
        cache = getattr(graph, _VIEW_HANDLES_ATTR, None)
        if cache is None:
            cache = {}
            setattr(graph, _VIEW_HANDLES_ATTR, cache)
        entry = cache.get(self._id)
        if entry is None or entry[0] is not inner:
            # In this graph itself (a nested graph captures the stack's
            # variable, as for any variable, never another graph's tensor:
            # tf.saved_model.save refuses those).
            with tf.control_dependencies(None), tf.device(inner.device):
                entry = (inner, tf.identity(inner.handle, name="table_view_handle"))
            cache[self._id] = entry
        return entry[1]

    # -- reads -----------------------------------------------------------------

    def _physical(self, local_ids):
        """(local ids as an integer tensor, their rows in the stack shard; outside: invalid)."""
        local_ids = tf.convert_to_tensor(local_ids)
        if not local_ids.dtype.is_integer:
            local_ids = tf.cast(local_ids, tf.int64)
        shifted = local_ids + tf.cast(self.offset, local_ids.dtype)
        return local_ids, stack_rows.shift_valid(local_ids, shifted, self.num_rows)

    def _read(self, local_ids: tf.Tensor) -> tf.Tensor:
        """Rows `local_ids` (1-D, of this view) of the stack shard; gradient to this view."""
        if save_context.in_save_context():
            # tf.saved_model.save: the table is saved as its one [V, D]
            # saving variable (as TF saves any ShardedVariable), restored from
            # the table's checkpoint value on load; the stack is not saved.
            table = self._table
            n = len(tf_objects.sharded_shards(table))
            logical = tf.cast(local_ids, tf.int64) * n + self._index
            return tf.gather(tf_objects.sharded_saving_variable(table), logical)
        stack_rows.watch(self)  # Every active tape now watches `self.handle`.
        inner = tf_objects.aggregating_inner(self.stack_shard)
        local_ids, physical = self._physical(local_ids)
        dense_shape = tf.constant(self.shape.as_list(), tf.int32)
        dtype = self.dtype

        @tf.custom_gradient
        def read(handle):
            del handle  # Only the gradient's input: the rows come from the stack.
            rows = tf.raw_ops.ResourceGather(resource=inner.handle, indices=physical,
                                             dtype=dtype)

            def grad(dy):
                return tf.IndexedSlices(dy, local_ids, dense_shape)

            return rows, grad

        with tf.device(inner.device):
            return read(self.handle)

    def sparse_read(self, indices, name=None):
        del name
        indices = tf.convert_to_tensor(indices)
        flat = tf.reshape(indices, [-1])
        rows = self._read(flat)
        return tf.reshape(rows, tf.concat([tf.shape(indices), tf.shape(rows)[1:]], axis=0))

    def value(self):
        return self._read(tf.range(self.num_rows, dtype=tf.int64))

    def read_value(self):
        return self.value()

    def value_as(self, dtype=None) -> tf.Tensor:
        """The view's rows as a tensor (cast to `dtype` if given): what conversion gives."""
        value = self.value()
        return value if dtype is None or dtype == value.dtype else tf.cast(value, dtype)

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        del name, as_ref
        return self.value_as(dtype)

    def numpy(self):
        if not tf.executing_eagerly():
            raise NotImplementedError("numpy() is only available when eager execution is enabled.")
        return self.value().numpy()

    def __array__(self, dtype=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def gather_nd(self, indices, name=None):
        raise NotImplementedError(
            f"{self._shared_name} is a stacked table's rows: gather_nd is not supported. "
            "Use sparse_read / tf.gather, or stack_tables=False.")

    # -- writes ----------------------------------------------------------------

    def _rows_range(self):
        return tf.range(self.num_rows, dtype=tf.int64)

    def _scatter(self, method: str, indices, values):
        """Writes `values` at this view's rows `indices` (local; outside it: an error)."""
        _, physical = self._physical(indices)
        values = tf.convert_to_tensor(values, dtype=self.dtype)
        getattr(self.stack_shard, method)(tf.IndexedSlices(values, physical))
        return self

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._scatter("scatter_update", self._rows_range(), value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._scatter("scatter_add", self._rows_range(), delta)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._scatter("scatter_sub", self._rows_range(), delta)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_update", sparse_delta.indices, sparse_delta.values)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_add", sparse_delta.indices, sparse_delta.values)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_sub", sparse_delta.indices, sparse_delta.values)

    # -- checkpoints -----------------------------------------------------------

    def _gather_saveables_for_checkpoint(self):
        # The table saves its rows (under its own key); a view alone has none.
        return {}

    def _serialize_to_tensors(self):
        return {}


def _view_to_tensor(view, dtype=None, name=None, as_ref=False):
    del name, as_ref
    return view.value_as(dtype)


tf.register_tensor_conversion_function(TableView, _view_to_tensor)
# TF's type-based dispatch ignores unregistered types (see _tf_internal).
tf_dispatch.register_dispatchable_type(TableView)


@tf.experimental.dispatch_for_api(
    tf.compat.v1.nn.embedding_lookup, {"params": List[TableView]})
def _embedding_lookup_views(params, ids, partition_strategy="mod", name=None,
                            validate_indices=True, max_norm=None):
    """A "mod" lookup over a stacked table's views (TF's, which would read them densely).

    TF's v1 lookup converts a list of params to dense tensors unless one of
    them is a `BaseResourceVariable`, and its sparse and safe lookups call it
    with the list they are given: this is its "mod" path, gathering from
    each view (`TableView.sparse_read`: one gather of the stack shard, the
    gradient to the view).
    """
    del partition_strategy, validate_indices  # Always the table's own "mod" layout.
    views = list(params)
    with tf.name_scope(name or "embedding_lookup"):
        ids = tf.convert_to_tensor(ids)
        flat = tf.reshape(ids, [-1])
        n = len(views)
        shard = tf.cast(flat % n, tf.int32)
        local = tf.dynamic_partition(flat // n, shard, n)
        positions = tf.dynamic_partition(tf.range(tf.size(flat)), shard, n)
        rows = []
        for view, part in zip(views, local):
            got = view.sparse_read(part)
            if max_norm is not None:
                got = tf.clip_by_norm(got, max_norm, axes=[1])
            rows.append(got)
        out = tf.dynamic_stitch(positions, rows)
        return tf.reshape(out, tf.concat([tf.shape(ids), tf.shape(out)[1:]], axis=0))


class StackedTableSpec(sharded_variable.ShardedVariableSpec):
    """TypeSpec that rebuilds a `StackedTable` with its offsets."""

    __slots__ = ["_row_offsets", "_num_rows", "_table_name"]

    def __init__(self, row_offsets, num_rows, name, *variable_specs):
        super().__init__(*variable_specs)
        self._row_offsets = tuple(row_offsets)
        self._num_rows = int(num_rows)
        self._table_name = name

    value_type = property(lambda self: StackedTable)

    def _serialize(self):
        return (self._row_offsets, self._num_rows, self._table_name) + self._variable_specs

    def _to_components(self, value):
        # What `tf.nest` (expand_composites) and Keras (`Layer._track_variables`,
        # when a layer sets `self.embeddings = table`) see inside a table: its
        # own views, not the stack's shards (other tables' rows).
        views = value.views
        return list(views) if views else super()._to_components(value)

    def _from_components(self, variables):
        variables = list(variables)
        if variables and all(isinstance(v, TableView) for v in variables):
            return variables[0].table
        return StackedTable(variables, self._row_offsets, self._num_rows,
                            name=self._table_name)


class _TableSet:
    """The live tables of a stack, by identity (a WeakSet would compare tables with ==)."""

    def __init__(self):
        self._refs: Dict[int, "weakref.ref[StackedTable]"] = {}

    def add(self, table) -> None:
        self._refs[id(table)] = weakref.ref(table, lambda _, key=id(table): self._refs.pop(key,
                                                                                         None))

    def discard(self, table) -> None:
        self._refs.pop(id(table), None)

    def __iter__(self):
        return iter([t for t in (ref() for ref in list(self._refs.values())) if t is not None])


class _Stack:
    """The shard variables of one stack and the tables in it.

    A table that joins does not copy the stack: each shard keeps the initial
    rows of the tables appended since it was last materialized (tensors on
    its PS) and makes its variable, of the full known shape, from all of
    them at once when anything first needs it (a lookup, a read, a slot, a
    checkpoint). Building a model of 26 tables thus writes each shard once,
    not once per table (appending by copying grew each PS's peak RSS by
    0.55 GB on the 26-table benchmark model). A table that joins after that
    costs one copy of the shard.
    """

    def __init__(self, name: str, num_shards: int, width: int, dtype: tf.DType,
                 device_of: Callable[[int], Optional[str]], creator,
                 on_replace: Callable[[Optional[tf.Variable], tf.Variable], None]):
        self.name = name
        self.width = width
        self.dtype = dtype
        self.rows = [0] * num_shards
        self.pending: List[list] = [[] for _ in range(num_shards)]
        self.shards = [_StackShard(self, s, device_of(s)) for s in range(num_shards)]
        for shard in self.shards:
            # A view's write scatters through its shard's own methods (into
            # the inner handle): numbered there, as a write outside a step.
            outside_writes.watch(shard)
        self._creator = creator
        self._on_replace = on_replace
        self.sealed = False
        self.traced = False  # A traced function has used its variables (set by its shards).
        self.materializations = 0
        self.tables = _TableSet()
        # The tables whose rows are in `pending`, in order (one piece each per shard).
        self.pending_tables: List["weakref.ref[StackedTable]"] = []
        self.owner: Optional["weakref.ref[TableStacks]"] = None  # Set by TableStacks.

    @property
    def num_bytes(self) -> int:
        return sum(self.rows) * self.width * self.dtype.size

    def append(self, shard_values: Callable[[int], Callable[[], tf.Tensor]],
               counts: Sequence[int]) -> List[int]:
        """Computes a table's initial rows on each PS; returns where they start in the stack.

        The rows are computed now, so that an initializer draws the same
        values as for an unstacked table (Keras's unseeded initializers
        follow the global seed in creation order); they join the stack's
        variables when it is materialized.
        """
        offsets = list(self.rows)
        for s, count in enumerate(counts):
            with tf.device(self.shards[s].device or None):
                rows = shard_init.compute_rows(shard_values(s), [count, self.width],
                                               self.dtype)
            self.pending[s].append(rows)
            self.rows[s] += int(count)
        return offsets

    def materialize(self) -> None:
        """Makes each shard's variable hold every row appended so far (one allocation)."""
        if not any(self.pending):
            return
        with tf.init_scope():  # Also when first needed while a step is traced.
            for s, shard in enumerate(self.shards):
                if not self.pending[s]:
                    continue
                old = shard._inner  # pylint: disable=protected-access
                pieces = list(self.pending[s])
                with tf.device(shard.device or None):
                    new = self._creator(
                        name=f"{self.name}/part_{s}", shape=[self.rows[s], self.width],
                        initial_value=functools.partial(_rows_of, old, pieces, self.dtype))
                shard._inner = new  # pylint: disable=protected-access
                tf_objects.set_aggregating_container(new, shard)
                self.pending[s] = []
                self._on_replace(old, new)
        self.pending_tables = []
        self.materializations += 1

    def never_made(self) -> bool:
        """Whether no shard has its variable yet (nothing can have read the stack)."""
        # pylint: disable-next=protected-access
        return all(shard._inner is None for shard in self.shards)

    def like(self, name: str) -> "_Stack":
        """A new, empty stack of the same row width, dtype, shards and creator."""
        stack = _Stack(name, len(self.shards), self.width, self.dtype, lambda s: None,
                       self._creator, self._on_replace)
        for mine, theirs in zip(stack.shards, self.shards):
            mine._device = theirs._device  # pylint: disable=protected-access
            tf_objects.set_variable_distribute_strategy(
                mine, tf_objects.variable_distribute_strategy(theirs))
        stack.owner = self.owner
        return stack


def separate_by_model(model, apart: Optional[str] = None) -> None:
    """Gives a model's stacked tables stacks of their own before its first traced call.

    A stack is filled as layers are built, before any model exists; two
    models built in one scope (a target network, a teacher) and the frozen
    tables of a model would share it. Before any traced function uses a
    stack, its tables are split by who trains them: `model`'s trainable
    tables, its frozen ones, and the rest (whose own model sorts them out
    when it runs).
    Then an optimizer's one apply per stack updates exactly the tables it
    is given (`stacked_updates`), whatever kind of optimizer it is.

    Args:
        model: The Keras model about to run (or to get its optimizer's slots).
        apart: Why `model`'s tables must each have storage of their own (its
            optimizer is not known to update a stack as it updates each of
            its tables: `stacked_updates.why_apart`), or None. Each is then
            alone in its stack -- its own variables, as unstacked -- and the
            placement report says why.
    """
    mine, trainable = {}, set()
    for view in model.weights:
        if isinstance(view, TableView):
            mine[id(view.table)] = view.table
    if not mine:
        return
    for view in model.trainable_variables:
        if isinstance(view, TableView):
            trainable.add(id(view.table))
    stacks = {}
    for table in mine.values():
        if table.stack is not None and not (table.stack.sealed or table.stack.traced):
            stacks[id(table.stack)] = table.stack
    if not stacks:
        return

    def group_of(table):
        if id(table) not in mine:
            return "other"
        if apart:
            return ("alone", id(table))
        return "trainable" if id(table) in trainable else "frozen"

    with tf.init_scope():  # Bookkeeping of eager objects, also while a step is traced.
        for stack in stacks.values():
            owner = stack.owner() if stack.owner is not None else None
            if owner is not None:
                owner.separate(stack, group_of, why_alone=apart or "")


def is_stack_shard(variable) -> bool:
    """Whether `variable` is a stack's shard (what one apply per stack updates)."""
    return isinstance(variable, _StackShard)


def _current_rows(variable, table, s: int) -> tf.Tensor:
    """`table`'s rows of stack shard `s`, read from the shard's `variable` (on its PS)."""
    start = table.row_offsets[s]
    count = table.shard_counts[s]
    with tf.device(variable.device):
        return tf.identity(variable.sparse_read(tf.range(start, start + count, dtype=tf.int64)))


def _rows_of(old: Optional[tf.Variable], pieces, dtype) -> tf.Tensor:
    parts = [old.read_value()] if old is not None else []
    parts += [tf.cast(piece, dtype) for piece in pieces]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


class _StackShard(ps_values.AggregatingVariable):
    """A stack's shard on one PS: forwards to the variable that holds its rows.

    `AggregatingVariable` is TF's own forwarding variable (stock PSS wraps PS
    variables in it); Keras, the tape and the optimizers use its inner
    variable's handle. The inner variable is made, or remade bigger, by the
    stack (`_Stack.materialize`) when first needed; what Keras and
    `ShardedVariable` ask while a model is built (shape, dtype, device,
    name, trainable) is answered without it. Its strategy is the one whose
    scope made it, as Keras checks before it makes slots; None outside any
    (a plain variable's, e.g. in one process), where assignments go
    straight to the variable.
    """

    # pylint: disable=super-init-not-called
    def __init__(self, stack: _Stack, index: int, device: Optional[str]):
        # Not AggregatingVariable.__init__: there is no inner variable yet.
        self._distribute_strategy = (tf.distribute.get_strategy()
                                     if tf.distribute.has_strategy() else None)
        # NONE: cross-replica writes go through the strategy's `update`.
        self._aggregation = tf.VariableAggregation.NONE
        self._stack = stack
        self._index = index
        self._inner: Optional[tf.Variable] = None
        self._device = _canonical(device)

    @property
    def _v(self):
        if self._inner is None or self._stack.pending[self._index]:
            self._stack.materialize()
        if not tf.executing_eagerly():
            # A traced function may now hold this variable: never split the stack.
            self._stack.traced = True
        return self._inner

    @property
    def shape(self):
        return tf.TensorShape([self._stack.rows[self._index], self._stack.width])

    @property
    def dtype(self):
        return self._stack.dtype

    @property
    def device(self):
        return self._inner.device if self._inner is not None else self._device

    @property
    def name(self):
        return f"{self._stack.name}/part_{self._index}:0"

    @property
    def trainable(self):
        return True

    @property
    def synchronization(self):
        return tf.VariableSynchronization.AUTO

    def _get_save_slice_info(self):
        return None  # ShardedVariable asks; the stack's tables save themselves.

    def _assign_func(self, *args, **kwargs):
        if self._distribute_strategy is None:
            f = kwargs.pop("f")
            return f(self._v, *args, **kwargs)
        return super()._assign_func(*args, **kwargs)


def _canonical(device: Optional[str]) -> str:
    """``/job:ps/task:0/device:CPU:0`` as a variable reports it (with ``/replica:0``)."""
    if not device:
        return ""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job and spec.replica is None:
        spec = spec.replace(replica=0)
    return spec.to_string()


class TableStacks:
    """The stacks of one strategy, by (row width, dtype, shard count).

    Args:
        shard_devices: Maps a shard index to its PS device.
    """

    def __init__(self, shard_devices: Callable[[int], str],
                 on_restack: Callable[["StackedTable", str, str], None] = (
                     lambda table, name, why: None)):
        self._device_of = shard_devices
        self._on_restack = on_restack
        self._open: Dict[tuple, "weakref.ref[_Stack]"] = {}
        self._all: List["weakref.ref[_Stack]"] = []
        self._count = 0

    def eligible(self, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
                 kwargs: dict) -> bool:
        """Whether a table with these creation arguments is stacked (see the module doc)."""
        return self.why_not(shape, dtype, num_shards, kwargs) is None

    def why_not(self, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
                kwargs: dict) -> Optional[str]:
        """Why a table with these creation arguments is not stacked, or None if it is.

        The placement report shows the reason beside the table.
        """
        if _UNSTACKED.active():
            return "its layer addresses its own rows (DynamicEmbedding)"
        if not tf.executing_eagerly():
            return "made in graph mode"
        if num_shards < 2:
            return "one shard"
        if shape.rank != 2 or not shape.is_fully_defined() or not dtype.is_floating:
            return "not a 2-D float table of known shape"
        if not kwargs.get("trainable", True):
            return "not trainable"
        if kwargs.get("constraint") is not None:
            return "has a constraint (applied to the whole variable)"
        sync = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if sync not in (tf.VariableSynchronization.AUTO, tf.VariableSynchronization.ON_WRITE):
            return f"synchronization {sync.name}"
        if aggregation not in (tf.VariableAggregation.NONE, None):
            return f"aggregation {aggregation.name}"
        if shape.num_elements() * dtype.size > MAX_TABLE_BYTES:
            return (f"larger than {MAX_TABLE_BYTES >> 20} MiB "
                    "(its own ops are a small part of its cost)")
        return None

    def add(self, name: str, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
            shard_values: Callable[[int], Callable[[], tf.Tensor]],
            creator: Callable[..., tf.Variable],
            on_replace: Callable[[tf.Variable, tf.Variable], None] = lambda old, new: None,
            ) -> StackedTable:
        """Puts a new table in its group's open stack; returns its `StackedTable`.

        Args:
            name: The table's name.
            shape: Its logical shape ``[V, D]``.
            dtype: Its dtype.
            num_shards: PS shards (>= 2).
            shard_values: ``shard_values(s)()`` is shard ``s``'s initial rows
                (interleaved: logical rows ``s, s + n, ...``).
            creator: Creates a stack's shard variable from `tf.Variable` keyword
                arguments (``name``, ``shape``, ``initial_value``), when the
                stack is materialized (if this table starts a stack).
            on_replace: Called with (old or None, new) variable of a shard
                when the stack is materialized (the old one is then freed).
        """
        width = int(shape[1])
        key = (width, dtype.name, num_shards)
        stack = self._open[key]() if key in self._open else None
        table_bytes = shape.num_elements() * dtype.size
        if stack is not None and (stack.sealed or stack.traced
                                  or stack.num_bytes + table_bytes > MAX_STACK_BYTES):
            # (Traced: a function holds its variables, which a join would replace.)
            stack = None
        if stack is None:
            name_ = f"stacked_tables_{width}_{dtype.name}_{self._count}"
            self._count += 1
            stack = _Stack(name_, num_shards, width, dtype, self._device_of, creator, on_replace)
            stack.owner = weakref.ref(self)
            # Weak: a stack lives as long as a table in it (tables hold it).
            self._open[key] = weakref.ref(stack)
            self._all.append(weakref.ref(stack))
        offsets = stack.append(shard_values,
                               shard_rows(int(shape[0]), num_shards, SHARDING_INTERLEAVED))
        table = StackedTable(stack.shards, offsets, int(shape[0]), name=name, stack=stack)
        stack.tables.add(table)
        stack.pending_tables.append(weakref.ref(table))
        return table

    def separate(self, stack: _Stack, group_of: Callable[["StackedTable"], object],
                 why_alone: str = "") -> None:
        """Splits a stack no traced function uses yet into one stack per group of its tables.

        `group_of(table)` names each table's group; the first group stays in
        `stack`. If the stack's variables exist (an eager read or a restore
        made them), each table's rows are read out of them and the variables
        are made anew per group, else only the pending rows move. Every
        moved table is re-pointed at its new stack's shards. Nothing happens
        once a slot exists or a traced function used the stack
        (`separate_by_model` runs this when a model starts a traced call).
        A table left alone in a stack by a split for `why_alone` is reported
        as not stacked, for that reason.
        """
        if stack.sealed or stack.traced:
            return  # Slots exist, or a traced function holds its variables.
        n = len(stack.shards)
        if stack.never_made():
            members = [(ref(), [stack.pending[s][k] for s in range(n)])
                       for k, ref in enumerate(stack.pending_tables)]
            dead = any(t is None for t, _ in members)
            members = [(t, pieces) for t, pieces in members if t is not None]
        else:
            # Made (an eager read, a restore), but no function holds it: each
            # table's current rows are read out, and the old variables freed.
            members = [(t, None) for t in sorted(stack.tables, key=lambda t: t.row_offsets)]
            dead = False
        groups: Dict[object, list] = {}
        for table, pieces in members:
            groups.setdefault(group_of(table), []).append((table, pieces))
        if len(groups) < 2 and not dead:
            if why_alone and len(members) == 1:
                self._on_restack(members[0][0], "", why_alone)
            return
        if not stack.never_made():
            stack.materialize()  # Tables appended since: their rows into the variables.
            # pylint: disable-next=protected-access
            members = [(t, [_current_rows(stack.shards[s]._inner, t, s) for s in range(n)])
                       for t, _ in members]
            groups = {}
            for table, pieces in members:
                groups.setdefault(group_of(table), []).append((table, pieces))
            for shard in stack.shards:
                stack._on_replace(shard._inner, None)  # pylint: disable=protected-access
                shard._inner = None  # pylint: disable=protected-access
        for i, items in enumerate(groups.values()):
            if i == 0:
                target = stack
            else:
                target = stack.like(f"stacked_tables_{stack.width}_{stack.dtype.name}_"
                                    f"{self._count}")
                self._count += 1
                self._all.append(weakref.ref(target))
            target.rows = [0] * len(target.shards)
            target.pending = [[] for _ in target.shards]
            target.pending_tables = []
            for table, pieces in items:
                offsets = list(target.rows)
                for s, piece in enumerate(pieces):
                    target.pending[s].append(piece)
                    target.rows[s] += table.shard_counts[s]
                target.pending_tables.append(weakref.ref(table))
                if target is not stack:
                    stack.tables.discard(table)
                table.rebind(target, offsets)
                if why_alone and len(items) == 1:
                    self._on_restack(table, "", why_alone)
                else:
                    self._on_restack(table, target.name, "")

    def stack_of(self, var) -> Optional[_Stack]:
        """The stack whose shard `var` is (the wrapper, its variable or a view), or None."""
        if isinstance(var, TableView):
            var = var.stack_shard
        for stack in self.stacks():
            for shard in stack.shards:
                if var is shard or var is shard._inner:  # pylint: disable=protected-access
                    return stack
        return None

    def seal(self, var) -> None:
        """No table joins the stack of shard `var` any more (its slots exist)."""
        stack = self.stack_of(var)
        if stack is not None:
            stack.sealed = True

    def stacks(self) -> List[_Stack]:
        """Every stack that still has a table, in creation order."""
        return [s for s in (ref() for ref in self._all) if s is not None]
