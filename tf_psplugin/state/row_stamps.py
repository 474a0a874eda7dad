"""Which table rows changed since a save: row stamps on the PS, and which optimizers allow deltas.

Why this module exists: an incremental checkpoint (`incremental`) writes
only the rows changed since the previous save, so every write to a table
must leave a trace. `RowStamps` keeps, on a table shard's own PS, an int32
stamp per row; the optimizer's apply stamps the gradient's rows
(`HybridExtended.track_updated_rows` calls `RowStamps.mark` in the same
trace), and every other write through the shard's or its slots' own
`tf.Variable` methods (`set_weights`, `EarlyStopping(restore_best_weights=
True)`, a reset, an EMA overwrite, weight decay) stamps the rows it writes
(`RowStamps.watch`). `row_local_refusal` says which optimizers' sparse
updates write only the gradient's rows, so that deltas stay small.
"""

from typing import Optional

import tensorflow as tf

from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin.sync import outside_writes

__all__ = ["RowStamps", "row_local_refusal"]

# tf.Variable methods that write a whole value, rows by IndexedSlices, rows by nd indices.
_ROW_WRITES = outside_writes.ROW_WRITES
_ND_WRITES = outside_writes.ND_WRITES
# A variable whose writes stamp rows -> the `RowStamps` they stamp (`RowStamps.watch`).
_WATCHED: "IdentityMap[RowStamps]" = IdentityMap()


class RowStamps:
    """The rows of one table shard updated since a generation, tracked on its PS.

    `mark` runs inside the optimizer's apply to the shard (installed by
    `HybridExtended.track_updated_rows`): one ResourceScatterUpdate of the
    gradient's row ids with the PS's current generation.
    """

    def __init__(self, shard, generation: tf.Variable, stamps: tf.Variable):
        self.shard = shard
        self.generation = generation
        self.stamps = stamps
        self.device = shard.device

    def mark(self, gradient) -> None:
        """Stamps the rows `gradient` updates (every row for a dense gradient)."""
        with tf.device(self.device):
            generation = self.generation.read_value()
            constraint = getattr(self.shard, "constraint", None)
            if isinstance(gradient, tf.IndexedSlices) and constraint is None:
                self.mark_rows(gradient.indices)
            else:  # A dense gradient or a constraint may change every row.
                tf.raw_ops.AssignVariableOp(
                    resource=self.stamps.handle,
                    value=tf.fill(tf.shape(self.stamps), generation))

    def mark_rows(self, local: tf.Tensor):
        """Stamps the shard's `local` rows (1-D ids); the write op (None when eager)."""
        with tf.device(self.device):
            return tf.raw_ops.ResourceScatterUpdate(
                resource=self.stamps.handle, indices=local,
                updates=tf.fill(tf.shape(local)[:1], self.generation.read_value()))

    def mark_all(self):
        """Stamps every row of the shard (a write of its whole value)."""
        with tf.device(self.device):
            return tf.raw_ops.AssignVariableOp(
                resource=self.stamps.handle,
                value=tf.fill(tf.shape(self.stamps), self.generation.read_value()))

    def dirty_rows(self, since: int) -> tf.Tensor:
        """Local ids (int64) of the rows stamped at or after generation `since`."""
        with tf.device(self.device):
            return tf.reshape(tf.where(self.stamps >= since), [-1])

    def watch(self, var) -> None:
        """Makes every write through `var`'s own methods stamp the rows it writes.

        `var` is this shard or a slot of it (same rows). The optimizer's
        apply is stamped by `HybridExtended` (`mark`); every other write a
        user or Keras makes goes through a `tf.Variable` method: `assign*`
        (`set_weights`, `EarlyStopping(restore_best_weights=True)`, an EMA
        overwrite, a reset) stamps every row, `scatter_*` its rows. Each
        write gets its stamp in the same trace, so a write in a traced
        function is stamped each time it runs. Instance-level and
        idempotent: the variable's class is untouched; a method already
        wrapped on the instance (`outside_writes.watch`) is wrapped once
        more, so both see the write. Not seen: writes
        through raw ops on the variable's handle (a `tf.train.Checkpoint`
        restore); `CheckpointManager.restore` makes the next save full.
        """
        if _WATCHED.get(var) is self:
            return
        for method in outside_writes.WRITE_METHODS:
            if getattr(type(var), method, None) is not None:
                # On top of the instance's own wrapper (outside_writes), if any.
                setattr(var, method, self._watched(var, method, getattr(var, method)))
        _WATCHED[var] = self

    def _watched(self, var, method: str, original):
        del var  # `original` is bound to it.

        def write(*args, **kwargs):
            result = original(*args, **kwargs)
            first = args[0] if args else kwargs.get(
                "indices" if method in _ND_WRITES else "sparse_delta")
            if method in _ROW_WRITES and isinstance(first, tf.IndexedSlices):
                self.mark_rows(tf.reshape(tf.cast(first.indices, tf.int64), [-1]))
            elif method in _ND_WRITES and first is not None:
                indices = tf.convert_to_tensor(first)
                self.mark_rows(tf.reshape(tf.cast(indices[..., 0], tf.int64), [-1]))
            else:
                self.mark_all()
            return result

        write.__name__ = method
        return write


_LEGACY_ROW_LOCAL = ("SGD", "Adagrad", "Ftrl")


def row_local_refusal(optimizer) -> Optional[str]:
    """Why `optimizer`'s table updates cannot be saved as deltas; None when they can.

    Deltas stay small only if a sparse update writes the gradient's rows
    (and their slots) alone: Keras's legacy SGD, Adagrad and Ftrl; Keras's
    own (new) Adagrad; `tf_psplugin.LazyAdam`; and
    any optimizer whose class sets ``row_local_sparse_updates = True``;
    Keras's `LossScaleOptimizer` (``mixed_float16``) as its inner optimizer.
    (Every write reaches the next delta either way, see `RowStamps.watch`:
    this check keeps an optimizer that writes whole tables each step from
    making every delta as large as a full save.)
    """
    from tf_psplugin._internal.compat import keras  # pylint: disable=g-import-not-at-top

    fix = " Fix: use one of those, or drop full_every_saves."
    allowed = ("a sparse update must change only the gradient's rows: Keras's legacy "
               "SGD/Adagrad/Ftrl, Keras's Adagrad, "
               "tf_psplugin.LazyAdam, or an optimizer class with row_local_sparse_updates = "
               "True.")
    if optimizer is None:
        return "the checkpoint has no optimizer; " + allowed + fix
    name = type(optimizer).__name__
    inner = getattr(optimizer, "inner_optimizer", None)
    if name.startswith("LossScaleOptimizer") and inner is not None:
        # Keras's LossScaleOptimizer applies every gradient with its inner
        # optimizer, or none (a step with a non-finite gradient writes
        # nothing; the loss scale is not a table): its table writes are the
        # inner optimizer's.
        return row_local_refusal(inner)
    if getattr(type(optimizer), "row_local_sparse_updates", False) is True:
        return None
    if hasattr(optimizer, "get_slot_names"):  # Keras 2 legacy (optimizer_v2).
        if name in _LEGACY_ROW_LOCAL:
            return None
        if name == "Adam":
            return ("tf.keras.optimizers.legacy.Adam decays every table row's moments each "
                    "step, so every delta would hold whole tables. Fix: "
                    "tf_psplugin.LazyAdam (moments updated only for the looked-up rows), or "
                    "drop full_every_saves.")
        return f"{name}: " + allowed + fix
    extras = [f"{attr}={getattr(optimizer, attr)!r}" for attr in ("weight_decay", "use_ema")
              if getattr(optimizer, attr, None)]
    if extras:
        return (f"{name}({', '.join(extras)}) writes every row of every table each step. "
                f"Fix: drop {' and '.join(e.split('=')[0] for e in extras)}, or drop "
                "full_every_saves.")
    kind = type(optimizer)
    if kind is keras.optimizers.Adagrad:
        return None
    if kind is keras.optimizers.SGD:
        # Even with momentum=0 it keeps a momentum slot and, for a sparse
        # gradient, assigns it and the table whole (m = m * momentum; var += m).
        return ("Keras's SGD (tf.keras.optimizers.SGD) assigns every table row and its "
                "momentum slot each step, even with momentum=0. Fix: "
                "tf.keras.optimizers.legacy.SGD (row-local sparse update, also with momentum), "
                "or drop full_every_saves.")
    if kind is keras.optimizers.Adam or name == "Adam":
        return ("Keras's Adam (tf.keras.optimizers.Adam) decays every table row's moments "
                "each step, so every delta would hold whole tables. Fix: "
                "tf_psplugin.LazyAdam (moments updated only for the looked-up rows; see "
                "docs/checkpoints.md for how it differs), or drop full_every_saves.")
    if kind is keras.optimizers.Ftrl:
        return ("Keras's Ftrl (tf.keras.optimizers.Ftrl) computes its update densely and "
                "assigns every table row each step. Fix: tf.keras.optimizers.legacy.Ftrl "
                "(row-local sparse update), or drop full_every_saves.")
    return f"{name}: " + allowed + fix
