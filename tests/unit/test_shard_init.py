"""shard_init: large initial values made where they live, with the same values."""

import numpy as np
import tensorflow as tf

from tf_psplugin.tables import shard_init

_BIG_ROWS = (shard_init._FILL_IN_PLACE_MIN_BYTES // (16 * 4)) + 1  # Just over the threshold.


def test_constant_slot_value_becomes_a_fill_with_the_same_value():
    value = tf.constant(0.1, tf.float32, [_BIG_ROWS, 16])
    kwargs = shard_init.constant_fill_on_device({"initial_value": value, "name": "acc"})
    assert callable(kwargs["initial_value"])
    assert kwargs["dtype"] == tf.float32 and kwargs["name"] == "acc"
    filled = kwargs["initial_value"]()
    assert filled.shape == value.shape
    np.testing.assert_array_equal(filled.numpy(), value.numpy())


def test_non_constant_small_or_callable_values_are_left_alone():
    varied = tf.concat([tf.zeros([_BIG_ROWS - 1, 16]), tf.ones([1, 16])], axis=0)
    small = tf.constant(0.1, tf.float32, [8, 16])
    for value in (varied, small, lambda: small, np.zeros([4, 4], np.float32)):
        kwargs = {"initial_value": value}
        assert shard_init.constant_fill_on_device(kwargs) is kwargs


def test_compute_rows_in_a_function_draws_what_eager_draws():
    init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    shape = [_BIG_ROWS, 16]
    eager = tf.cast(init(shape, dtype=tf.float32), tf.bfloat16)
    rows = shard_init.compute_rows(
        lambda: tf.cast(init(shape, dtype=tf.float32), tf.bfloat16), shape, tf.bfloat16)
    assert rows.dtype == tf.bfloat16
    np.testing.assert_array_equal(rows.numpy(), eager.numpy())
