"""Legacy optimizers' slots of stacked tables: one variable per stack shard, shown per table.

Why this module exists: Keras's legacy optimizers (`tf.keras.optimizers.
legacy`, OptimizerV2) make one slot variable per variable they update
(`add_slot`), list it in the order made as `optimizer.variables()` and
`weights` (what `get_weights` and `set_weights` read and write), and find
it by its variable (`get_slot(var, name)`). What makes a stack fast is one
sparse apply per stack shard with ONE slot variable per stack shard and
slot name (`stacked_updates`). If the optimizer listed those, a program
could tell that tables are stacked: `optimizer.variables()` would hold one
slot per stack shard, named after the stack, and `get_slot(view, ...)`
would find none.

How: the optimizer makes its slots from the variable list as Keras has it
-- each table's views (`stacking.TableView`) where an unstacked table's
shards would be: `stacked_updates` hands `_create_all_weights` the list of
the variables given a gradient from before its merge (`making_slots_for`,
`slot_variables`), or a restore's or `build_optimizer_slots`'s
`model.trainable_variables`. Its `add_slot` (patched) calls
`add_view_slot` for a view: that makes the stack shard's slot by Keras's
own `add_slot` for the stack shard (once per stack shard and slot name; it
is what the apply's kernels use and `get_slot(stack shard, ...)` returns,
and it is listed nowhere), and returns a `stacked_slots.SlotView` of the
view's rows of it, named and shaped as an unstacked shard's slot
(``[<scope>/]<layer>/embeddings/part_<s>/<slot>``, ``[rows, D]``). That
view is what `optimizer.variables()` lists, at the position Keras lists an
unstacked shard's slot, and what `get_slot(view, name)` returns; its reads
and writes (`get_weights`, `set_weights`, `assign`) are the stack slot's
rows.

Checkpoints are unchanged: a legacy optimizer's slots are saved as slot
variables of the checkpoint's own variables, and a stacked table is saved
under its own key with its own rows of the stack shards' slots
(`sharded_slots`); a view is no checkpoint object.

Private Keras API, through `_internal.tf_objects` (tf.keras 2.15, tf-keras
2.21): the optimizer's `_weights` (the list `variables()` returns: no
public way to list a variable as the optimizer's, or to unlist one) and
`_slots` (the dictionary `get_slot` reads).
"""

import contextlib
from typing import Callable, Dict, List, Sequence

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin.tables.stacked_slots import SlotView
from tf_psplugin.tables.table_view import TableView

__all__ = ["add_view_slot", "making_slots_for", "slot_variables"]

# id(optimizer) -> the variables its running apply_gradients makes slots for.
_MAKING: Dict[int, List] = {}


@contextlib.contextmanager
def making_slots_for(optimizer, variables: Sequence):
    """While inside, `optimizer`'s slots are made for `variables` (`slot_variables`).

    `stacked_updates` merges the views' gradients into one gradient per
    stack shard before Keras's `apply_gradients` makes the slots; the slots
    are still made for what Keras was given -- the views given a gradient,
    among the other variables, in their order -- so that each view gets its
    slot where an unstacked table's shard does.

    Args:
        optimizer: A Keras legacy optimizer.
        variables: The variables given a gradient, before the merge.

    Yields:
        None.
    """
    previous = _MAKING.get(id(optimizer))
    _MAKING[id(optimizer)] = list(variables)
    try:
        yield
    finally:
        if previous is None:
            _MAKING.pop(id(optimizer), None)
        else:
            _MAKING[id(optimizer)] = previous


def slot_variables(optimizer, var_list: Sequence) -> list:
    """What `optimizer._create_all_weights(var_list)` makes slots for (see `making_slots_for`)."""
    making = _MAKING.get(id(optimizer))
    return list(var_list) if making is None else list(making)


def add_view_slot(optimizer, add_slot: Callable, view: TableView, slot_name: str,
                  initializer="zeros", shape=None) -> SlotView:
    """A legacy optimizer's slot of `view`: the view's rows of its stack shard's slot.

    Args:
        optimizer: The legacy optimizer.
        add_slot: Keras's own (unpatched) ``OptimizerV2.add_slot``.
        view: A stacked table's `TableView`.
        slot_name: The slot's name ("accumulator", "m", ...).
        initializer: As for `add_slot`: the stack shard's slot is initialized
            with it (a name or a callable); a value is written into the
            view's rows.
        shape: As for `add_slot`: None, or the view's shape.

    Returns:
        The `SlotView`, made once per (view, slot name).

    Raises:
        ValueError: `shape` is not the view's (a slot of other rows than the
            table's cannot be a view of the stack's slot).
    """
    slots = tf_objects.optimizer_slots(optimizer).setdefault(
        tf_objects.variable_unique_id(view), {})
    if slot_name in slots:
        return slots[slot_name]
    if shape is not None and tf.TensorShape(shape) != view.shape:
        raise ValueError(
            f"{type(optimizer).__name__}.add_slot({view.name}, {slot_name!r}, shape={shape}): "
            f"the table {view.table.display_name} is stacked, and its slot must have the "
            f"shape of its rows ({view.shape}). Fix: call add_slot without shape, or use "
            "HybridOptions(stack_tables=False).")
    value = None
    if not (isinstance(initializer, str) or callable(initializer)):
        value, initializer = initializer, "zeros"  # A value of the view's rows.
    stack_slot = add_slot(optimizer, view.stack_shard, slot_name, initializer=initializer)
    weights = tf_objects.legacy_optimizer_weights(optimizer)
    # The stack shard's slot, which the apply uses, is listed nowhere: its
    # tables' slots (this view) are, where an unstacked shard's slot is.
    weights[:] = [w for w in weights if w is not stack_slot]
    # Named as Keras names the slot of an unstacked shard made here (in the
    # current name scope: the optimizer's, in apply_gradients).
    scope = tf.get_current_name_scope()
    name = f"{tf_objects.variable_shared_name(view)}/{slot_name}"
    view_slot = SlotView([(stack_slot, view.offset, view.num_rows)],
                         f"{scope}/{name}" if scope else name)
    if value is not None:
        with tf.init_scope():
            view_slot.assign(value)
    slots[slot_name] = view_slot
    weights.append(view_slot)
    return view_slot
