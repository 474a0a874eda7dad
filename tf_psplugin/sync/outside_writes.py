"""Eager writes to a model's variables outside a training step, numbered: the write generation.

Why this module exists: a checkpoint of step N is the state after N
optimizer steps only until something else writes the weights. Keras does
that after the last batch of `fit`: `use_ema`'s `finalize_variable_values`
(before `on_train_end`) overwrites the weights with their averages, and
`EarlyStopping(restore_best_weights=True)` sets the best epoch's weights
back at the end of an epoch; so does a user's callback calling
`set_weights`. The step number does not change, so a checkpoint manager
that already saved step N must learn that the weights did
(`CheckpointManager.save`), without reading them.

Every write outside a step is an eager call on the chief of a write method
of the variable that holds the values: a `ReplicatedVariable` (dense
weights: `_mark_written`), or a table shard, a stack's shard or a table
slot, or a wrapper of one (the strategy `watch`es each when it makes it:
instance-level wrappers of its `tf.Variable` write methods, the class
untouched; every level of TF's PS wrappers, `levels`, since a wrapper's
`scatter_*` writes the inner handle without the inner's methods). Each
such write gets the next number of one process-wide count, kept per
variable (`note`). A manager remembers the count when it saves or restores
(`generation`) and asks, for the variables it saves, whether any was
written after that (`written_after`). Writes inside traced functions (the
optimizer's apply in a step, TF's own restore) are not counted: a step
changes the step number, and a restore is the manager's own.
"""

import itertools
import threading
import weakref
from typing import Any, Iterable, List

import tensorflow as tf

from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.tf_internal import ps_values

__all__ = ["WRITE_METHODS", "generation", "levels", "note", "watch", "watch_levels",
           "written_after"]

# tf.Variable methods that write a whole value, rows by IndexedSlices, rows by nd indices
# (`row_stamps` stamps rows by the same lists).
WHOLE_WRITES = ("assign", "assign_add", "assign_sub", "batch_scatter_update")
ROW_WRITES = ("scatter_add", "scatter_sub", "scatter_max", "scatter_min", "scatter_mul",
              "scatter_div", "scatter_update")
ND_WRITES = ("scatter_nd_update", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_max",
             "scatter_nd_min")
WRITE_METHODS = WHOLE_WRITES + ROW_WRITES + ND_WRITES

_lock = threading.Lock()
_count = itertools.count(1)
_latest = 0  # The number of the latest noted write (0: none yet).
_written: IdentityMap = IdentityMap()  # Variable -> number of its latest noted write.
_watched: IdentityMap = IdentityMap()  # Variables whose write methods `watch` wrapped.


def generation() -> int:
    """The number of the latest write noted so far in this process (0 if none)."""
    return _latest


def note(var: Any) -> None:
    """Records an eager write to `var` (a write while a function is traced is not one)."""
    global _latest
    if var is None or not tf.executing_eagerly():
        return
    with _lock:
        _latest = next(_count)
        _written[var] = _latest


def written_after(variables: Iterable[Any], since: int) -> List[Any]:
    """Those of `variables` (each checked by identity) written after generation `since`."""
    if _latest <= since:
        return []
    return [var for var in variables if _written.get(var, 0) > since]


def watch(var: Any) -> None:
    """Makes every write through `var`'s own `tf.Variable` write methods `note` it.

    Instance-level and idempotent: the variable's class is untouched, and
    a method already wrapped on this instance (`row_stamps.RowStamps.watch`)
    is wrapped once more, so both see the write.
    """
    if not isinstance(var, tf.Variable) or var in _watched:
        return
    ref = weakref.ref(var)  # No cycle: the wrappers live on `var` itself.
    for method in WRITE_METHODS:
        if getattr(type(var), method, None) is None:
            continue
        setattr(var, method, _noting(ref, getattr(var, method), method))
    _watched[var] = True


def levels(var: Any) -> List[Any]:
    """`var` and the variables inside its TF PS wrappers (Aggregating, Caching), outermost first."""
    found = [var]
    while isinstance(var, (ps_values.AggregatingVariable, ps_values.CachingVariable)) and \
            len(found) < 4:
        var = var.get()
        found.append(var)
    return found


def watch_levels(var: Any) -> None:
    """`watch`es `var` and every variable inside its wrappers (`levels`)."""
    for level in levels(var):
        watch(level)


def _noting(ref, original, method: str):
    def write(*args, **kwargs):
        result = original(*args, **kwargs)
        note(ref())
        return result

    write.__name__ = method
    return write
