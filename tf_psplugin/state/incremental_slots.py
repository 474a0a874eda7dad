"""Which optimizer slots belong to which tracked table, for incremental checkpoints.

Why this module exists: a delta (`incremental`) saves a table's optimizer
slots by the table's changed rows, so it must know, for every slot
variable the checkpoint holds, whose rows it holds; a slot it cannot place
is saved whole with the dense state (correct, only larger). Slots come in
as many shapes as optimizers and Keras versions make them: legacy
optimizers' checkpoint slot variables, Keras's new optimizers' one
variable per table shard (tf-keras 2.16+: wrapped in a `ShardedVariable`),
and, for stacked tables, per-table views of the stack shards' slots
(`stacked_slots.SlotView`). `find_slots` sorts them onto the tables
(`incremental._Table`) and makes every write to them stamp the rows it
writes (`RowStamps.watch`).
"""

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import tensorflow as tf

from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.tables import slot_order
from tf_psplugin.tables import stacked_slots

__all__ = ["find_slots"]


def find_slots(tables: Sequence[Any], variables: Mapping[str, Any],
               slots: Mapping[str, Tuple[str, str]]) -> None:
    """Finds each table's optimizer slots, and stamps the rows any write to them touches.

    Legacy optimizers' slots are checkpoint slot variables (one logical
    slot per table), and so are Keras's new optimizers' slots listed per
    table (`slot_order.table_of`). Keras's new optimizers make one plain variable per
    table shard, named ``[<optimizer>/]<slot name>/<shard name>``, on
    the shard's device (`add_variable_from_reference`); a variable whose
    name ends with one shard's name (the longest match), with its shape
    and device, is that shard's slot. Ambiguous ones are saved whole
    with the dense state (correct, only larger). tf-keras (TF 2.16+)
    wraps a sharded table's per-shard slots in one `ShardedVariable`:
    one whose parts are, in order, slots of one table's shards is that
    table's sharded slot.

    A stacked table's slots (`stacked_slots.SlotView`) are matched by
    their pieces, not by name: a piece ``(slot, start, count)`` of the
    slot of stack shard ``s`` (`stacked_slots.stack_shard_of`) with
    ``start, count`` = the table's offset and row count in that shard is
    the table's shard-``s`` slot. One piece: a per-shard slot (Keras
    2.15); one piece per shard, in shard order: the table's whole slot
    (tf-keras 2.16+), saved part by part. Either is saved by the table's
    own changed rows of the shard, by ids local to the piece (the
    table's local rows). The piece's variable (the stack shard's slot)
    is watched with the shard's `RowStamps`: a write through the view
    (`SlotView.assign`, ``scatter_*``) writes it, and stamps the rows it
    writes.

    Args:
        tables: The tracked tables (`incremental._Table`); their slot lists
            (``slot_keys``, ``shard_slot_keys``, ``sharded_slot_keys``,
            ``view_slots``) are set anew.
        variables: Checkpoint key -> variable (`incremental.object_keys`).
        slots: Slot key -> (key of its variable, slot name), likewise.
    """
    slots_of: Dict[str, List[Tuple[str, str]]] = {}
    for slot_key, (owner, slot_name) in sorted(slots.items()):
        slots_of.setdefault(owner, []).append((slot_key, slot_name))
    slot_ids = {id(variables[k]) for k in slots if k in variables}
    table_ids = {id(s) for t in tables for s in t.shards}
    table_ids.update(id(t.container) for t in tables)
    # Keras's new optimizers' slots listed per table in logical order
    # (`slot_order`): like a legacy slot, the table's logical slot.
    key_of_table = {id(t.container): t.key for t in tables}
    for key, var in sorted(variables.items()):
        table = slot_order.table_of(var)
        if table is not None and id(table) in key_of_table:
            slots_of.setdefault(key_of_table[id(table)], []).append((key, key))
            slot_ids.add(id(var))
    for table in tables:
        table.slot_keys = slots_of.get(table.key, [])
        table.shard_slot_keys = [[] for _ in table.shards]
        table.sharded_slot_keys = []
        table.view_slots = {}
        for slot_key, _ in table.slot_keys:
            slot = variables[slot_key]
            parts = list(slot.variables) if len(table.shards) > 1 else [slot]
            for s, part in enumerate(parts):
                table.stamps[s].watch(part)
    candidates = []
    for key, var in sorted(variables.items()):
        if isinstance(var, stacked_slots.SlotView):
            _match_view(tables, key, var)
        elif isinstance(var, tf.Variable) and id(var) not in slot_ids | table_ids:
            candidates.append((key, var))
    owners: Dict[str, List[Tuple[Any, int]]] = {}
    for key, var in candidates:
        name = var.name or ""
        found = [(len(shard.name), table, s) for table in tables
                 for s, shard in enumerate(table.shards)
                 if name.endswith("/" + shard.name) and var.shape == shard.shape
                 and var.device == shard.device]
        longest = max((n for n, _, _ in found), default=0)
        owners[key] = [(table, s) for n, table, s in found if n == longest]
    for key, var in sorted(variables.items()):
        if not isinstance(var, sharded_variable.ShardedVariable) or id(var) in (
                slot_ids | table_ids):
            continue
        parts = list(var.variables)
        for table in tables:
            if len(parts) == len(table.shards) and all(
                    (part.name or "").endswith("/" + shard.name)
                    and part.shape == shard.shape and part.device == shard.device
                    for part, shard in zip(parts, table.shards)):
                table.sharded_slot_keys.append(key)
                for stamps, part in zip(table.stamps, parts):
                    stamps.watch(part)
                break
    for key, found in sorted(owners.items()):
        # One shard variable (a stack's shard names several tables: the
        # first, by key, lists it); else ambiguous: saved whole with the
        # dense state.
        if found and all(t.shards[s] is found[0][0].shards[found[0][1]] for t, s in found):
            table, s = found[0]
            table.shard_slot_keys[s].append(key)
            table.stamps[s].watch(variables[key])

def _match_view(tables: Sequence[Any], key: str, view) -> None:
    """Lists `view` (a `SlotView`) as the slot of the table whose rows its pieces are.

    Unmatched (not one table's rows of its stack shards' slots): left to
    the dense state, saved whole.
    """
    pieces = view.pieces
    for table in tables:
        if len(pieces) not in (1, len(table.shards)):
            continue
        matched = []  # (shard index, the stack shard's slot variable)
        for i, (slot, start, count) in enumerate(pieces):
            shard = stacked_slots.stack_shard_of(slot)
            shard_index = next((s for s, t_shard in enumerate(table.shards)
                                if t_shard is shard), None)
            if (shard_index is None or (len(pieces) > 1 and shard_index != i)
                    or start != table.offsets[shard_index]
                    or count != table.counts[shard_index]):
                break
            matched.append((shard_index, slot))
        else:
            for s, slot in matched:
                table.stamps[s].watch(slot)  # The view's writes are its writes.
                table.view_slots[(key, s)] = slot
            if len(pieces) == 1:
                table.shard_slot_keys[matched[0][0]].append(key)
            else:
                table.sharded_slot_keys.append(key)
            return
