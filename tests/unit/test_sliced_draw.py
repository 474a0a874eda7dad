"""sliced_draw: a table's initial rows drawn in row slices equal the whole draw bit for bit.

Each case builds a shard's initial value the way a table does (Keras's
``partial(initializer, shape, dtype=float32)``, the half-precision cast,
the interleaved shard's partition keywords) and compares what
`shard_init` makes in slices with the same callable's value drawn whole
(eagerly, as Keras draws it in one process): the bits of every element.
The row count (1003) is not a multiple of the slice (40 rows here).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.tables import half_precision, shard_init, sharded, sliced_draw

_ROWS, _DIM = 1003, 16
_SLICE_ROWS = 40

_INITIALIZERS = {
    "uniform_seeded": lambda: tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=3),
    "uniform_default": lambda: tf.keras.initializers.get("uniform"),  # Embedding's default.
    "normal_seeded": lambda: tf.keras.initializers.RandomNormal(0.1, 0.2, seed=5),
    "normal_unseeded": lambda: tf.keras.initializers.RandomNormal(),
    "truncated_seeded": lambda: tf.keras.initializers.TruncatedNormal(stddev=0.3, seed=7),
    "truncated_unseeded": lambda: tf.keras.initializers.TruncatedNormal(),
    "glorot_seeded": lambda: tf.keras.initializers.GlorotUniform(seed=11),
    "glorot_unseeded": lambda: tf.keras.initializers.GlorotUniform(),
    "zeros": lambda: tf.keras.initializers.Zeros(),
    "constant": lambda: tf.keras.initializers.Constant(0.3),
}
_CAPTURED = tf.zeros([_ROWS, _DIM])
_DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16, "float16": tf.float16}


@pytest.fixture
def small_slices(monkeypatch):
    """Tables of a few KiB take the large-table path, in slices of 40 rows."""
    monkeypatch.setattr(shard_init, "_FILL_IN_PLACE_MIN_BYTES", 1)
    monkeypatch.setattr(sliced_draw, "SLICE_BYTES", _SLICE_ROWS * _DIM * 4)


def _shard_value(initializer, dtype, shard=1, num_shards=2):
    """Shard `shard`'s zero-argument initial value, wrapped as a table wraps it."""
    rows = _ROWS * num_shards
    value = functools.partial(initializer, [rows, _DIM], dtype=tf.float32)
    if dtype != tf.float32:
        value = half_precision.cast_initial_value(value, dtype)
    return sharded.shard_value_fn(value, [rows, _DIM], dtype, shard, num_shards=num_shards,
                                  name="t")


def _bits(value) -> np.ndarray:
    value = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    return value.view({4: np.uint32, 2: np.uint16}[value.dtype.itemsize])


def _assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    mismatched = int(np.sum(_bits(got) != _bits(want)))
    assert mismatched == 0, f"{mismatched} of {want.shape.num_elements()} elements differ"


def test_the_slices_cover_every_row_and_start_on_whole_counter_groups(small_slices):
    fn = _shard_value(_INITIALIZERS["uniform_seeded"](), tf.float32)
    slicer = sliced_draw.slicer(sliced_draw.trace(fn, tf.float32), [_ROWS, _DIM])
    slices = slicer.slices()
    assert slices[0] == (0, _SLICE_ROWS) and slices[-1] == (1000, 3)
    assert sum(n for _, n in slices) == _ROWS
    assert all(a * _DIM % 4 == 0 for a, _ in slices)


@pytest.mark.parametrize("dtype", sorted(_DTYPES))
@pytest.mark.parametrize("name", sorted(_INITIALIZERS))
def test_stack_rows_in_slices_equal_the_whole_draw(small_slices, name, dtype):
    dtype = _DTYPES[dtype]
    fn = _shard_value(_INITIALIZERS[name](), dtype)
    whole = fn()  # Eagerly, as one process draws it (an unseeded one picks its seed here).
    assert sliced_draw.slicer(sliced_draw.trace(fn, dtype), [_ROWS, _DIM]) is not None
    _assert_same_bits(shard_init.compute_rows(fn, [_ROWS, _DIM], dtype), whole)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["uniform_default", "truncated_seeded", "constant"])
def test_a_shard_filled_in_slices_holds_the_whole_draw(small_slices, name, dtype):
    dtype = _DTYPES[dtype]
    fn = _shard_value(_INITIALIZERS[name](), dtype, shard=0)
    whole = fn()

    def never_called(**kwargs):
        raise AssertionError(f"a large shard went to the next creator: {kwargs}")

    var = shard_init.create_shard(never_called, {"name": "t/part_0", "dtype": dtype},
                                  shape=[_ROWS, _DIM], initial_value=fn)
    _assert_same_bits(var.read_value(), whole)


def test_a_counter_one_step_off_draws_other_rows(small_slices, monkeypatch):
    """The comparisons above can fail: slices drawn one Philox step late differ."""
    fn = _shard_value(_INITIALIZERS["uniform_seeded"](), tf.float32)
    whole = fn()
    offsets = sliced_draw.Slicer._offsets
    monkeypatch.setattr(sliced_draw.Slicer, "_offsets",
                        lambda self, starts: offsets(self, starts) + np.array([1, 0], np.uint64))
    rows = shard_init.compute_rows(fn, [_ROWS, _DIM], tf.float32)
    assert np.mean(_bits(rows) != _bits(whole)) > 0.99


def test_a_three_dimensional_table_in_slices_equals_the_whole_draw(small_slices):
    init = tf.keras.initializers.RandomNormal(seed=2)
    shape = [_ROWS, 3, 5]  # A row of 15 elements: slices start on multiples of 4 rows.
    fn = functools.partial(init, shape, dtype=tf.float32)
    whole = fn()
    slicer = sliced_draw.slicer(sliced_draw.trace(fn, tf.float32), shape)
    assert all(a * 15 % 4 == 0 for a, _ in slicer.slices())
    _assert_same_bits(shard_init.compute_rows(fn, shape, tf.float32), whole)


@pytest.mark.parametrize("value", [
    # A stateful draw: its values cannot be reproduced, it stays whole.
    lambda: tf.random.uniform([_ROWS, _DIM]),
    # An op that is not element-wise.
    lambda: tf.transpose(tf.random.stateless_uniform([_DIM, _ROWS], [1, 2])),
    # A captured tensor (a stack's pending rows).
    lambda: tf.cast(tf.ones([_ROWS, _DIM]) + _CAPTURED, tf.float32),
    # Two draws.
    lambda: (tf.random.stateless_uniform([_ROWS, _DIM], [1, 2])
             + tf.random.stateless_normal([_ROWS, _DIM], [3, 4])),
    # A draw in float64.
    lambda: tf.cast(tf.random.stateless_uniform([_ROWS, _DIM], [1, 2], dtype=tf.float64),
                    tf.float32),
], ids=["stateful", "transpose", "captured", "two_draws", "float64_draw"])
def test_values_that_cannot_be_sliced_stay_whole(small_slices, value):
    assert sliced_draw.slicer(sliced_draw.trace(value, tf.float32), [_ROWS, _DIM]) is None
    rows = shard_init.compute_rows(value, [_ROWS, _DIM], tf.float32)
    assert rows.shape == [_ROWS, _DIM] and rows.dtype == tf.float32


def test_only_philox_draws_are_sliced(small_slices):
    def draw(alg):
        return lambda: tf.random.stateless_uniform([_ROWS, _DIM], [1, 2], alg=alg)

    for alg, sliced in (("philox", True), ("auto_select", True), ("threefry", False)):
        slicer = sliced_draw.slicer(sliced_draw.trace(draw(alg), tf.float32), [_ROWS, _DIM])
        assert (slicer is not None) == sliced, alg
