"""Legacy optimizers' slots of interleaved and stacked tables, checkpointed per table in row order.

Why this module exists: Keras 2's legacy optimizers keep one slot per shard
variable and, for checkpoints, wrap a sharded table's shard slots in a
plain (contiguous) `ShardedVariable`, which writes an interleaved table's
slots in physical order and knows nothing of stacked tables. This patches
one optimizer instance (`install_interleaved_slot_lookup`) so that each
table's slots are wrapped like the table itself (`sharded.
InterleavedShardedVariable`): logical row order, the table's own rows of a
stack shard, restorable into any number of PS tasks.

Private Keras API, through `_internal.tf_objects`: the optimizer's
sharded-slot creator (`_create_slots_for_sharded_variables`: there is no
public hook for the slot wrapper type) and its slot dictionary (a stack's
tables registered for `get_slot`).
"""

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.tables.sharded import InterleavedShardedVariable

__all__ = ["install_interleaved_slot_lookup"]

# The optimizers patched already (patched once each; the entry dies with the optimizer).
_PATCHED: IdentityMap = IdentityMap()


def install_interleaved_slot_lookup(optimizer):
    """Makes a Keras 2 legacy optimizer checkpoint interleaved tables' slots in logical order.

    Legacy optimizers keep one slot per shard variable and, for checkpoints,
    wrap a sharded table's shard slots in a plain (contiguous)
    `ShardedVariable` (optimizer_v2.get_slot, Keras 2.15 and tf-keras
    2.16-2.21), which writes an interleaved table's slots in physical order:
    they would then restore correctly only into the same shard count. This
    wraps them in an `InterleavedShardedVariable` instead, so slots reshard
    like the table. One wrapper per (table, slot) while its shard slots stay
    the same, so checkpoint matching sees one object (Keras builds a new one
    per call).

    Instance-level (the optimizer's class is untouched) and idempotent; a
    no-op for optimizers that do not build sharded slots this way, whose
    `_create_slots_for_sharded_variables` is missing: there is no public hook
    for the slot wrapper type. Slots must exist before a checkpoint is
    restored into them (as after a first training step); a restore that runs
    before the optimizer created them is dropped by Keras for any sharded
    variable. `tf_psplugin.state.checkpoint` installs it on every optimizer it saves.

    Args:
        optimizer: A Keras 2 legacy optimizer, anything else, or None.

    Returns:
        `optimizer`.
    """
    if optimizer is None or _PATCHED.get(optimizer):
        return optimizer
    original = getattr(optimizer, "get_slot", None)
    if original is None or tf_objects.sharded_slot_creator(optimizer) is None:
        return optimizer
    cache = IdentityMap()  # table -> {slot name: its slots' wrapper}; dies with the table

    def get_slot(var, slot_name):
        if isinstance(var, InterleavedShardedVariable) and var.shares_shards:
            # A stacked table (table_stacking): the same rows of its stack
            # shards' slots. Keras knows only the shards' slots.
            shard_slots = [original(shard, slot_name) for shard in var.variables]
            wrappers = cache.get(var) or {}
            cached = wrappers.get(slot_name)
            if cached is None or any(a is not b for a, b in zip(cached.variables, shard_slots)):
                cached = var.with_variables(shard_slots, name=f"{var.name}/{slot_name}")
                cache[var] = {**wrappers, slot_name: cached}
            return cached
        slot = original(var, slot_name)
        if not isinstance(var, InterleavedShardedVariable) or not isinstance(
            slot, sharded_variable.ShardedVariable
        ):
            return slot
        wrappers = cache.get(var) or {}
        cached = wrappers.get(slot_name)
        if cached is None or any(a is not b for a, b in zip(cached.variables, slot.variables)):
            cached = var.with_variables(list(slot.variables), name=slot.name)
            cache[var] = {**wrappers, slot_name: cached}
        return cached

    create_sharded_slots = tf_objects.sharded_slot_creator(optimizer)

    def _create_slots_for_sharded_variables(var_list):
        # Keras registers the sharded container of each shard (TF keeps one
        # per shard: the last table made over it), so that a restore finds
        # the slots of a sharded table through `get_slot`. A stack's shards
        # serve every table of the stack: register each (table_stacking).
        create_sharded_slots(var_list)
        for var in var_list:
            container = tf_objects.sharded_container(var)
            stack = container.stack if isinstance(container, InterleavedShardedVariable) else None
            for table in list(stack.tables) if stack is not None else []:
                tf_objects.optimizer_slots(optimizer)[tf_objects.variable_unique_id(table)] = {
                    name: table for name in optimizer.get_slot_names()}

    optimizer.get_slot = get_slot
    tf_objects.set_sharded_slot_creator(optimizer, _create_slots_for_sharded_variables)
    _PATCHED[optimizer] = True
    return optimizer
