"""`TableView`: what Keras sees of a stacked table, one per stack shard.

Why this module exists: a stacked table's rows live in stack shards shared
with other tables (`stacking`), but Keras, the tape and every TF API must
see the table alone. A view is named, shaped and valued like an unstacked
table's shard (``<layer>/embeddings/part_<s>``, ``[rows, D]``); its reads are
gathers of the stack shard through a custom gradient on the view's own
handle tensor (each table gets its own `IndexedSlices`); its writes scatter
into its rows only. `tf.nn.embedding_lookup` over a list of views is one
"mod" lookup (`_embedding_lookup_views`).

Private TF API: `save_context.in_save_context` (a read while a SavedModel
is written must be a plain read), `tf_dispatch.register_dispatchable_type`
(TF's type-based dispatch ignores unregistered types).
"""

import itertools
from typing import List

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import save_context, tf_dispatch
from tf_psplugin.tables import stack_rows

__all__ = ["TableView", "ValueReads", "view_to_tensor"]


_VIEW_IDS = itertools.count()
_VIEW_HANDLES_ATTR = "_tf_psplugin_table_view_handles"


class ValueReads:
    """Reads of a view whose `value()` gathers its rows (tensor conversion, numpy, casts), and
    the variable attributes every such view answers alike.

    Shared by `TableView` and `stacked_slots.SlotView` (listed before
    `tf.Variable` among their bases, so these replace the variable's own).
    """

    @property
    def synchronization(self):
        return tf.VariableSynchronization.AUTO

    @property
    def aggregation(self):
        return tf.VariableAggregation.NONE

    @property
    def constraint(self):
        # A table with a constraint is never stacked (`TableStacks.eligible`); slots have none.
        return None

    @property
    def _in_graph_mode(self):
        return False

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


def view_to_tensor(view, dtype=None, name=None, as_ref=False):
    """Tensor conversion of a `ValueReads` view (registered for each view class)."""
    del name, as_ref
    return view.value_as(dtype)


class TableView(ValueReads, tf.Variable):
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
    def __init__(self, table, index: int):
        # Not tf.Variable.__init__: there is no storage of its own.
        self._table = table
        self._index = index
        self._id = next(_VIEW_IDS)
        self._eager_handle = (None, None)  # (stack variable, its identity)

    # -- what it is ------------------------------------------------------------

    @property
    def table(self):
        return self._table

    @property
    def index(self) -> int:
        return self._index

    @property
    def stack(self):
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
        return f"{self._table.view_prefix}/part_{self._index}"

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
    def _distribute_strategy(self):
        return tf_objects.variable_distribute_strategy(self.stack_shard)

    @property
    def graph(self):
        return tf_objects.aggregating_inner(self.stack_shard).graph

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


tf.register_tensor_conversion_function(TableView, view_to_tensor)
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
