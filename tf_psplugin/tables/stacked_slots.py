"""Keras's new optimizers' slots of stacked tables: one variable per stack shard, shown per table.

Why this module exists: Keras's new (non-legacy) optimizers keep their slots
in lists by position (``_variables``, and per kind ``_accumulators``,
``_momentums``, ...), which is how a checkpoint names them
(``optimizer/_variables/<i>``) and what `optimizer.variables` shows. What
makes a stack fast is one sparse apply per stack shard with ONE slot
variable per stack shard (`stacked_updates`). If those lists held the stack
shards' slots, a program could tell that tables are stacked: the checkpoint
would have other keys and shapes than an unstacked run's, restore only into
the same stacking, and `optimizer.variables` would show stacks.

How (`build`): the optimizer's own `build` is given the variable list as
Keras has it -- each table's views (`stacking.TableView`) at the positions
an unstacked table's shards would have -- followed by the stack shards of
those views. Its `add_variable_from_reference` (patched, `add_slot`) then
makes, for a view, a `SlotView`: the view's rows of its stack shard's slot
(made on the first view that needs it, on the stack shard's PS), named and
shaped as an unstacked shard's slot would be; that is what the optimizer's
lists and ``_variables`` hold at the view's position. For a stack shard it
returns the stack shard's slot itself, untracked (a `NoDependency`): its
entry at the end of the optimizer's lists is what `_index_dict` maps the
stack shard to, for the one apply per stack shard, and no checkpoint or
`optimizer.variables` shows it. With tf-keras 2.16+, which lists a sharded
table's shard slots as one `ShardedVariable` per table (saved as one
``[V, D]`` tensor), the view slots of one table are listed the same way, as
one `SlotView` over all of the table's rows (`SlotView.pieces`).

So the checkpoint holds, under the unstacked run's keys, each table's own
slot rows, and restores into the other stacking; the apply is unchanged.
A stack split apart later (`stacking.split_apart`) takes these slots with
it (`slot_split`): the stack shards' slots get successors on the new stack
shards, appended to the same lists and indexed for them, and each
`SlotView` is pointed at its table's rows there (`set_pieces`).
With a `ChiefCheckpointManager` or `build_optimizer_slots`, `slot_order`
lists them one step further: one logical ``[V, D]`` tensor per table slot,
as a single-process model does (any PS count).

Private Keras API (registered in `tf_internal.PRIVATE_ATTRIBUTES`, checked
on Keras 2.15 and tf-keras 2.21): the optimizer's ``_variables`` list (no
public way to list a variable as the optimizer's); with tf-keras 2.16+, a
slot's ``_sharded_container`` (what its checkpoint listing of the
optimizer's lists follows, `_trackable_children`).
"""

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_psplugin._internal import compat
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import ps_values, trackable_base
from tf_psplugin.tables import slot_split, table_view
from tf_psplugin.tables.stacking import TableView

__all__ = ["SlotView", "build_per_table", "add_slot", "stack_shard_of"]

_IDS = itertools.count()
# tf-keras 2.16+ lists a sharded variable's shard slots as one `ShardedVariable`
# per table (`add_variable_from_reference`); Keras 2.15 lists each shard's slot.
_LISTS_SHARDED_SLOTS_PER_TABLE = compat.KERAS_PACKAGE == "tf_keras"
# id(optimizer) -> _Building, while its `build` runs with views (`build_per_table`).
_BUILDING: Dict[int, "_Building"] = {}


def stack_shard_of(slot) -> Optional[tf.Variable]:
    """The stack shard whose slot `slot` (a `SlotView` piece's variable) is; None if none.

    What incremental checkpoints (`state.incremental`) follow to stamp and
    save a view's rows with its stack shard's. Recorded as the slot is made
    (here, or by a split that moved it: `slot_split`).
    """
    return slot_split.stack_shard_of(slot)


class SlotView(table_view.ValueReads, tf.Variable):
    """A table's rows of its stack shards' slots, as the optimizer lists them.

    What an unstacked table's shard slot is -- a ``[rows, D]`` variable
    named ``<slot>/<table>/part_<s>`` -- stored as rows ``[offset, offset +
    rows)`` of the stack shard's slot (one piece), or, with tf-keras 2.16+,
    a table's whole slot (one piece per shard, in shard order, as TF's
    `ShardedVariable` saves it). It saves and restores those rows, reads and
    assigns them; the optimizer never applies to it (the apply uses the
    stack shard's slot).

    Args:
        pieces: (slot variable, first row, row count) per piece.
        name: Its name (without ``:0``).
    """

    # pylint: disable=super-init-not-called,missing-function-docstring
    def __init__(self, pieces: Sequence[Tuple[tf.Variable, int, int]], name: str):
        # Not tf.Variable.__init__: the storage is the stack shards' slots.
        self._pieces = [(slot, int(start), int(count)) for slot, start, count in pieces]
        self._slot_name = name
        self._id = next(_IDS)

    @property
    def pieces(self) -> List[Tuple[tf.Variable, int, int]]:
        return list(self._pieces)

    def set_pieces(self, pieces: Sequence[Tuple[tf.Variable, int, int]]) -> None:
        """Sets the rows this view is (a table's whole slot, once each shard's is made)."""
        self._pieces = [(slot, int(start), int(count)) for slot, start, count in pieces]

    @property
    def name(self):
        # A table's whole slot is named as TF names a `ShardedVariable` (no ":0").
        return self._slot_name if len(self._pieces) > 1 else f"{self._slot_name}:0"

    @property
    def _shared_name(self):
        return self._slot_name

    @property
    def _unique_id(self):
        return f"tf_psplugin_slot_view_{self._id}"

    @property
    def shape(self):
        rows = sum(count for _, _, count in self._pieces)
        return tf.TensorShape([rows]).concatenate(self._pieces[0][0].shape[1:])

    def get_shape(self):
        return self.shape

    @property
    def dtype(self):
        return self._pieces[0][0].dtype

    @property
    def device(self):
        return self._pieces[0][0].device if len(self._pieces) == 1 else ""

    @property
    def trainable(self):
        return False

    @property
    def _distribute_strategy(self):
        # What Keras's compile asks of a legacy optimizer's variables (`_weights`,
        # `variable_created_in_scope`): its stack slot's strategy.
        return tf_objects.variable_distribute_strategy(self._pieces[0][0])

    @property
    def graph(self):
        # (tf.identity asks for it: without one it would raise.)
        return self._pieces[0][0].graph

    def __repr__(self):
        return f"<SlotView {self._slot_name!r} shape={self.shape} dtype={self.dtype.name}>"

    # -- reads and writes ------------------------------------------------------

    def value(self):
        parts = []
        for slot, start, count in self._pieces:
            with tf.device(slot.device):
                parts.append(slot.sparse_read(tf.range(start, start + count, dtype=tf.int64)))
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    def _write(self, method: str, value):
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        begin, ops = 0, []
        for slot, start, count in self._pieces:
            with tf.device(slot.device):
                rows = tf.range(start, start + count, dtype=tf.int64)
                ops.append(getattr(slot, method)(
                    tf.IndexedSlices(value[begin:begin + count], rows)))
            begin += count
        return ops

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self._write("scatter_update", value)
        return self

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self._write("scatter_add", delta)
        return self

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self._write("scatter_sub", delta)
        return self

    def _scatter(self, method: str, sparse_delta):
        if len(self._pieces) != 1:
            raise NotImplementedError(
                f"{self._slot_name} is a table's whole slot over several PS shards: "
                "write it with assign(), or write each shard's slot.")
        slot, start, _ = self._pieces[0]
        indices = tf.cast(sparse_delta.indices, tf.int64) + start
        values = tf.convert_to_tensor(sparse_delta.values, dtype=self.dtype)
        with tf.device(slot.device):
            getattr(slot, method)(tf.IndexedSlices(values, indices))
        return self

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_update", sparse_delta)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_add", sparse_delta)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter("scatter_sub", sparse_delta)

    def sparse_read(self, indices, name=None):
        del name
        if len(self._pieces) != 1:
            return tf.gather(self.value(), indices)
        slot, start, _ = self._pieces[0]
        with tf.device(slot.device):
            return slot.sparse_read(tf.cast(indices, tf.int64) + start)

    def part(self, index: int) -> "SlotView":
        """Piece `index` alone, as a view of its own (rows ``0..count`` of it), not tracked.

        A table's whole slot (tf-keras 2.16+) is written shard by shard
        through its parts, as a `ShardedVariable`'s ``variables[index]``.
        """
        slot, start, count = self._pieces[index]
        return SlotView([(slot, start, count)], f"{self._slot_name}/part_{index}")

    # -- checkpoints -----------------------------------------------------------

    def _gather_saveables_for_checkpoint(self):
        return {}  # Saved by `_serialize_to_tensors`.

    def _serialize_to_tensors(self):
        return {trackable_base.VARIABLE_VALUE_KEY: self.value()}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[trackable_base.VARIABLE_VALUE_KEY]
        return tf.group(*self._write("scatter_update", value))


tf.register_tensor_conversion_function(SlotView, table_view.view_to_tensor)


class _Building:
    """The slots one `build` call makes: per (stack shard, slot name) one variable."""

    def __init__(self, views: Sequence[TableView], shards: Sequence):
        self.shard_ids = {id(s) for s in shards}
        self.slots: Dict[Tuple[int, str], tf.Variable] = {}
        # tf-keras 2.16+: one SlotView per (table, slot name), listed once all
        # of the table's views have theirs (as its ShardedVariable builder does).
        self.per_table = _LISTS_SHARDED_SLOTS_PER_TABLE
        self.pending: Dict[Tuple[int, str], tuple] = {}  # -> (whole SlotView, {shard: piece})
        # (id(stack shard), slot name) -> a table's whole slot of it (tf-keras 2.16+).
        self.first_whole: Dict[Tuple[int, str], "SlotView"] = {}
        self.views_of: Dict[int, int] = {}
        for view in views:
            self.views_of[id(view.table)] = self.views_of.get(id(view.table), 0) + 1

    def slot_of(self, shard, variable_name: str) -> tf.Variable:
        key = (id(shard), variable_name)
        if key not in self.slots:
            dtype = getattr(shard, "true_dtype", shard.dtype)
            with tf.distribute.get_strategy().extended.colocate_vars_with(shard):
                self.slots[key] = tf.Variable(
                    initial_value=tf.zeros(shard.shape, dtype=dtype),
                    name=f"{variable_name}/{shard.name.split(':')[0]}",
                    dtype=dtype, trainable=False)
            slot_split.record_stack_slot(self.slots[key], shard, variable_name)
        return self.slots[key]


def build_per_table(optimizer, build, var_list: Sequence, shards: Sequence) -> None:
    """Runs a new optimizer's `build` with views listed per table (see the module docstring).

    Args:
        optimizer: The Keras (new) optimizer.
        build: Its class's own `build`, unpatched.
        var_list: The variables Keras builds for, with tables' views.
        shards: The stack shards of those views (each once).
    """
    views = [v for v in var_list if isinstance(v, TableView)]
    building = _Building(views, shards)
    _BUILDING[id(optimizer)] = building
    try:
        build(optimizer, list(var_list) + list(shards))
    finally:
        _BUILDING.pop(id(optimizer), None)


def add_slot(optimizer, model_variable, variable_name: str, shape=None,
             initial_value=None) -> Optional[object]:
    """The slot `add_variable_from_reference` returns for a view or a stack shard, else None.

    None: not building with views, or not a view or stack shard (Keras's own
    then makes the slot).
    """
    building = _BUILDING.get(id(optimizer))
    if building is None:
        return None
    if isinstance(model_variable, TableView):
        if shape is not None and list(shape) != model_variable.shape.as_list():
            return None
        slot = building.slot_of(model_variable.stack_shard, variable_name)
        # Named as Keras names a variable it makes here (in the optimizer's name scope).
        scope = tf.get_current_name_scope()
        name = f"{variable_name}/{tf_objects.variable_shared_name(model_variable)}"
        name = f"{scope}/{name}" if scope else name
        if not building.per_table:
            view = SlotView([(slot, model_variable.offset, model_variable.num_rows)], name)
            tf_objects.optimizer_variable_list(optimizer).append(view)
            return view
        return _per_table_slot(optimizer, building, model_variable, slot, variable_name, name)
    if id(model_variable) in building.shard_ids:
        slot = building.slot_of(model_variable, variable_name)
        whole = building.first_whole.get((id(model_variable), variable_name))
        if whole is not None:
            # tf-keras 2.16+ re-lists, for checkpoints, every element of the
            # optimizer's lists, the untracked ones too, as its shard's
            # `ShardedVariable` (`_sharded_container`), once per container:
            # a stack shard's slot names one table's whole slot of that stack
            # shard, already listed, so it adds nothing.
            tf_objects.set_sharded_container(slot, whole)
        if initial_value is not None:  # The optimizer's initial value of the whole stack shard.
            # Once, eagerly and in cross-replica context, as Keras makes the
            # variable itself: `build` may run while `apply_gradients` is
            # traced in a replica context (the first step), where the
            # assign would be traced into every step, and where an
            # `AggregatingVariable` refuses an assign without aggregation.
            # The variable inside the slot's PS wrappers takes it there.
            target = slot
            while isinstance(target, ps_values.AggregatingVariable):
                target = target.get()
            with tf.init_scope():
                target.assign(tf.cast(tf.convert_to_tensor(initial_value), slot.dtype))
        return tf_objects.no_dependency(slot)
    return None


def _per_table_slot(optimizer, building, view, slot, variable_name, name):
    """tf-keras 2.16+: the view's own rows, listed once per table as one `SlotView`."""
    table = view.table
    own = SlotView([(slot, view.offset, view.num_rows)], name)
    key = (id(table), variable_name)
    if key not in building.pending:
        # Named as the `ShardedVariable` tf-keras lists for an unstacked table's
        # slot (its default name), so that `optimizer.variables` reads the same.
        building.pending[key] = (SlotView([], "ShardedVariable"), {})
    whole, pieces = building.pending[key]
    building.first_whole.setdefault((id(view.stack_shard), variable_name), whole)
    pieces[view.index] = (slot, view.offset, view.num_rows)
    if len(pieces) == building.views_of[id(table)]:
        whole.set_pieces([pieces[s] for s in sorted(pieces)])
        tf_objects.optimizer_variable_list(optimizer).append(whole)
    # Keras's coalescing of the optimizer's lists replaces each shard slot by
    # its table's (`_sharded_container`); the table's SlotView stands for it.
    tf_objects.set_sharded_container(own, whole)
    return own
