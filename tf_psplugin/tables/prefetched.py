"""Rows a fused lookup already fetched, for the lookups of one model call to take.

Why this module exists: `fusion` looks up a functional model's tables at one
depth together, before their `Embedding` layers run; each layer's own
`tf.nn.embedding_lookup` then finds its rows here (`lookups` asks through
`take`) instead of gathering again. The store is per thread, a stack of
model calls (a model may call another), and lives below both modules so
that neither imports the other back.
"""

import threading
from typing import List, Optional

import tensorflow as tf

__all__ = ["runs", "take"]

_state = threading.local()


def runs() -> List:
    """This thread's model calls in progress, innermost last (each has a ``rows`` dict)."""
    if not hasattr(_state, "runs"):
        _state.runs = []
    return _state.runs


def take(params, ids) -> Optional[tf.Tensor]:
    """The fused rows for `tf.nn.embedding_lookup(params, ids)`, or None.

    Called by the lookup dispatcher of `InterleavedShardedVariable`; None
    (the usual case outside a fused model run) means "look it up yourself".
    The innermost call's ``rows`` maps ``(id(table), id(ids))`` to
    ``(table, ids, rows)``.
    """
    current = runs()
    if not current:
        return None
    entry = current[-1].rows.get((id(params), id(ids)))
    return entry[2] if entry is not None else None
