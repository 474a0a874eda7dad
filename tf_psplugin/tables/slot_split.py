"""A legacy optimizer's slots of a stack, split with it (`stacking.split_apart`).

Why this module exists: a stack is split apart while a step is traced
(`stacked_fallback.SplitRequired`: a legacy optimizer not known to update
a stack elementwise met it). Another optimizer, still alive, may have
trained the stack before and hold slots of its shards (a model fit with
legacy Adagrad, then a custom loop with a user's legacy optimizer, then
the first again). Such a slot holds the old stack's row layout. A legacy
optimizer keeps its slots in `_slots` ({variable key: {slot name: slot}}),
so each is moved with the stack: the slot of an old stack shard gets a
slot per new stack shard, with the same rows (each table's rows of the
old slot, in the new stack's row order), and the old slot is dropped from
the optimizer. The slots it lists per table (`legacy_slots`: views of a
stack slot's rows) are pointed at the new slots' rows, which stay unlisted
as the old one was. The optimizer then trains on as it did, on the new
stacks, as it would the tables unstacked.

A Keras (non-legacy) optimizer's slots of a stack are listed per table
(`stacked_slots`) in lists that Keras indexes by variable: they are not
moved (the split is refused, naming the fix).
"""

import weakref
from typing import List, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal import tf_objects

__all__ = ["move", "movable", "record_optimizer"]

# The legacy optimizers that made slots of a stack shard (weakly held).
_LEGACY = weakref.WeakSet()


def record_optimizer(optimizer) -> None:
    """Records a legacy optimizer making slots for stack shards (`_create_all_weights`)."""
    _LEGACY.add(optimizer)


def _same(a, b) -> bool:
    return a is b or getattr(a, "value", a) is b or a is getattr(b, "value", b)


def movable(live: Optional[Sequence[tuple]]) -> Optional[List[tuple]]:
    """The legacy optimizers' entries for a stack's live slots, or None if one is not theirs.

    Args:
        live: (slot, shard index) of each live slot of the stack
            (`Stack.live_slots`; None: a slot of unknown shard).

    Returns:
        (optimizer, its `_slots` key, shard index, slot name, slot) of each
        live slot, or None if a live slot is not a legacy optimizer's.
    """
    if live is None:
        return None
    found, left = [], list(live)
    for optimizer in list(_LEGACY):
        for key, named in list(tf_objects.optimizer_slots(optimizer).items()):
            for name, slot in list(named.items()):
                match = next((entry for entry in left if _same(entry[0], slot)), None)
                if match is not None:
                    left.remove(match)
                    found.append((optimizer, key, match[1], name, slot))
    return None if left else found


def move(found: Sequence[tuple], tables, old_rows: dict) -> list:
    """Gives each optimizer a slot per new stack shard, with the old slot's rows; drops the old.

    Called after the split (the tables point at their new stacks, which
    are made). A table's rows of an old slot are those its rows had in the
    old stack shard (`old_rows`); in the new slot they are where they are
    in the new stack shard.

    Args:
        found: `movable`'s answer, taken before the split.
        tables: The old stack's tables.
        old_rows: id(table) -> [(first row, row count)] per shard, before the split.

    Returns:
        The old slot variables (the caller empties those live traces read).
    """
    stacks = list({id(t.stack): t.stack for t in tables}.values())
    old = []
    for optimizer, key, s, name, slot in found:
        value = tf.convert_to_tensor(slot)
        new_slots = {}  # id(stack) -> its new slot of shard s
        for stack in stacks:
            members = sorted((t for t in tables if t.stack is stack),
                             key=lambda t, s=s: t.row_offsets[s])
            pieces = [value[old_rows[id(t)][s][0]:old_rows[id(t)][s][0] + old_rows[id(t)][s][1]]
                      for t in members]
            rows = pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)
            new_slots[id(stack)] = optimizer.add_slot(stack.shards[s], name, initializer=rows)
        _repoint_views(optimizer, slot, s, tables, old_rows, new_slots)
        named = tf_objects.optimizer_slots(optimizer).get(key, {})
        named.pop(name, None)
        if not named:
            tf_objects.optimizer_slots(optimizer).pop(key, None)
        tf_objects.drop_legacy_optimizer_weight(optimizer, slot)
        old.append(getattr(slot, "value", slot) if not isinstance(slot, tf.Variable) else slot)
    return old


def _repoint_views(optimizer, slot, s: int, tables, old_rows: dict, new_slots: dict) -> None:
    """Points the optimizer's per-table slot views of `slot` at the tables' rows of the new slots.

    A known legacy optimizer lists each stacked table's slot as a view of
    the stack slot's rows (`legacy_slots`, a `SlotView` in `_weights` and
    `_slots`): after the split, each view reads its table's rows of the new
    stack's slot (same name, shape and position), and the new stack slots,
    which `add_slot` just listed, are unlisted again, as the old one was.
    An optimizer without such views (its tables were each alone in a
    stack) keeps the new stack slots listed, as it listed the old.
    """
    by_rows = {tuple(old_rows[id(t)][s]): t for t in tables}
    repointed = False
    for weight in list(tf_objects.legacy_optimizer_weights(optimizer)):
        # A `stacked_slots.SlotView` (not imported: stacked_slots imports stacking, which
        # imports this module).
        if not hasattr(weight, "set_pieces") or not any(_same(p[0], slot)
                                                        for p in weight.pieces):
            continue
        moved = []
        for piece_slot, start, count in weight.pieces:
            table = by_rows.get((start, count)) if _same(piece_slot, slot) else None
            moved.append((new_slots[id(table.stack)], table.row_offsets[s], count)
                         if table is not None else (piece_slot, start, count))
        weight.set_pieces(moved)
        repointed = True
    if repointed:
        listed = {id(v) for v in new_slots.values()}
        weights = tf_objects.legacy_optimizer_weights(optimizer)
        weights[:] = [w for w in weights if id(w) not in listed]
