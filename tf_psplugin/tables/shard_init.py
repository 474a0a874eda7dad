"""Creating a table shard on its PS without a memory peak several times its size.

Why this module exists: a table may be bigger than any worker's RAM, and on
the PS it must not need several times its own size just to be created.
Eager `tf.Variable(initializer)` materialises the initializer's output (and,
for `RandomUniform`, its intermediates) as separate remote tensors before
the variable adopts one: measured on TF 2.15.1, a PS peaks at 3x the shard
for Keras's RandomUniform. `create_shard` fills large shards in place with a
tf.function on the PS instead (peak 1x); small ones are created as usual.
"""

import tensorflow as tf

from tf_psplugin._internal.tf_internal import resource_variable_ops

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
    the PS peaks at 1x the shard (see the module doc).
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

    @tf.function(autograph=False)
    def fill():
        var.assign(tf.convert_to_tensor(init(), dtype=dtype), read_value=False)

    with tf.device(var.device):
        fill()
    return var


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
