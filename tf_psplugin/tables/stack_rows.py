"""A stacked table's rows as its lookups and gradients see them.

Why this module exists: a stacked table (`stacking`) is a range of rows of
one stack variable per PS. Its lookups (`lookups`, one gather per PS for a
whole stack) and its updates (`stacked_updates`) both need the same three
small pieces, kept here, below all three modules so none imports another
back: ids shifted into the stack with a bounds check (`shift_valid`), the
tape told that a table's view was read (`watch`), and a fused gather's
gradient split per table with the whole kept beside it (`note_split`,
`whole_gradient`).
"""

from typing import Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal.tf_internal import tape_lib

__all__ = ["note_split", "shift_valid", "watch", "whole_gradient"]


def shift_valid(ids: tf.Tensor, shifted: tf.Tensor, num_rows) -> tf.Tensor:
    """`shifted` where ``0 <= ids < num_rows``; negative ids as they are; the rest out of range.

    Elementwise only (no assertion op), so it costs the step nothing
    measurable; the shard's gather or scatter raises the error, as it does
    for an unstacked table.
    """
    too_big = tf.fill(tf.shape(ids), tf.constant(ids.dtype.max, ids.dtype))
    return tf.where(ids < 0, ids, tf.where(ids < num_rows, shifted, too_big))


def watch(view) -> None:
    """Makes every active tape watch `view`, as reading a variable does."""
    tape_lib.variable_accessed(view)


_SPLIT_ATTR = "_tf_psplugin_split_gradients"


def note_split(split: Sequence[tf.IndexedSlices], whole: tf.IndexedSlices) -> None:
    """Notes that `split` (one gradient per view, in order) came out of `whole`.

    Called by a fused stack gather's gradient. In a traced function only
    (the note lives on the graph, keyed by the tensors it holds).
    """
    if tf.executing_eagerly():
        return
    graph = tf.compat.v1.get_default_graph()
    notes = getattr(graph, _SPLIT_ATTR, None)
    if notes is None:
        notes = {}
        setattr(graph, _SPLIT_ATTR, notes)
    group = object()
    for position, piece in enumerate(split):
        notes[id(piece.indices)] = (group, position, len(split), piece, whole)


def whole_gradient(grads: Sequence) -> Optional[tf.IndexedSlices]:
    """The stack shard's whole gradient if `grads` are exactly one fused gather's split.

    Each must be the unchanged `IndexedSlices` `note_split` noted, together
    all the pieces of one split; else None (they are put back together).
    """
    notes = getattr(tf.compat.v1.get_default_graph(), _SPLIT_ATTR, None)
    if not notes or not grads:
        return None
    found = [notes.get(id(getattr(g, "indices", None))) for g in grads]
    if any(f is None for f in found):
        return None
    group, _, count, _, whole = found[0]
    if any(f[0] is not group for f in found) or len(found) != count:
        return None
    if sorted(f[1] for f in found) != list(range(count)):
        return None
    if any(g.values is not f[3].values for g, f in zip(grads, found)):
        return None
    return whole
