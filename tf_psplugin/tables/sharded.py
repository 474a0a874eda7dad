"""Interleaved ("mod") sharding of embedding tables across PS tasks.

Why this module exists: TensorFlow's `ShardedVariable` stores contiguous row
ranges per shard (the "div" layout), so the Zipf-hot small ids of a
frequency-sorted vocabulary all land on shard 0 and one PS task serves most
lookups (TensorFlow issue 45291). `InterleavedShardedVariable` stores logical
row ``i`` on shard ``i % n`` at position ``i // n`` instead, which spreads hot
ids evenly, and hides the layout: lookups, tensor conversion, `assign`,
indexing and checkpoints all behave as if the table were one ``[V, D]``
variable in logical row order.

What makes that transparent, and where it touches TensorFlow internals
(everything checked against TF 2.15.1; each use says why the public API is not
enough):

* Lookups: `tf.experimental.dispatch_for_api` overrides the embedding lookup
  APIs for this type and calls them on the shard list with
  ``partition_strategy="mod"``. Type-based dispatch is tried before the
  fallback `dispatch_for_types` that `ShardedVariable` registers for
  `embedding_lookup` (see `add_dispatch_support` in util/dispatch.py). The one
  exception is v1 `safe_embedding_lookup_sparse`, for which TF registers a
  type-based dispatcher on `ShardedVariable` itself; two matching type-based
  targets are an error ("Multiple dispatch targets ..."), not an override, so
  the patch ``safe_embedding_lookup_v1`` (`lookups.patch_safe_lookup_v1`) swaps TF's target for one that is
  identical for a plain `ShardedVariable` and uses "mod" for ours. It runs when
  the first interleaved table is built, never at import.
* Tensor conversion: a conversion function with a smaller priority number
  than `ShardedVariable`'s (`tf.register_tensor_conversion_function`).
  Operators and `numpy()` are re-bound because `ShardedVariable` calls its
  module-level converter directly.
* Checkpoints: `_gather_saveables_for_checkpoint` (what `ShardedVariable`
  uses in 2.15) returns one `SaveableObject` with a `SaveSpec` per shard, each
  writing a contiguous LOGICAL row range as a slice of the full ``[V, D]``
  tensor under the usual variable key, computed on that shard's device.
  `SaveableObject`/`SaveSpec` are private (tensorflow.python.training.saving):
  there is no public way to write a sliced tensor lazily, and the lazy
  `SaveSpec` callable is what keeps a restore from running the save gathers.
"""

import contextlib
import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import CheckpointInitialValueCallable, trackable_base
from tf_psplugin._internal.tf_internal import resource_variable_ops, saveable_object, sharded_variable
from tf_psplugin.tables import half_precision
from tf_psplugin.tables.layout import (  # noqa: F401  (re-exported: sharding's public API)
    _interleave, _range_plan, logical_rows_of_shard, shard_lookup_counts, shard_rows)
from tf_psplugin.tables.placement import SHARDING_INTERLEAVED

__all__ = [
    "InterleavedShardedVariable",
    "create_interleaved",
    "shard_value_fn",
    "logical_rows_of_shard",
    "shard_lookup_counts",
    "shard_rows",
]

# ----------------------------------------------------------------------------
# The variable.
# ----------------------------------------------------------------------------


class InterleavedShardedVariableSpec(sharded_variable.ShardedVariableSpec):
    """TypeSpec that rebuilds an `InterleavedShardedVariable` (not a contiguous one).

    Without it, passing the table through `tf.nest` with
    ``expand_composites=True`` or as a `tf.function` argument would hand back a
    plain `ShardedVariable` and silently switch to the contiguous layout.
    """

    __slots__ = []

    value_type = property(lambda self: InterleavedShardedVariable)

    def _from_components(self, variables):
        return InterleavedShardedVariable(list(variables))


class InterleavedShardedVariable(sharded_variable.ShardedVariable):
    """ShardedVariable whose shard s holds logical rows s, s+n, s+2n, ... .

    Build it from shard variables already laid out interleaved (shard ``s``
    holds ``full[s::n]``); the first ``V % n`` shards have one extra row. It
    then reads, looks up, assigns and checkpoints in LOGICAL row order, and a
    checkpoint restores into any number of shards, into a contiguous
    `ShardedVariable` or into a plain ``[V, D]`` variable.

    Example:

    ```python
    full = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    table = InterleavedShardedVariable(
        [tf.Variable(full[s::3]) for s in range(3)], name="emb")
    tf.nn.embedding_lookup(table, [7, 0])   # == full[[7, 0]]
    table.numpy()                           # == full
    tf.train.Checkpoint(emb=table).write("/tmp/ckpt")  # logical [10, 2] tensor
    ```

    v1 lookups (`tf.compat.v1.nn.embedding_lookup` and the sparse variants)
    always use the table's own "mod" layout, whatever ``partition_strategy``
    the caller passes: callers pass "div" meaning "the params' layout", as
    `tf.nn.embedding_lookup` itself does.

    Not supported: ``as_ref`` conversion (raises NotImplementedError); slice
    assignment (``table[2:4]`` is a Tensor: use `assign` or `scatter_update`);
    iterating yields the shard variables, as for `ShardedVariable`.

    Subclass hooks (`stacking.StackedTable`, a table stored inside shards that
    hold other tables' rows too): `row_offsets`, `stack`, `views`, `_physical_ids`,
    `shares_shards`, `with_variables` and `_write_shard`. Reads, lookups,
    writes, scatters, checkpoints and copies are written once, here, in
    their terms.
    """

    def __init__(self, variables, name="ShardedVariable"):
        super().__init__(variables, name=name)
        n = len(self._variables)
        sizes = [int(v.shape[0]) for v in self._variables]
        expected = shard_rows(int(self._shape[0]), n, SHARDING_INTERLEAVED)
        if sizes != expected:
            raise ValueError(
                f"InterleavedShardedVariable {name!r}: shard row counts {sizes} do not match "
                f"the interleaved layout of {int(self._shape[0])} rows over {n} shards, "
                f"which needs {expected} (shard s holds rows s, s+{n}, ...). Fix: build the "
                "shards with create_interleaved() or slice the full value as value[s::n]."
            )
        patches.install("safe_embedding_lookup_v1")

    @property
    def _unique_id(self):
        # ShardedVariable derives its id from shard 0's by replacing "part_0";
        # a shard not named ".../part_0" would share shard 0's id, and Keras
        # optimizers key slots by it (get_slot then recurses forever).
        shard_id = tf_objects.variable_unique_id(self._variables[0])
        if "part_0" in shard_id:
            return shard_id.replace("part_0", "sharded")
        return shard_id + "_interleaved_table"

    # -- the layout hooks (a whole table: its shards hold it alone) -------------

    @property
    def shares_shards(self) -> bool:
        """True if the shard variables hold other tables' rows too (a stacked table).

        Such a table reads its shards even inside `tf.saved_model.save`, where
        `variables` is the one saving variable, and names itself as its
        checkpoint saveable's op (its stack's tables share shard 0).
        """
        return False

    @property
    def row_offsets(self) -> tuple:
        """Row of each shard where this table's rows start: 0 for a whole table."""
        return (0,) * len(self._variables)

    @property
    def stack(self):
        """The `stacking.TableStack` whose shards hold this table; None for a whole table."""
        return None

    @property
    def views(self) -> Optional[list]:
        """Per shard, a variable of this table's rows alone (a stacked table's `TableView`s).

        None for a whole table: its shard variables are its own, and lookups,
        gradients and Keras use them.
        """
        return None

    def _physical_ids(self, ids):
        """Logical ids -> ids whose "mod" lookup on the shards finds this table's rows."""
        return ids

    def _row_variables(self):
        """The variables this table's rows are read from (`shares_shards`)."""
        return self._variables if self.shares_shards else self.variables

    def with_variables(self, variables, name: Optional[str] = None) -> "InterleavedShardedVariable":
        """The same rows of other shard variables (e.g. an optimizer's slots, a CPU copy)."""
        return InterleavedShardedVariable(variables, name=name or self.name)

    # -- TypeSpec / async checkpoint copies keep the subclass ------------------

    @property
    def _type_spec(self):
        return InterleavedShardedVariableSpec(
            *(resource_variable_ops.VariableSpec(v.shape, v.dtype) for v in self._variables)
        )

    def _copy_trackable_to_cpu(self, object_map):
        """For async checkpointing: like `ShardedVariable`'s, but keeps the layout."""
        copies = []
        for v in self._variables:
            # Every time, as TF's ShardedVariable does: a copy made by an
            # earlier save must get this save's values (a stack's shared
            # shards are copied once per table of the stack).
            tf_objects.copy_trackable_to_cpu(v, object_map)
            copies.append(object_map[v])
        if self not in object_map:
            object_map[self] = self.with_variables(copies)

    # -- reads in logical order -----------------------------------------------

    def _logical_value(self) -> tf.Tensor:
        """The whole table in logical order (materialises it where called)."""
        # `self.variables` is [full saving variable] inside tf.saved_model.save,
        # a one-shard layout for which interleaving is the identity.
        shards = self.variables
        pieces = [tf.convert_to_tensor(v) for v in shards]
        counts = [int(v.shape[0]) for v in shards]
        return _interleave(pieces, counts, int(self._shape[0]))

    def _read_rows(self, begin: int, end: int) -> tf.Tensor:
        """Logical rows ``[begin, end)``, reading only those rows from each shard."""
        shards = self._row_variables()
        plan = _range_plan(len(shards), begin, end)
        pieces = _read_planned(shards, self.row_offsets, plan)
        return _interleave(pieces, [count for _, _, count in plan], end - begin)

    def value(self):
        """Returns the table as one Tensor in logical row order."""
        return self._logical_value()

    def read_value(self):
        """Returns the table as one Tensor in logical row order."""
        return self._logical_value()

    def numpy(self):
        """Returns the table as a numpy array in logical row order."""
        return self._logical_value().numpy()

    def _shape_only_lookup(self, ids, max_norm=None):
        """Rows of the right shape and no value, where only the shape is asked, else None.

        A `stacking.StackedTable` returns them while Keras infers a
        layer's output shape, so that building a model does not make its
        stack's variables table by table.
        """
        del ids, max_norm
        return None

    def sparse_read(self, indices, name=None):
        """Gathers logical rows ``indices`` (any shape); gradients are IndexedSlices."""
        return tf.compat.v1.nn.embedding_lookup(
            self._row_variables(), self._physical_ids(indices), "mod", name=name)

    def __getitem__(self, slice_spec):
        """Indexes the table like a Tensor in logical order.

        An int, a scalar int Tensor or a Python slice in the first position
        reads only the rows needed; anything else (Ellipsis, newaxis, boolean
        masks) converts the whole table first, as `ShardedVariable` does.
        """
        if (
            isinstance(slice_spec, bool)
            or (isinstance(slice_spec, tf.Tensor) and slice_spec.dtype == tf.bool)
            or (isinstance(slice_spec, np.ndarray) and slice_spec.dtype == bool)
        ):
            return tf.boolean_mask(self._logical_value(), slice_spec)
        spec = tuple(slice_spec) if isinstance(slice_spec, (list, tuple)) else (slice_spec,)
        if not spec:
            return self._logical_value()
        first, rest = spec[0], spec[1:]
        num_rows = int(self._shape[0])
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            row = int(first) + (num_rows if first < 0 else 0)
            if not 0 <= row < num_rows:
                raise IndexError(f"Row index {int(first)} out of bounds for {num_rows} rows.")
            result = self.sparse_read(tf.constant([row], tf.int64))[0]
            return result[rest] if rest else result
        if isinstance(first, tf.Tensor) and first.shape.rank == 0 and first.dtype.is_integer:
            result = self.sparse_read(tf.reshape(first, [1]))[0]
            return result[rest] if rest else result
        if isinstance(first, slice) and all(
            x is None or (isinstance(x, (int, np.integer)) and not isinstance(x, bool))
            for x in (first.start, first.stop, first.step)
        ):
            rows = range(num_rows)[first]
            if len(rows) == 0:
                result = tf.zeros([0] + self._shape[1:].as_list(), dtype=self._dtype)
            elif rows.step == 1:
                result = self._read_rows(rows.start, rows.stop)
            else:
                ids = tf.range(rows.start, rows.stop, rows.step, dtype=tf.int64)
                result = self.sparse_read(ids)
            return result[(slice(None),) + rest] if rest else result
        return self._logical_value()[slice_spec]

    # -- writes in logical order ----------------------------------------------

    def _per_shard(self, value, op_name):
        value = tf.convert_to_tensor(value, dtype=self._dtype)
        if not value.shape.is_compatible_with(self._shape):
            raise ValueError(
                f"InterleavedShardedVariable.{op_name}: value of shape {value.shape} does not "
                f"match the table's logical shape {self._shape}."
            )
        n = len(self._variables)
        # The strided slice runs where `value` lives; only shard s's rows reach shard s.
        return [value[s::n] for s in range(n)]

    def _write(self, value, method: str, use_locking):
        """Writes a full LOGICAL value with `method` (assign, assign_add, assign_sub)."""
        for s, part in enumerate(self._per_shard(value, method)):
            self._write_shard(s, part, method, use_locking)
        return self

    def _write_shard(self, s: int, part, method: str, use_locking) -> None:
        """Writes shard ``s``'s rows of a logical value: the whole shard, for a whole table."""
        getattr(self._variables[s], method)(part, use_locking=use_locking)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Assigns a full LOGICAL ``[V, ...]`` value (this table's rows only); returns self."""
        return self._write(value, "assign", use_locking)

    def assign_add(self, delta, use_locking=False, name=None, read_value=True):
        """Adds a full LOGICAL ``[V, ...]`` delta; returns self."""
        return self._write(delta, "assign_add", use_locking)

    def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
        """Subtracts a full LOGICAL ``[V, ...]`` delta; returns self."""
        return self._write(delta, "assign_sub", use_locking)

    def _decompose_indices(self, indices):
        """Logical ids -> (per-shard local ids, shard of each id), "mod" layout.

        `ShardedVariable`'s scatter_* methods call this, so they follow it.
        The ids are mapped by `_physical_ids` first, so that an id outside
        ``[0, V)`` of a stacked table stays out of every shard's range (a
        scatter then fails as it does on a whole table).
        """
        indices = self._physical_ids(indices)
        if indices.shape.rank != 1:
            raise ValueError(
                f"InterleavedShardedVariable: scatter indices must be 1-D, got {indices.shape}."
            )
        n = len(self._variables)
        owner = tf.cast(indices % n, tf.int32)
        local = tf.dynamic_partition(indices // n, owner, n)
        return local, owner

    # -- checkpointing --------------------------------------------------------

    def _gather_saveables_for_checkpoint(self):
        """Saves the full LOGICAL table as n contiguous row-range slices.

        Slice ``c`` is the logical row range as large as shard ``c``; it is
        assembled on shard ``c``'s device from the matching rows of every
        shard, so no task ever holds more than one slice. On restore, RestoreV2
        reads those ranges (for the current shard count) from a tensor saved
        whole or in any slicing, and each range is scattered to its owners.
        """

        def _saveable_factory(name=self.name):
            return _LogicalTableSaveable(list(self._variables), self.name, name,
                                         row_offsets=self.row_offsets,
                                         num_rows=int(self._shape[0]),
                                         op=self if self.shares_shards else None)

        return {trackable_base.VARIABLE_VALUE_KEY: _saveable_factory}


class _LogicalTableSaveable(saveable_object.SaveableObject):
    """One saveable, one `SaveSpec` per logical slice, each on its own device.

    A single object (not one per slice, as `ShardedVariable` returns) because
    TF keys restore ops by saveable name in graph mode, where same-named
    saveables lose all but the last op, and `tf.compat.v1.train.Saver` needs
    a saveable, not a list. TF2's `MultiDeviceSaver` groups SaveSpecs by
    their own device, so each slice is still written by its shard's task.
    """

    def __init__(self, shards, full_name, name, row_offsets=None, num_rows=None, op=None):
        # A stacked table's rows start at `row_offsets[s]` in shard s (see
        # tables/stacking.py); a whole table's at 0. TF refuses two saveables
        # with the same `op` (shards[0] by default): a stacked table passes
        # itself, since its stack's tables share their shards.
        self._shards = shards
        self._offsets = list(row_offsets) if row_offsets is not None else [0] * len(shards)
        if num_rows is None:
            num_rows = sum(int(v.shape[0]) for v in shards)
        full_shape = [num_rows] + shards[0].shape[1:].as_list()
        self._plans = []
        specs = []
        begin = 0
        for c, size in enumerate(shard_rows(num_rows, len(shards), SHARDING_INTERLEAVED)):
            info = tf.Variable.SaveSliceInfo(
                full_name=full_name,
                full_shape=full_shape,
                var_offset=[begin] + [0] * (len(full_shape) - 1),
                var_shape=[size] + full_shape[1:],
            )
            plan = _range_plan(len(shards), begin, begin + size)
            self._plans.append(plan)
            specs.append(
                saveable_object.SaveSpec(
                    functools.partial(self._slice_tensor, c, size),
                    info.spec,
                    name,
                    # A half-precision table is saved as float32 (half_precision).
                    dtype=half_precision.float32_for_checkpoint(shards[c].dtype),
                    device=shards[c].device,
                )
            )
            begin += size
        super().__init__(op if op is not None else shards[0], specs, name)

    def _slice_tensor(self, c, size):
        """Builds slice ``c`` on shard ``c``'s device (None: not initialized)."""
        shards = self._shards
        if tf.executing_eagerly() and not all(v.is_initialized() for v in shards):
            return None  # Like ResourceVariableSaveable: recorded, no value saved.
        pieces = _read_planned(shards, self._offsets, self._plans[c], on_shard_devices=True)
        with tf.device(shards[c].device):
            counts = [count for _, _, count in self._plans[c]]
            value = _interleave(pieces, counts, size)
            return tf.identity(tf.cast(value, half_precision.float32_for_checkpoint(value.dtype)))

    def restore(self, restored_tensors, restored_shapes):
        """Scatters each restored logical slice into the shards that own its rows."""
        n = len(self._shards)
        assign_ops = []
        for c, value in enumerate(restored_tensors):
            if restored_shapes is not None:
                value = tf.reshape(value, restored_shapes[c])
            for j, (s, first, count) in enumerate(self._plans[c]):
                if not count:
                    continue
                with tf.device(self._shards[c].device):
                    piece = value[j::n]  # Cut where the slice was read; ship only s's rows.
                    # A checkpoint of another dtype (float32 into half precision, rounded).
                    piece = tf.cast(piece, self._shards[s].dtype)
                start = first + self._offsets[s]
                with tf.device(self._shards[s].device):
                    updated = self._shards[s].scatter_update(
                        tf.IndexedSlices(piece, tf.range(start, start + count, dtype=tf.int64))
                    )
                if not tf.executing_eagerly():
                    assign_ops.append(updated.op)
        return tf.group(*assign_ops) if assign_ops else None


def _read_planned(shards, offsets, plan, on_shard_devices: bool = False):
    """Each ``(s, first, count)`` of a `_range_plan`: that many rows of shard s.

    Args:
        shards: The shard variables.
        offsets: Row of each shard where the table's rows start.
        plan: ``(shard, first local row, count)`` triples.
        on_shard_devices: Build each read (and its ids) on its shard's device.

    Returns:
        One ``[count, ...]`` tensor per plan entry.
    """
    pieces = []
    for s, first, count in plan:
        with tf.device(shards[s].device) if on_shard_devices else contextlib.nullcontext():
            start = first + offsets[s]
            pieces.append(shards[s].sparse_read(tf.range(start, start + count, dtype=tf.int64)))
    return pieces


def _to_tensor(var, dtype=None, name=None, as_ref=False):
    """Tensor conversion in LOGICAL row order."""
    del name
    if dtype is not None and not dtype.is_compatible_with(var.dtype):
        raise ValueError(
            f"Incompatible type conversion requested to type {dtype.name!r} for "
            f"InterleavedShardedVariable of type {var.dtype.name!r}."
        )
    if as_ref:
        raise NotImplementedError(
            "InterleavedShardedVariable cannot be used as a reference (as_ref=True)."
        )
    return var._logical_value()  # pylint: disable=protected-access


# Priority 90 runs before ShardedVariable's converter (default 100), which
# would concatenate the shards in physical order.
tf.register_tensor_conversion_function(InterleavedShardedVariable, _to_tensor, priority=90)


def _bind_operator(operator):
    tensor_operator = getattr(tf.Tensor, operator)

    def _operator(v, *args, **kwargs):
        value = v._logical_value()  # pylint: disable=protected-access
        return tensor_operator(value, *args, **kwargs)

    setattr(InterleavedShardedVariable, operator, _operator)


# ShardedVariable's operators call its own converter directly (physical
# order); re-bind them for the subclass.
for _op in tf.Tensor.OVERLOADABLE_OPERATORS:
    if _op != "__getitem__":
        _bind_operator(_op)


# ----------------------------------------------------------------------------
# Creation.
# ----------------------------------------------------------------------------


def _unwrap_partial(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _shard_value_fn(initial_value, full_shape, dtype, shard, num_shards, shard_shape, name):
    """Returns a zero-argument callable producing shard ``shard``'s initial rows."""
    if tf_objects.takes_no_required_args(initial_value):
        call = initial_value
    else:
        call = functools.partial(initial_value, full_shape, dtype=dtype)

    def _value():
        # Random Keras initializers honour partition_shape and generate only this
        # shard's rows; partition_offset only seeds them differently per shard
        # (an interleaved shard has no contiguous offset).
        # Tuples, as TF's ParameterServerStrategy passes: Keras hashes the offset.
        offset = (shard,) + (0,) * (len(shard_shape) - 1)
        try:
            value = call(partition_shape=tuple(shard_shape), partition_offset=offset)
        except (TypeError, ValueError):  # Does not take partition kwargs: build the full value.
            value = None
        if value is None or list(tf.convert_to_tensor(value).shape) != list(shard_shape):
            if shard == 0:
                logging.warning(
                    "tf_psplugin: the initializer of table %r does not support partitioning; "
                    "building the full value and slicing it for each shard.",
                    name,
                )
            value = tf.convert_to_tensor(call(), dtype=dtype)[shard::num_shards]
        return tf.convert_to_tensor(value, dtype=dtype)

    return _value


def _slice_of(initial_value, shard: int, num_shards: int, dtype):
    """Shard `shard`'s rows of a full initial value (numpy or tensor)."""
    if isinstance(initial_value, np.ndarray):
        return initial_value[shard::num_shards].astype(dtype.as_numpy_dtype, copy=False)
    return tf.cast(initial_value[shard::num_shards], dtype)


def _shard_initial_value(initial_value, full_shape, dtype, shard: int, num_shards: int,
                         name: str):
    """Shard `shard`'s initial value, as `create_interleaved` hands it to the creator.

    None stays None (creators that load SavedModels); a
    `CheckpointInitialValueCallable` gives zeros (the restore fills the table
    through its saveable); a callable initializer a callable of this shard's
    rows (`_shard_value_fn`); a full value (numpy or tensor) its rows
    ``[shard::num_shards]``, as a value.
    """
    shard_shape = [shard_rows(full_shape[0], num_shards, SHARDING_INTERLEAVED)[shard]] + \
        full_shape[1:]
    if initial_value is None:
        return None
    if isinstance(_unwrap_partial(initial_value), CheckpointInitialValueCallable):
        return functools.partial(tf.zeros, shard_shape, dtype=dtype)
    if callable(initial_value):
        return _shard_value_fn(initial_value, full_shape, dtype, shard, num_shards, shard_shape,
                               name)
    return _slice_of(initial_value, shard, num_shards, dtype)


def shard_value_fn(initial_value, shape, dtype, shard: int, *, num_shards: int,
                   name: str) -> Callable[[], tf.Tensor]:
    """A zero-argument callable for shard `shard`'s initial rows of an interleaved table.

    `initial_value` is what a variable creator receives: a callable
    initializer (called per shard, as in `create_interleaved`), a
    `CheckpointInitialValueCallable` (zeros: the restore fills the table
    through its saveable) or a full value (sliced ``[shard::num_shards]``
    when the callable runs). The same values as `create_interleaved`'s
    shards (`_shard_initial_value`), always as a callable.
    """
    dtype = tf.as_dtype(dtype)
    full_shape = tf.TensorShape(shape).as_list()
    if callable(initial_value) or isinstance(_unwrap_partial(initial_value),
                                             CheckpointInitialValueCallable):
        return _shard_initial_value(initial_value, full_shape, dtype, shard, num_shards, name)
    value = initial_value
    if not isinstance(value, (np.ndarray, tf.Tensor)):
        value = tf.convert_to_tensor(value, dtype=dtype)
    return lambda: tf.convert_to_tensor(
        _shard_initial_value(value, full_shape, dtype, shard, num_shards, name), dtype=dtype)


def create_interleaved(
    name: str,
    shape,
    dtype,
    initial_value,
    num_shards: int,
    device_fn: Callable[[int], Optional[str]],
    creator: Callable[..., tf.Variable],
) -> InterleavedShardedVariable:
    """Builds an interleaved table from ``num_shards`` shard variables.

    Shard ``s`` is created by ``creator(name=f"{name}/part_{s}", shape=...,
    initial_value=...)`` (exactly those keyword arguments: bind ``dtype``,
    ``trainable`` and the like with `functools.partial`) inside
    ``tf.device(device_fn(s))``.

    Example:

    ```python
    table = create_interleaved(
        "emb", [1000, 16], tf.float32, tf.keras.initializers.RandomUniform(),
        num_shards=2, device_fn=lambda s: f"/job:ps/task:{s}",
        creator=lambda **kw: tf.Variable(**kw))
    ```

    Args:
        name: Table name; shards are ``name/part_s``.
        shape: Logical shape ``[V, ...]``, fully defined.
        dtype: Element dtype.
        initial_value: One of
            (a) a callable initializer: either ``f(shape, dtype=...)`` such as a
            Keras initializer, or a zero-argument callable such as the
            ``functools.partial(initializer, shape, dtype=dtype)`` Keras hands a
            variable creator. It is called per shard with ``partition_shape``/
            ``partition_offset``; initializers that accept them (Keras random
            ones) generate only that shard's rows. Others build the full value,
            which is sliced ``[s::n]`` (logged once).
            (b) a full tensor / numpy value, sliced ``value[s::n]`` up front.
            (c) a `CheckpointInitialValueCallable` (restore-on-create): shards
            start at zeros and the checkpoint restores into them through the
            sliced restore path when the table is tracked (as Keras'
            ``add_weight`` does), because an interleaved shard is not a
            contiguous slice the initial-value path could read.
            (d) None: passed through for creators that load SavedModels.
        num_shards: Requested shards; capped at ``V`` so none is empty.
        device_fn: Maps a shard index to a device string (or None).
        creator: Builds one shard variable.

    Returns:
        The `InterleavedShardedVariable`.

    Raises:
        ValueError: If the shape is not fully defined or has rank 0.
    """
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 1 or not shape.is_fully_defined():
        raise ValueError(f"create_interleaved({name!r}): need a fully defined shape, got {shape}.")
    dtype = tf.as_dtype(dtype)
    full_shape = shape.as_list()
    num_rows = full_shape[0]
    if num_rows < 1:
        raise ValueError(f"create_interleaved({name!r}): the table needs at least one row.")
    n = max(1, min(int(num_shards), num_rows))
    sizes = shard_rows(num_rows, n, SHARDING_INTERLEAVED)

    if not callable(initial_value) and initial_value is not None:
        if not isinstance(initial_value, (np.ndarray, tf.Tensor)):
            initial_value = tf.convert_to_tensor(initial_value, dtype=dtype)
        if list(initial_value.shape) != full_shape:
            raise ValueError(
                f"create_interleaved({name!r}): initial value of shape "
                f"{list(initial_value.shape)} does not match shape {full_shape}."
            )

    shards = []
    for s in range(n):
        shard_shape = [sizes[s]] + full_shape[1:]
        value = _shard_initial_value(initial_value, full_shape, dtype, s, n, name)
        with tf.device(device_fn(s)):
            shards.append(creator(name=f"{name}/part_{s}", shape=shard_shape, initial_value=value))
    return InterleavedShardedVariable(shards, name=name)

