"""Creating a table shard on its PS without a memory peak several times its size.

Why this module exists: a table may be bigger than any worker's RAM, and on
the PS it must not need several times its own size just to be created.
Eager `tf.Variable(initializer)` materialises the initializer's output (and,
for `RandomUniform`, its intermediates) as separate remote tensors before
the variable adopts one: measured on TF 2.15.1, a PS peaks at 3x the shard
for Keras's RandomUniform. `create_shard` fills large shards in place with a
tf.function on the PS instead (peak 1x); small ones are created as usual.
The same holds for what a table's variables start from elsewhere: a
stack's initial rows (`compute_rows`) and an optimizer slot's constant
initial value, which Keras makes on the chief (`constant_fill_on_device`).
Both large-value paths draw in row slices where `sliced_draw` can (Keras's
stateless random and constant initializers: the same bits as the whole
draw), so a PS peaks at the rows in their own dtype plus one float32 slice,
not beside the whole float32 draw of a half-precision table.
"""

import tensorflow as tf

from tf_psplugin._internal.tf_internal import resource_variable_ops
from tf_psplugin.tables import sliced_draw

# Table shards at least this large are filled on their PS by a tf.function.
_FILL_IN_PLACE_MIN_BYTES = 16 << 20


def create_shard(next_creator, base_kwargs, **overrides):
    """`next_creator(**base_kwargs, **overrides)`, filled on its device if it is large."""
    kwargs = dict(base_kwargs)
    kwargs.pop("colocate_with", None)
    kwargs.update(overrides)
    init = kwargs.get("initial_value")
    shape, dtype = shape_and_dtype(kwargs)
    if (callable(init) and shape is not None and shape.is_fully_defined() and dtype is not None
            and shape.num_elements() * dtype.size >= _FILL_IN_PLACE_MIN_BYTES):
        return _create_filled_in_place(init, shape, dtype, kwargs)
    return next_creator(**kwargs)


def _create_filled_in_place(init, shape, dtype, kwargs):
    """Creates a table shard whose initial value is computed where it lives.

    An uninitialized variable filled by a tf.function on the PS lets the
    executor free intermediates and AssignVariableOp adopt the last buffer:
    the PS peaks at 1x the shard plus one slice of the draw (see the module
    doc).
    `UninitializedVariable` is what TF's SavedModel loader uses for the same
    reason (resource_variable_ops, TF 2.15-2.21).
    """
    var = resource_variable_ops.UninitializedVariable(
        shape=shape, dtype=dtype, name=kwargs.get("name"),
        trainable=kwargs.get("trainable", True),
        synchronization=kwargs.get("synchronization", tf.VariableSynchronization.AUTO),
        aggregation=kwargs.get("aggregation", tf.VariableAggregation.NONE),
        constraint=kwargs.get("constraint"),
        distribute_strategy=kwargs.get("distribute_strategy") or tf.distribute.get_strategy())

    with tf.device(var.device):
        _fill(var, init, shape, dtype)
    return var


def _fill(var, fn, shape, dtype) -> None:
    """Assigns ``fn()`` to `var`: in row slices if `sliced_draw` can, else whole.

    ``fn`` is traced once either way (an initializer whose Python state
    moves at each call draws what it drew before this module sliced).
    """
    whole = sliced_draw.trace(fn, dtype)
    slicer = sliced_draw.slicer(whole, shape)
    if slicer is not None:
        slicer.fill(var)
        return

    @tf.function(autograph=False)
    def fill():
        var.assign(whole(), read_value=False)

    fill()


def compute_rows(fn, shape, dtype: tf.DType) -> tf.Tensor:
    """``fn()`` as a `dtype` tensor on the current device, in one tf.function if it is large.

    Eagerly, each op of an initializer (a random draw, its scaling, the cast
    of a half-precision table) is a separate remote op whose input stays
    alive while its output is allocated: a PS peaks at twice the float32
    rows even for a bfloat16 table. In one function drawn whole, the PS
    still peaks at the float32 draw plus the rows in `dtype`; drawn in row
    slices (`sliced_draw`, when the value allows it) at the rows plus one
    slice. Keras's initializers draw the same numbers either way
    (stateless ops seeded from Python); small values stay eager, as
    `create_shard` does.
    """
    shape = tf.TensorShape(shape)
    if not (shape.is_fully_defined() and shape.num_elements() * dtype.size
            >= _FILL_IN_PLACE_MIN_BYTES):
        return tf.convert_to_tensor(fn(), dtype=dtype)

    whole = sliced_draw.trace(fn, dtype)
    slicer = sliced_draw.slicer(whole, shape)
    if slicer is None:
        return whole()
    return slicer.value()


def constant_fill_on_device(kwargs: dict) -> dict:
    """Variable-creator `kwargs` whose large constant initial value is made where it lives.

    Keras's optimizers compute a slot's initial value eagerly on the chief
    (``Constant(0.1)(shape)`` for Adagrad, zeros for Adam): a tensor of the
    table's full shape, which the PS would receive whole and then copy into
    the slot (measured: the PS peaked at twice the slot, the chief held it
    too). A value of at least `_FILL_IN_PLACE_MIN_BYTES` whose elements are
    all equal becomes ``tf.fill`` on the variable's device: the same value,
    made once on the PS. Any other value is left as it is.
    """
    value = kwargs.get("initial_value")
    if not isinstance(value, tf.Tensor) or not tf.executing_eagerly() \
            or not value.shape.is_fully_defined() or value.shape.rank < 1 \
            or value.shape.num_elements() * value.dtype.size < _FILL_IN_PLACE_MIN_BYTES:
        return kwargs
    flat = tf.reshape(value, [-1])
    first = flat[0]
    if not bool(tf.reduce_all(tf.equal(flat, first))):
        return kwargs
    shape, dtype = value.shape, value.dtype
    return dict(kwargs, initial_value=lambda: tf.fill(shape, first), dtype=dtype)


def shape_and_dtype(kwargs):
    """The (TensorShape or None, DType or None) that variable-creator kwargs describe."""
    shape = kwargs.get("shape")
    dtype = kwargs.get("dtype")
    initial_value = kwargs.get("initial_value")
    if shape is not None:
        shape = tf.TensorShape(shape)
    if (shape is None or dtype is None) and initial_value is not None \
            and not callable(initial_value):
        try:
            t = tf.convert_to_tensor(initial_value, dtype=dtype)
            shape = shape if shape is not None else t.shape
            dtype = dtype if dtype is not None else t.dtype
        except (TypeError, ValueError):
            pass
    if dtype is not None:
        dtype = tf.as_dtype(dtype).base_dtype  # A TF1 graph's "_ref" dtype is its base.
    return shape, dtype
