"""An optimizer's slots of a stack, split with it (`stacking.split_apart`).

Why this module exists: a stack is split apart while a step is traced
(`stacked_fallback.SplitRequired`: a legacy optimizer not known to update
a stack elementwise met it). Another optimizer, still alive, may have
trained the stack before and hold slots of its shards (a model fit with
Adagrad or Keras's SGD, then a custom loop with a user's legacy optimizer,
then the first again). Such a slot holds the old stack's row layout. Each
is moved with the stack: the slot of an old stack shard gets a slot per
new stack shard, with the same rows (each table's rows of the old slot, in
the new stack's row order), the optimizer is pointed at the new slots, and
the per-table slots it lists (`SlotView`s: views of a stack slot's rows)
are pointed at the new slots' rows, which stay unlisted as the old one
was. The optimizer then trains on as it did, on the new stacks, as it
would the tables unstacked.

* **Legacy optimizers** keep their slots in `_slots` ({variable key: {slot
  name: slot}}): the new slots are made with the optimizer's `add_slot`,
  and the old one is dropped from `_slots` and `_weights`.
* **Keras (new) optimizers** of a known slot layout (those whose `build`
  lists a stacked table's slots per table, `stacked_slots`) keep one slot
  per stack shard in each per-variable list (`_momentums`, `_velocities`,
  SGD's `momentums`, ...), at the position `_index_dict` gives the shard's
  `_var_key`. Those lists are tracked and append-only (a replaced element
  would make them unsaveable): the new slots are appended, untracked (as
  `build` left the old ones), one position per new stack shard in every
  such list, and `_index_dict` maps each new stack shard there. The old
  slot keeps its position, emptied (no key leads to it any more). With
  tf-keras 2.16+, a new slot names its table's whole `SlotView` as its
  `_sharded_container`, as the old one did (what that Keras's checkpoint
  listing of the lists follows). Keras's `optimizer.variables` and its
  checkpoint keys are the `SlotView`s: unchanged.

A live slot this module does not know -- of an optimizer whose slots of a
stack are laid out otherwise (a Keras optimizer outside the known ones
makes its slots per table; one whose lists do not hold its slots by
position) -- keeps the stack whole: the split is refused, naming the fix
(`stacking.split_apart`).

Private Keras API, through `_internal/tf_objects.py`: legacy `_slots` and
`_weights`; new `_index_dict`, `_var_key`, `_variables` and the
optimizer's list attributes (no public way to give a built optimizer a
variable's slots).
"""

import weakref
from typing import List, NamedTuple, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.identity import IdentityMap

__all__ = ["Moving", "keras_slots_of", "move", "movable", "record_keras_slot",
           "record_optimizer", "record_stack_slot", "stack_shard_of"]

# The legacy optimizers that made slots of a stack shard (weakly held).
_LEGACY = weakref.WeakSet()
# Keras (new) optimizer -> {id(stack shard): [its slot variables of it]}, as
# `add_variable_from_reference` makes them (a stack shard's slots are listed
# nowhere): `stacked_fallback.keep_rows` and the split read it.
_KERAS = weakref.WeakKeyDictionary()
# A stack shard's slot variable (Keras's, per table: `stacked_slots`) -> (that
# stack shard, the slot's name as `add_variable_from_reference` was given it).
_STACK_SLOT: IdentityMap = IdentityMap()


def record_optimizer(optimizer) -> None:
    """Records a legacy optimizer making slots for stack shards (`_create_all_weights`)."""
    _LEGACY.add(optimizer)


def record_stack_slot(slot, shard, name: str) -> None:
    """Records `slot` as the slot named `name` of stack shard `shard` (`stacked_slots`)."""
    _STACK_SLOT[slot] = (shard, name)


def stack_shard_of(slot) -> Optional[tf.Variable]:
    """The stack shard whose slot `slot` is (`record_stack_slot`), or None."""
    entry = _STACK_SLOT.get(slot)
    return entry[0] if entry is not None else None


def _variable(slot):
    """The variable of a slot (a `NoDependency` wrapper's value)."""
    return getattr(slot, "value", slot) if not isinstance(slot, tf.Variable) else slot


def record_keras_slot(optimizer, shard, slot) -> None:
    """Records `slot`, made by a Keras (new) optimizer for stack shard `shard`."""
    _KERAS.setdefault(optimizer, {}).setdefault(id(shard), []).append(_variable(slot))


def keras_slots_of(optimizer, shard) -> list:
    """A Keras (new) optimizer's slot variables of stack `shard` (`record_keras_slot`)."""
    return list(_KERAS.get(optimizer, {}).get(id(shard), []))


def _same(a, b) -> bool:
    return a is b or getattr(a, "value", a) is b or a is getattr(b, "value", b)


class Moving(NamedTuple):
    """A live slot of a stack shard that moves with the split (`movable`).

    Attributes:
        optimizer: Its optimizer.
        key: Legacy: its `_slots` key; Keras (new): its position in `lists`
            (`_index_dict` of the old stack shard's `_var_key`).
        shard: The index of its stack shard.
        name: Its slot name.
        slot: The slot variable.
        lists: Keras (new): the optimizer's per-variable lists that hold a
            slot of a stack shard at `key` (this slot's is one); None for a
            legacy optimizer.
    """

    optimizer: object
    key: object
    shard: int
    name: str
    slot: object
    lists: Optional[list]


def movable(live: Optional[Sequence[tuple]]) -> Optional[List[Moving]]:
    """Each live slot of a stack as it moves with a split, or None if one cannot move.

    Args:
        live: (slot, shard index) of each live slot of the stack
            (`Stack.live_slots`; None: a slot of unknown shard).

    Returns:
        A `Moving` per live slot, or None if a live slot is neither a
        legacy optimizer's nor one of a Keras optimizer's known layout
        (see the module docstring).
    """
    if live is None:
        return None
    found, left = [], list(live)

    def take(slot):  # Its shard index, if live; each record of it taken.
        matches = [entry for entry in left if _same(entry[0], slot)]
        left[:] = [entry for entry in left if not _same(entry[0], slot)]
        return matches[0][1] if matches else None

    for optimizer in list(_LEGACY):
        for key, named in list(tf_objects.optimizer_slots(optimizer).items()):
            for name, slot in list(named.items()):
                s = take(slot)
                if s is not None:
                    found.append(Moving(optimizer, key, s, name, slot, None))
    for optimizer in list(_KERAS):
        mine = []
        for slots in list(_KERAS.get(optimizer, {}).values()):
            for slot in slots:
                s = take(slot)
                if s is not None:
                    mine.append((slot, s))
        if mine:
            entries = _keras_positions(optimizer, mine)
            if entries is None:
                return None
            found += entries
    return None if left else found


def _keras_positions(optimizer, slots) -> Optional[List[Moving]]:
    """A Keras optimizer's `Moving` entries for `slots` ((slot, shard index)), None if unknown.

    Known: each slot is the element, at its stack shard's position in
    `_index_dict`, of exactly one of the optimizer's lists, and the slots
    of every stack shard are held by the same lists, all of one length
    (what `build` makes, one element per variable).
    """
    index = tf_objects.optimizer_variable_index(optimizer)
    lists = tf_objects.optimizer_lists(optimizer)
    entries, held_by = [], {}  # held_by: shard index -> ids of the lists holding its slots.
    for slot, s in slots:
        shard, name = _STACK_SLOT.get(slot) or (None, None)
        if shard is None:
            return None
        position = index.get(tf_objects.optimizer_variable_key(optimizer, shard))
        holders = [l for l in lists if position is not None and len(l) > position
                   and _same(l[position], slot)]
        if len(holders) != 1:
            return None
        entries.append(Moving(optimizer, position, s, name, slot, holders))
        held_by.setdefault(s, set()).add(id(holders[0]))
    union = {id(l): l for e in entries for l in e.lists}
    if any(ids != set(union) for ids in held_by.values()):
        return None  # A shard's slots not in the lists another's are in.
    if len({len(l) for l in union.values()}) != 1:
        return None  # Lists not all one element per variable.
    return [e._replace(lists=list(union.values())) for e in entries]


def _old_rows_in_new_order(value, stack, tables, s: int, old_rows: dict):
    """`value`'s rows (an old stack shard `s`'s slot) of `stack`'s tables, in its row order."""
    members = sorted((t for t in tables if t.stack is stack), key=lambda t: t.row_offsets[s])
    pieces = [value[old_rows[id(t)][s][0]:old_rows[id(t)][s][0] + old_rows[id(t)][s][1]]
              for t in members]
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)


def move(found: Sequence[Moving], tables, old_rows: dict) -> list:
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
        The old slot variables (the caller empties them).
    """
    stacks = list({id(t.stack): t.stack for t in tables}.values())
    old = []
    keras = {}  # id(optimizer) -> its `Moving` entries.
    for entry in found:
        if entry.lists is not None:
            keras.setdefault(id(entry.optimizer), []).append(entry)
            continue
        optimizer, key, s, name, slot = entry[:5]
        value = tf.convert_to_tensor(slot)
        new_slots = {}  # id(stack) -> its new slot of shard s
        for stack in stacks:
            rows = _old_rows_in_new_order(value, stack, tables, s, old_rows)
            new_slots[id(stack)] = optimizer.add_slot(stack.shards[s], name, initializer=rows)
        if _repoint_views(tf_objects.legacy_optimizer_weights(optimizer), slot, s, tables,
                          old_rows, new_slots):
            # The new stack slots, which `add_slot` just listed, are unlisted
            # again, as the old one was (an optimizer without views -- its
            # tables were each alone in a stack -- keeps them listed).
            listed = {id(v) for v in new_slots.values()}
            weights = tf_objects.legacy_optimizer_weights(optimizer)
            weights[:] = [w for w in weights if id(w) not in listed]
        named = tf_objects.optimizer_slots(optimizer).get(key, {})
        named.pop(name, None)
        if not named:
            tf_objects.optimizer_slots(optimizer).pop(key, None)
        tf_objects.drop_legacy_optimizer_weight(optimizer, slot)
        old.append(_variable(slot))
    for entries in keras.values():
        old += _move_keras(entries, stacks, tables, old_rows)
    return old


def _move_keras(entries: Sequence[Moving], stacks, tables, old_rows: dict) -> list:
    """A Keras optimizer's part of `move`: new slots appended to its lists, its index pointed."""
    optimizer, lists = entries[0].optimizer, entries[0].lists
    index = tf_objects.optimizer_variable_index(optimizer)
    by_shard = {}  # shard index -> {id(list): entry}
    for entry in entries:
        holder = next(l for l in lists if _same(l[entry.key], entry.slot))
        by_shard.setdefault(entry.shard, {})[id(holder)] = entry
    registry = _KERAS.setdefault(optimizer, {})
    for entry in entries:  # Its old slots (the first new stack keeps the old stack's shards).
        registry.pop(id(stack_shard_of(entry.slot)), None)
    new = []  # (old entry, {id(stack): new slot})
    for s in sorted(by_shard):
        made = {id(l): {} for l in lists}
        for stack in stacks:
            shard = stack.shards[s]
            position = len(lists[0])
            for holder in lists:
                entry = by_shard[s][id(holder)]
                rows = _old_rows_in_new_order(tf.convert_to_tensor(entry.slot), stack, tables,
                                              s, old_rows)
                slot = _new_keras_slot(shard, entry.name, rows)
                holder.append(tf_objects.no_dependency(slot))  # Untracked, as `build` made it.
                made[id(holder)][id(stack)] = slot
                record_stack_slot(slot, shard, entry.name)
                record_keras_slot(optimizer, shard, slot)
            index[tf_objects.optimizer_variable_key(optimizer, shard)] = position
        new += [(by_shard[s][id(l)], made[id(l)]) for l in lists]
    listed = list(tf_objects.optimizer_variable_list(optimizer))
    seen = {id(v) for v in listed}
    views = listed + [v for l in lists for v in l if id(v) not in seen]
    for entry, slots in new:
        _repoint_views(views, entry.slot, entry.shard, tables, old_rows, slots)
        container = tf_objects.sharded_container(entry.slot)
        if container is not None:
            for slot in slots.values():
                # tf-keras 2.16+: its table's whole slot, listed already (see
                # `stacked_slots.add_slot`): its checkpoint listing adds nothing.
                whole = next((v for v in listed if hasattr(v, "set_pieces")
                              and any(p[0] is slot for p in v.pieces)), container)
                tf_objects.set_sharded_container(slot, whole)
    return [_variable(entry.slot) for entry, _ in new]


def _new_keras_slot(shard, name: str, rows) -> tf.Variable:
    """A Keras optimizer's slot `name` of stack `shard`, holding `rows` (`stacked_slots`'s kind).

    Made on the shard's PS as `stacked_slots` makes one (the strategy's
    variable creator records it as the new stack's slot, `Stack.held_by`).
    """
    strategy = tf.distribute.get_strategy()
    if not tf.distribute.has_strategy():
        strategy = tf_objects.variable_distribute_strategy(shard) or strategy
    with strategy.scope(), strategy.extended.colocate_vars_with(shard):
        return tf.Variable(initial_value=rows, name=f"{name}/{shard.name.split(':')[0]}",
                           dtype=rows.dtype, trainable=False)


def _repoint_views(weights, slot, s: int, tables, old_rows: dict, new_slots: dict) -> bool:
    """Points the per-table slot views among `weights` of `slot` at the tables' new slots' rows.

    A known optimizer lists each stacked table's slot as a view of the
    stack slot's rows (`SlotView`: legacy `legacy_slots`, Keras's
    `stacked_slots`): after the split, each view reads its table's rows of
    the new stack's slot (same name, shape and position).

    Args:
        weights: What the optimizer lists (its views among them).
        slot: The old stack shard `s`'s slot.
        s: The stack shard index.
        tables: The old stack's tables.
        old_rows: id(table) -> [(first row, row count)] per shard, before the split.
        new_slots: id(new stack) -> its new slot of shard `s`.

    Returns:
        Whether a view of `slot` was among `weights`.
    """
    by_rows = {tuple(old_rows[id(t)][s]): t for t in tables}
    repointed = False
    for weight in list(weights):
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
    return repointed
