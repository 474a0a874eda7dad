"""Tables in half precision (`tables/half_precision.py`, ``HybridOptions.table_dtype``).

Single process: the float32 face an optimizer's apply sees, a Keras
optimizer's update of a bfloat16 shard against the same update in float32
rounded once, the option's validation, the initial values, and
checkpoints of a bfloat16 interleaved table restored into float32 tables
and back. The cluster test is tests/cluster/test_half_tables.py.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.tables import half_precision
from tf_psplugin.tables import sharded as sharding


def _bf16(value):
    return tf.cast(tf.cast(value, tf.bfloat16), tf.float32).numpy()


def test_rows_compute_in_float32_and_round_once():
    start = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.25]], np.float32)
    shard = tf.Variable(tf.cast(start, tf.bfloat16))
    rows = half_precision.HalfPrecisionRows(shard)
    assert rows.dtype == tf.float32 and rows._unique_id == shard._unique_id
    # Three small additions to row 1: each alone would round away in bfloat16
    # at 1.0; summed in float32 first they move the row.
    delta = tf.IndexedSlices(tf.fill([3, 2], 2.0 ** -9), tf.constant([0, 0, 0]))
    rows.scatter_add(delta)
    np.testing.assert_array_equal(shard.numpy().astype(np.float32)[0],
                                  _bf16(start[0] + 3 * 2.0 ** -9))
    np.testing.assert_array_equal(shard.numpy().astype(np.float32)[1:], start[1:])
    rows.assign_sub(tf.fill([3, 2], 0.25))
    assert rows.sparse_read([2]).dtype == tf.float32
    np.testing.assert_array_equal(tf.convert_to_tensor(rows).numpy()[2], [2.75, 0.0])
    assert (rows * 2.0).dtype == tf.float32


@pytest.mark.parametrize("name", ["Adagrad", "Adam", "SGD"])
def test_keras_update_of_a_bfloat16_shard_is_float32_rounded(name):
    """Keras's update of the shard equals its float32 update with float32 slots, rounded."""
    rng = np.random.default_rng(0)
    start = _bf16(rng.normal(size=(6, 3)).astype(np.float32))
    grad = tf.IndexedSlices(tf.constant(_bf16(rng.normal(size=(2, 3)).astype(np.float32))),
                            tf.constant([1, 4]))
    reference = tf.Variable(start)
    shard = tf.Variable(tf.cast(start, tf.bfloat16))
    got, want = getattr(tf.keras.optimizers, name)(0.1), getattr(tf.keras.optimizers, name)(0.1)
    want.build([reference])
    got.build([reference])  # Float32 slots, found by the shard's key as the strategy does.
    got._index_dict[got._var_key(shard)] = got._index_dict.pop(got._var_key(reference))  # pylint: disable=protected-access
    update = half_precision.float32_update(lambda var, g: got.update_step(g, var))
    for _ in range(3):
        want.apply_gradients([(grad, reference)])
        reference.assign(_bf16(reference))  # Rounded into the rows after each update.
        update(shard, tf.IndexedSlices(tf.cast(grad.values, tf.bfloat16), grad.indices))
        got.iterations.assign_add(1)  # (What apply_gradients does after the update.)
    np.testing.assert_array_equal(shard.numpy().astype(np.float32), reference.numpy())
    assert not np.array_equal(reference.numpy(), start)


def test_a_legacy_optimizer_is_refused_with_the_fix():
    shard = tf.Variable(tf.zeros([4, 2], tf.bfloat16))
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.1)
    with pytest.raises(ValueError, match="not .legacy"):
        half_precision.HalfPrecisionRows(shard).handle  # pylint: disable=expression-not-assigned
    del optimizer


def test_a_moving_average_of_a_half_precision_table_is_refused_with_the_fix():
    """Keras's ``use_ema`` average of a table (its slot "average/<table>") is refused."""
    kwargs = {"name": "average/embeddings", "initial_value": tf.zeros([4, 2], tf.bfloat16),
              "dtype": tf.bfloat16}
    with pytest.raises(tf_psplugin.StrategyError, match="use_ema=True.*Fix: drop use_ema"):
        half_precision.slot_kwargs(kwargs)
    made = half_precision.slot_kwargs(dict(kwargs, name="accumulator/embeddings"))
    assert made["dtype"] == tf.float32


def test_table_dtype_option():
    assert tf_psplugin.HybridOptions(table_dtype="bfloat16").table_dtype == "bfloat16"
    assert tf_psplugin.HybridOptions().table_dtype is None
    with pytest.raises(tf_psplugin.StrategyError, match="table_dtype='float64'.*bfloat16"):
        tf_psplugin.HybridOptions(table_dtype="float64")
    assert half_precision.storage_dtype(tf.float32, "float16") == tf.float16
    assert half_precision.storage_dtype(tf.float64, "bfloat16") is None
    assert half_precision.storage_dtype(tf.float32, None) is None


def test_initial_values_are_drawn_as_float32_and_rounded():
    init = tf.keras.initializers.RandomUniform(seed=3)
    keras_style = functools.partial(init, [8, 2], dtype=tf.float32)
    cast = half_precision.cast_initial_value(keras_style, tf.bfloat16)
    value = cast()
    assert value.dtype == tf.bfloat16
    np.testing.assert_array_equal(value.numpy().astype(np.float32), _bf16(keras_style()))
    unbound = half_precision.cast_initial_value(init, tf.bfloat16)
    assert unbound([8, 2], dtype=tf.bfloat16).dtype == tf.bfloat16
    assert half_precision.cast_initial_value(np.ones([2, 2], np.float32),
                                             tf.float16).dtype == tf.float16
    slot = half_precision.slot_kwargs({"dtype": tf.bfloat16,
                                       "initial_value": tf.fill([2], tf.constant(0.1, tf.bfloat16))})
    assert slot["dtype"] == tf.float32 and slot["initial_value"].dtype == tf.float32


def _table(dtype, values, num_shards=2):
    return sharding.create_interleaved(
        name="t", shape=values.shape, dtype=dtype, initial_value=values, num_shards=num_shards,
        device_fn=lambda s: "/cpu:0",
        creator=lambda **kwargs: tf.Variable(kwargs["initial_value"], dtype=dtype,
                                             name=kwargs.get("name")))


def test_checkpoint_of_a_bfloat16_table_is_float32_and_restores_both_ways(tmp_path):
    values = np.random.default_rng(1).normal(size=(7, 3)).astype(np.float32)
    half = _table(tf.bfloat16, values)
    path = tf.train.Checkpoint(table=half).write(str(tmp_path / "half"))
    saved = tf.train.load_checkpoint(path)
    [key] = [k for k in saved.get_variable_to_shape_map() if k.startswith("table/")]
    assert saved.get_variable_to_dtype_map()[key] == tf.float32
    np.testing.assert_array_equal(saved.get_tensor(key), _bf16(values))
    # Into a float32 interleaved table of another shard count, and a plain variable.
    into = _table(tf.float32, np.zeros_like(values), num_shards=3)
    tf.train.Checkpoint(table=into).read(path).assert_consumed()
    np.testing.assert_array_equal(tf.convert_to_tensor(into).numpy(), _bf16(values))
    plain = tf.Variable(tf.zeros_like(values))
    tf.train.Checkpoint(table=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), _bf16(values))
    # And back: a float32 checkpoint into a bfloat16 table, rounded.
    back_path = tf.train.Checkpoint(table=tf.Variable(values)).write(str(tmp_path / "f32"))
    back = _table(tf.bfloat16, np.zeros_like(values))
    tf.train.Checkpoint(table=back).read(back_path).assert_consumed()
    assert all(v.dtype == tf.bfloat16 for v in back.variables)
    np.testing.assert_array_equal(
        tf.cast(tf.convert_to_tensor(back), tf.float32).numpy(), _bf16(values))
