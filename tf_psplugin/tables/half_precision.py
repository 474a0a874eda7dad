"""Tables stored in half precision: rows in bfloat16 or float16, updates computed in float32.

Why this module exists: a CTR model's PS memory is its tables, and a
lookup's bytes are its rows. ``HybridOptions(table_dtype="bfloat16")``
(or ``"float16"``) stores every float32 embedding table in that dtype on
the PS, so the table takes half the memory and a lookup sends half the
bytes. What needs more precision stays float32:

* **Optimizer slots** of a half-precision table are float32 (`slot_kwargs`):
  an Adagrad accumulator summing squared gradients in bfloat16 (8
  significant bits) stops growing once it is 256 times larger than a new
  term, and Adam's second moment underflows in float16.
* **The update** is computed in float32 and rounded once into the
  half-precision rows (`HalfPrecisionRows`): the optimizer's apply sees a
  float32 variable; each of its writes reads the rows it changes, converts
  them to float32, applies the change and writes them back rounded to the
  table's dtype (round to nearest even). The gradient it is given (the
  table's dtype, as TensorFlow derives it from a half-precision gather) is
  converted to float32 first.
* **Checkpoints** hold a half-precision table's rows as float32 (its
  logical value: `float32_for_checkpoint`), so a checkpoint restores into a
  float32 table, a plain single-process model (`load_into`) or an export,
  and a float32 checkpoint restores into a half-precision table (rounded).

Only Keras's optimizers of ``tf.keras.optimizers`` (not ``.legacy``) update
a half-precision table: their update is written with the variable's
methods, which `HalfPrecisionRows` computes in float32. A legacy
optimizer's fused kernel takes the table's handle, whose dtype must equal
its slots' (float32): `HalfPrecisionRows.handle` refuses it with the fix.
"""

import functools
from typing import Optional

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import CheckpointInitialValueCallable
from tf_psplugin.errors import StrategyError

HALF_DTYPES = (tf.bfloat16, tf.float16)
TABLE_DTYPES = tuple(d.name for d in HALF_DTYPES)


def is_half(dtype) -> bool:
    """Whether `dtype` (a `tf.DType`, a name or None) is bfloat16 or float16."""
    if dtype is None:
        return False
    return tf.as_dtype(dtype).base_dtype in HALF_DTYPES


def check_table_dtype(table_dtype: Optional[str]) -> None:
    """Raises `StrategyError` unless `table_dtype` is None, "bfloat16" or "float16"."""
    if table_dtype is not None and table_dtype not in TABLE_DTYPES:
        raise StrategyError(
            f"table_dtype={table_dtype!r} is not supported. Fix: use None (tables in the "
            f"dtype their layer asks for), or one of {', '.join(map(repr, TABLE_DTYPES))}.")


def storage_dtype(requested, table_dtype: Optional[str]) -> Optional[tf.DType]:
    """The dtype a table requested as `requested` is stored in, or None to keep it.

    Only float32 tables are stored in `table_dtype`: a table asked for in
    another dtype (float64, an integer table, one already half) keeps it.
    """
    if table_dtype is None or requested is None:
        return None
    if tf.as_dtype(requested).base_dtype != tf.float32:
        return None
    return tf.as_dtype(table_dtype)


def cast_initial_value(initial_value, dtype: tf.DType):
    """`initial_value` (a value or an initializer callable) giving `dtype` values.

    A callable keeps its calling convention (no argument, or Keras's
    ``(shape, dtype=...)`` and the partition keywords), is called for the
    dtype it was made for and cast: a random initializer draws the same
    numbers as for the original dtype, rounded. A
    `CheckpointInitialValueCallable` (restore-on-create) is returned as is:
    its table starts at zeros of `dtype` and the restore fills it.
    """
    inner = initial_value
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, CheckpointInitialValueCallable):
        return initial_value
    target = dtype
    if not callable(initial_value):
        return tf.cast(initial_value, target)
    if tf_objects.takes_no_required_args(initial_value):

        def value(**kwargs):
            return tf.cast(initial_value(**kwargs), target)
    else:

        def value(shape, dtype=None, **kwargs):  # pylint: disable=unused-argument
            return tf.cast(initial_value(shape, dtype=tf.float32, **kwargs), target)

    return value


# Keras's new optimizers name a variable's moving average (``use_ema=True``)
# "average/<variable>" (``add_variable_from_reference(var, "average")``;
# checked on Keras 2.15 and tf-keras 2.21).
_EMA_SLOT_PREFIX = "average/"


def slot_kwargs(kwargs: dict) -> dict:
    """A half-precision table's slot creation kwargs, made float32 (see the module doc).

    Raises:
        StrategyError: the slot is a Keras optimizer's moving average
            (``use_ema=True``): Keras updates it as ``momentum * average +
            (1 - momentum) * var`` with the table's own half-precision rows
            and writes it back into them, which the float32 face of
            `HalfPrecisionRows` does not cover; refused when the optimizer
            makes its slots (before its first step).
    """
    if str(kwargs.get("name") or "").startswith(_EMA_SLOT_PREFIX):
        raise StrategyError(
            f"an optimizer with use_ema=True (its moving average "
            f"{kwargs.get('name')!r}) of a table stored in half precision "
            "(HybridOptions.table_dtype) is not supported: Keras averages the table's "
            "half-precision rows with a float32 average. Fix: drop use_ema, or "
            "table_dtype=None.")
    kwargs = dict(kwargs)
    kwargs["dtype"] = tf.float32
    if kwargs.get("initial_value") is not None:
        kwargs["initial_value"] = cast_initial_value(kwargs["initial_value"], tf.float32)
    return kwargs


def float32_for_checkpoint(dtype: tf.DType) -> tf.DType:
    """The dtype a table of `dtype` is saved in: float32 for a half-precision table."""
    return tf.float32 if is_half(dtype) else dtype


def to_float32(value):
    """A half-precision gradient (tensor or `IndexedSlices`) as float32; anything else as is."""
    if isinstance(value, tf.IndexedSlices) and is_half(value.values.dtype):
        return tf.IndexedSlices(tf.cast(value.values, tf.float32), value.indices,
                                value.dense_shape)
    if isinstance(value, tf.Tensor) and is_half(value.dtype):
        return tf.cast(value, tf.float32)
    return value


def float32_update(fn):
    """`fn(var, *args)` of an optimizer's apply, run on a half-precision shard in float32."""

    @functools.wraps(fn)
    def update(var, *args, **kwargs):
        args = tf.nest.map_structure(to_float32, args, expand_composites=False)
        kwargs = tf.nest.map_structure(to_float32, kwargs, expand_composites=False)
        return fn(HalfPrecisionRows(var), *args, **kwargs)

    return update


class HalfPrecisionRows:
    """A half-precision table shard as its optimizer's apply sees it: a float32 variable.

    Reads give the rows converted to float32. Each write computes in
    float32 and rounds once into the shard's dtype: a scatter reads only
    the rows it changes. The optimizer finds its float32 slots by this
    object's `_unique_id`, which is the shard's.

    Example:

    ```python
    shard = tf.Variable(tf.zeros([4, 2], tf.bfloat16))
    rows = HalfPrecisionRows(shard)
    rows.scatter_add(tf.IndexedSlices(tf.fill([1, 2], 1e-3), [2]))  # float32 maths
    ```

    Args:
        variable: The half-precision shard (a resource variable).
    """

    # Attributes read from the shard itself (its identity for the optimizer).
    _FORWARDED = ("name", "shape", "device", "trainable", "constraint", "_unique_id",
                  "_shared_name", "_in_graph_mode", "_distributed_container", "op", "graph",
                  "synchronization", "aggregation", "get_shape")

    def __init__(self, variable):
        self._variable = variable

    def __getattr__(self, name):
        if name in HalfPrecisionRows._FORWARDED:
            return getattr(self._variable, name)
        raise AttributeError(f"HalfPrecisionRows of {self._variable.name} has no {name!r}")

    @property
    def dtype(self):
        return tf.float32

    @property
    def variable(self):
        """The half-precision shard."""
        return self._variable

    @property
    def handle(self):
        raise StrategyError(
            f"table shard {self._variable.name} is stored in {self._variable.dtype.name} "
            "(HybridOptions.table_dtype) and its optimizer slots in float32; an update that "
            "takes the shard's handle (a tf.keras.optimizers.legacy optimizer's fused kernel, "
            "or a raw op) needs them in one dtype. Fix: use an optimizer of "
            "tf.keras.optimizers (not .legacy), or table_dtype=None.")

    def _round(self, value):
        return tf.cast(value, self._variable.dtype)

    def value(self):
        return tf.cast(self._variable.read_value(), tf.float32)

    read_value = value

    def sparse_read(self, indices, name=None):
        return tf.cast(self._variable.sparse_read(indices, name=name), tf.float32)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._variable.assign(self._round(value), use_locking=use_locking, name=name,
                                     read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self.assign(self.value() + delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self.assign(self.value() - delta, use_locking, name, read_value)

    def _scatter(self, sparse_delta, combine, name=None):
        # Rows written once each: duplicates of an id are summed first (as a
        # scatter_add would add both), then the new rows are rounded once.
        ids, positions = tf.unique(sparse_delta.indices)
        delta = tf.math.unsorted_segment_sum(
            tf.cast(sparse_delta.values, tf.float32), positions, tf.shape(ids)[0])
        rows = combine(self.sparse_read(ids), delta)
        return self._variable.scatter_update(
            tf.IndexedSlices(self._round(rows), ids), name=name)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(sparse_delta, lambda rows, delta: rows + delta, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self._scatter(sparse_delta, lambda rows, delta: rows - delta, name)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        return self._variable.scatter_update(
            tf.IndexedSlices(self._round(sparse_delta.values), sparse_delta.indices), name=name)

    def __repr__(self):
        return f"<HalfPrecisionRows of {self._variable.name} ({self._variable.dtype.name})>"


def _rows_to_tensor(rows, dtype=None, name=None, as_ref=False):  # pylint: disable=unused-argument
    value = rows.value()
    return value if dtype is None or dtype == value.dtype else tf.cast(value, dtype)


tf.register_tensor_conversion_function(HalfPrecisionRows, _rows_to_tensor)


def _bind(operator):
    def _operator(rows, *args):
        return getattr(tf.Tensor, operator)(rows.value(), *args)

    return _operator


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__neg__", "__pow__"):
    setattr(HalfPrecisionRows, _name, _bind(_name))
