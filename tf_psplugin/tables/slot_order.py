"""Keras's new optimizers' table slots, checkpointed per table in logical row order.

Why this module exists: Keras's new (non-legacy) optimizers checkpoint their
variables as lists by position (``optimizer/_variables/<i>``, and per kind
``_momentums``, ``_accumulators``, ...). For a sharded table, Keras 2.15
lists one slot per table *shard* (``[rows of the shard, D]``: the keys and
shapes depend on the PS count); tf-keras 2.16+ lists one `ShardedVariable`
per table, saved ``[V, D]`` shard after shard (physical order: rows ``i % n
== s`` of an interleaved table are not a contiguous slice). Neither restores
into another PS count or into a plain single-process model.

`install` changes what one optimizer instance shows a checkpoint (never
what it applies): in each of its lists, a table's slots of one kind become
ONE object at the position of the table's first shard slot, the table's
own wrapper over those slots (`with_variables`: a table's
`InterleavedShardedVariable`, a stacked table's `StackedTable` over its
stack shards' slots; TF's `ShardedVariable` for a contiguous table), which saves the logical ``[V, D]`` slot under the key
an unstacked single-process model gives it, and restores from a tensor
saved whole or sliced into any number of shards (as tables do,
`sharded._LogicalTableSaveable`). Next to the lists, a marker
(``optimizer/tf_psplugin_slot_order/.ATTRIBUTES/FORMAT``, `FORMAT_KEY`)
tells a reader the layout: a checkpoint without it holds the old listing,
which `match_checkpoint` shows for its restore (same PS count only) until
`end_restore`.

Which table and shard a slot belongs to is recorded when the optimizer
makes it (`add_variable_from_reference`, patched on the instance), so the
optimizer must be installed before its slots are made: `ChiefCheckpointManager`
and `build_optimizer_slots` install it first. One installed after its slots
were made keeps the old listing (no marker).

Private TF/Keras API, through `_internal.tf_objects` (checked on Keras 2.15
and tf-keras 2.21): the optimizer's `_trackable_children` (no public way to
change what a checkpoint lists for an object), its `add_variable_from_reference`
(there is no hook on slot creation), a slot's `_sharded_container`.
"""

from typing import Dict, List, Optional, Tuple

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.tf_internal import sharded_variable, trackable_base
from tf_psplugin.tables.sharded import InterleavedShardedVariable
from tf_psplugin.tables.stacking import TableView

__all__ = ["FORMAT_KEY", "LOGICAL", "end_restore", "install", "is_marked", "logical_slot",
           "match_checkpoint", "table_of"]

# The marker's child name, attribute and key under a checkpoint's optimizer.
MARKER_NAME = "tf_psplugin_slot_order"
_MARKER_ATTRIBUTE = "FORMAT"
FORMAT_KEY = f"{MARKER_NAME}/.ATTRIBUTES/{_MARKER_ATTRIBUTE}"
LOGICAL = 1  # The marker's value: one logical [V, D] tensor per table slot.

# Installed optimizers -> their _State (the entry dies with the optimizer).
_STATES: IdentityMap = IdentityMap()
# A logical slot wrapper -> its table (`table_of`, for incremental checkpoints).
_TABLE_OF: IdentityMap = IdentityMap()


def is_marked(checkpoint_keys) -> bool:
    """Whether a checkpoint's keys (``get_variable_to_shape_map()``) hold the logical layout."""
    return any(key.endswith("/" + FORMAT_KEY) or key == FORMAT_KEY for key in checkpoint_keys)


def logical_slot(optimizer, table, slot_name: str) -> Optional[InterleavedShardedVariable]:
    """The slot `slot_name` of `table` as the checkpoint lists it (logical rows); None if none.

    For an `install`ed optimizer (or a `LossScaleOptimizer` over one) whose
    slots of `table` are all made: reads, `numpy()` and checkpoints in
    logical row order, as a single-process model's slot.
    """
    state = _STATES.get(getattr(optimizer, "inner_optimizer", optimizer))
    return state.logical_wrapper(table, slot_name) if state is not None else None


def table_of(slot) -> Optional[InterleavedShardedVariable]:
    """The table whose logical slot `slot` (a wrapper this module listed) is; None if none."""
    return _TABLE_OF.get(slot)


class _Marker(trackable_base.Trackable):
    """Saves `LOGICAL` under `FORMAT_KEY`; restores nothing."""

    def _serialize_to_tensors(self):
        return {_MARKER_ATTRIBUTE: tf.constant(LOGICAL, tf.int64)}

    def _restore_from_tensors(self, restored_tensors):
        del restored_tensors
        return tf.no_op()


class _State:
    """One optimizer's records: which table shard each slot is, and the lists shown."""

    def __init__(self, complete: bool):
        # Installed before any slot was made: every table slot is recorded.
        self.complete = complete
        self.logical = complete  # The listing to show (`match_checkpoint` may turn it off).
        # id(slot) -> (slot, table, shard index, slot name, storage variable)
        self.records: Dict[int, tuple] = {}
        # (id(table), slot name) -> the logical wrapper, with the storages it wraps.
        self.wrappers: Dict[Tuple[int, str], Tuple[InterleavedShardedVariable, list]] = {}
        self.marker = _Marker()
        # Cached listings: (ids of a list's children) -> the list object shown.
        self.lists: Dict[tuple, "_SlotList"] = {}

    def record(self, model_variable, variable_name: str, slot) -> None:
        if isinstance(model_variable, TableView):
            pieces = getattr(slot, "pieces", None)
            if not pieces:
                return
            storage = pieces[0][0]
            self.records[id(slot)] = (slot, model_variable.table, model_variable.index,
                                      variable_name, storage)
            return
        table = tf_objects.sharded_container(model_variable)
        # (A contiguous table is TF's own `ShardedVariable`; a stacked one's
        # slots are its views', recorded above.)
        if not isinstance(table, sharded_variable.ShardedVariable) or (
                isinstance(table, InterleavedShardedVariable) and table.shares_shards):
            return
        index = next((s for s, shard in enumerate(table.variables) if shard is model_variable),
                     None)
        if index is not None:
            self.records[id(slot)] = (slot, table, index, variable_name, slot)

    def wrapper_of(self, obj) -> Optional[InterleavedShardedVariable]:
        """The logical wrapper `obj` (a shard slot, or a table's sharded slot) stands for."""
        found = self.records.get(id(obj))
        if found is None:
            parts = None
            if isinstance(obj, sharded_variable.ShardedVariable):
                parts = list(obj.variables)
            elif hasattr(obj, "pieces"):
                parts = [piece for piece in self.records.values()
                         if tf_objects.sharded_container(piece[0]) is obj]
                parts = [p[0] for p in sorted(parts, key=lambda p: p[2])]
            if not parts or id(parts[0]) not in self.records:
                return None
            found = self.records[id(parts[0])]
        _, table, _, name, _ = found
        return self.logical_wrapper(table, name)

    def logical_wrapper(self, table, name: str) -> Optional[InterleavedShardedVariable]:
        storages: List[Optional[tf.Variable]] = [None] * len(table.variables)
        for slot, t, index, slot_name, storage in self.records.values():
            if t is table and slot_name == name:
                # A stacked table's slot view reads its stack shard's slot, which
                # a split of the stack replaces (`slot_split`): the one it reads now.
                pieces = getattr(slot, "pieces", None)
                storages[index] = pieces[0][0] if pieces else storage
        if any(s is None for s in storages):
            return None  # Not every shard's slot made (yet).
        key = (id(table), name)
        cached = self.wrappers.get(key)
        if cached is not None and all(a is b for a, b in zip(cached[1], storages)):
            return cached[0]
        name = storages[0].name.split(":")[0].rsplit("/part_", 1)[0]
        if isinstance(table, InterleavedShardedVariable):
            wrapper = table.with_variables(storages, name=name)
        else:  # Contiguous: TF's own saves its shards as row ranges, in logical order.
            wrapper = sharded_variable.ShardedVariable(storages, name=name)
        self.wrappers[key] = (wrapper, storages)
        _TABLE_OF[wrapper] = table
        return wrapper


class _SlotList(trackable_base.Trackable):
    """A list as a checkpoint shows it: children ``"0"``, ``"1"``, ... (as TF's ListWrapper)."""

    def __init__(self, items):
        self._items = list(items)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        del save_type, kwargs
        return {str(i): item for i, item in enumerate(self._items)}


def _listing(state: _State, children: dict) -> dict:
    """`children` with each list's table slots replaced by the tables' logical wrappers."""
    shown = dict(children)
    for name, value in children.items():
        if not isinstance(value, trackable_base.Trackable) or isinstance(value, tf.Variable):
            continue
        try:
            items = tf_objects.trackable_children(value)
        except (AttributeError, TypeError):
            continue
        if not items or not all(key.isdigit() for key in items):
            continue
        ordered = [items[key] for key in sorted(items, key=int)]
        rebuilt, seen, changed = [], set(), False
        for item in ordered:
            wrapper = state.wrapper_of(item)
            if wrapper is None and table_of(item) is not None:
                wrapper = item
            if wrapper is None:
                rebuilt.append(item)
                continue
            changed = changed or wrapper is not item
            if id(wrapper) not in seen:
                seen.add(id(wrapper))
                rebuilt.append(wrapper)
            else:
                changed = True
        if not changed:
            continue
        key = (name,) + tuple(id(item) for item in rebuilt)
        if key not in state.lists:
            state.lists[key] = _SlotList(rebuilt)
        shown[name] = state.lists[key]
    shown[MARKER_NAME] = state.marker
    return shown


def install(optimizer):
    """Makes a Keras new optimizer checkpoint its table slots per table, in logical order.

    Instance-level (the class is untouched) and idempotent; a no-op for a
    legacy optimizer (`sharded_slots.install_interleaved_slot_lookup` does
    theirs) and for None; a `LossScaleOptimizer`'s inner optimizer is
    installed (its marker then sits under ``optimizer/inner_optimizer/``).
    See the module docstring.

    Args:
        optimizer: A Keras optimizer, or None.

    Returns:
        `optimizer`.
    """
    if optimizer is None or _STATES.get(optimizer) is not None:
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)  # A LossScaleOptimizer's.
    if inner is not None:
        install(inner)
        return optimizer
    if tf_objects.create_all_weights_of(optimizer) is not None:
        return optimizer  # A legacy optimizer.
    add = getattr(optimizer, "add_variable_from_reference", None)
    if add is None:
        return optimizer
    state = _State(complete=not tf_objects.optimizer_built(optimizer))
    if not state.complete:
        logging.warning(
            "tf_psplugin: %s made its slots before its checkpoint listing was installed; "
            "its table slots are checkpointed as Keras lists them (same PS count only). "
            "Fix: create the ChiefCheckpointManager, or call build_optimizer_slots(model), "
            "before the first training step.", type(optimizer).__name__)
    children = tf_objects.trackable_children_method(optimizer)

    def add_variable_from_reference(model_variable, variable_name, shape=None,
                                    initial_value=None):
        slot = add(model_variable, variable_name, shape=shape, initial_value=initial_value)
        state.record(model_variable, variable_name, slot)
        return slot

    def trackable_children(save_type="checkpoint", **kwargs):
        found = children(save_type, **kwargs)
        if save_type != "checkpoint" or not state.logical:
            return found
        return _listing(state, found)

    tf_objects.set_instance_method(optimizer, "add_variable_from_reference",
                                   add_variable_from_reference)
    tf_objects.set_instance_method(optimizer, "_trackable_children", trackable_children)
    _STATES[optimizer] = state
    return optimizer


def match_checkpoint(optimizer, path: str) -> bool:
    """Lists `optimizer`'s slots as the checkpoint at `path` holds them; True if logical.

    Call before restoring `path` (and its deltas) into an installed
    optimizer, and `end_restore` after: a checkpoint without the marker
    (written before this layout) is restored with the old listing (same PS
    count only); the saves after `end_restore` are logical again.

    Args:
        optimizer: An optimizer (`install`ed or not), or None.
        path: A checkpoint prefix.

    Returns:
        Whether the checkpoint holds the logical layout (has the marker).
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    state = _STATES.get(optimizer) if optimizer is not None else None
    marked = is_marked(tf.train.load_checkpoint(path).get_variable_to_shape_map())
    if state is not None:
        state.logical = state.complete and marked
    return marked


def end_restore(optimizer) -> None:
    """Lists `optimizer`'s slots in the logical layout again (after `match_checkpoint`)."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    state = _STATES.get(optimizer) if optimizer is not None else None
    if state is not None:
        state.logical = state.complete
