"""The pieces of a synchronous epoch (tf_psplugin/runtime/epochs.py) without a cluster.

The cluster behaviour (fit/evaluate/custom loops on finite data) is in
tests/cluster/test_finite_data.py.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal.compat import keras
from tf_psplugin.runtime import epochs


def _count(dataset):
    return int(epochs._count_batches(dataset))  # pylint: disable=protected-access


def test_count_uses_cardinality_when_known():
    assert _count(tf.data.Dataset.range(23).batch(4)) == 6


def test_count_counts_when_cardinality_is_unknown():
    ds = tf.data.Dataset.range(23).filter(lambda x: x % 3 > 0).batch(4)
    assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert _count(ds) == 4  # 15 elements kept.


def test_count_of_an_infinite_dataset_is_negative_without_iterating():
    assert _count(tf.data.Dataset.range(3).repeat()) < 0


def test_count_of_tuple_and_dict_elements():
    x = np.zeros((10, 2), "float32")
    assert _count(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(
        lambda a, b: True).batch(3)) == 4
    assert _count(tf.data.Dataset.from_tensor_slices({"a": x}).filter(
        lambda d: True).batch(3)) == 4


def test_relax_makes_a_static_batch_dimension_dynamic_and_keeps_values():
    x = np.arange(12, dtype="float32").reshape(6, 2)
    ds = tf.data.Dataset.from_tensor_slices((x, {"k": x[:, 0]})).batch(3, drop_remainder=True)
    relaxed = epochs._relax_batch_dimension(ds)  # pylint: disable=protected-access
    spec = relaxed.element_spec
    assert spec[0].shape.as_list() == [None, 2]
    assert spec[1]["k"].shape.as_list() == [None]
    got = [a.numpy() for a, _ in relaxed]
    want = [a.numpy() for a, _ in ds]
    assert all(np.array_equal(g, w) for g, w in zip(got, want)) and len(got) == 2


def test_relax_keeps_a_one_tuple_a_one_tuple():
    ds = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2), "int64"),)).batch(
        2, drop_remainder=True)
    relaxed = epochs._relax_batch_dimension(ds)  # pylint: disable=protected-access
    assert isinstance(relaxed.element_spec, tuple) and len(relaxed.element_spec) == 1
    assert relaxed.element_spec[0].shape.as_list() == [None, 2]


@pytest.mark.parametrize("make", [
    lambda: tf.data.Dataset.from_tensor_slices(
        (np.zeros((5, 3), "int64"), np.zeros((5, 1), "float32"))).batch(2),
    lambda: tf.data.Dataset.from_tensor_slices(
        {"s": np.array([b"a", b"b", b"c"]), "n": np.zeros((3, 2, 2), "float32")}).batch(2),
    lambda: tf.data.Dataset.from_tensor_slices(
        tf.ragged.constant([[1, 2], [3], [4, 5, 6]], dtype=tf.int64)).batch(2),
    lambda: tf.data.Dataset.from_tensor_slices(
        tf.sparse.from_dense(tf.constant([[1, 0], [0, 2], [3, 0]], tf.int64))).batch(2),
], ids=["tuple", "dict_with_strings", "ragged", "sparse"])
def test_empty_batch_matches_the_element_spec_and_holds_zero_examples(make):
    ds = make()
    empty = epochs._empty_batch(ds.element_spec)  # pylint: disable=protected-access
    padded = ds.concatenate(tf.data.Dataset.from_tensors(empty))  # Spec-compatible, or raises.
    last = list(padded)[-1]
    for part in tf.nest.flatten(last, expand_composites=False):
        assert int(tf.shape(part)[0] if not isinstance(part, tf.SparseTensor)
                   else part.dense_shape[0]) == 0


def test_no_empty_batch_for_a_static_batch_dimension():
    spec = tf.TensorSpec([4, 2], tf.float32)
    with pytest.raises(epochs._NoEmptyBatch):  # pylint: disable=protected-access
        epochs._empty_batch(spec)  # pylint: disable=protected-access


def test_an_empty_batch_adds_nothing_to_keras_losses_and_metrics():
    """What exact evaluation relies on: padding changes no metric's state."""
    metrics = [keras.metrics.BinaryAccuracy(), keras.metrics.AUC(),
               keras.metrics.MeanSquaredError()]
    tracker = keras.metrics.Mean()  # What Keras's compiled loss tracker is.
    y = tf.constant([[1.0], [0.0], [1.0]])
    p = tf.constant([[0.9], [0.2], [0.4]])
    loss = keras.losses.BinaryCrossentropy()
    for m in metrics:
        m.update_state(y, p)
    tracker.update_state(loss(y, p), sample_weight=3)
    metrics.append(tracker)
    before = [[v.numpy().copy() for v in m.variables] for m in metrics]
    empty_y, empty_p = tf.zeros([0, 1]), tf.zeros([0, 1])
    empty_loss = loss(empty_y, empty_p)
    assert float(empty_loss) == 0.0  # divide_no_nan: no NaN from an empty batch.
    for m in metrics[:-1]:
        m.update_state(empty_y, empty_p)
    tracker.update_state(empty_loss, sample_weight=0)
    after = [[v.numpy() for v in m.variables] for m in metrics]
    for b, a in zip(before, after):
        assert all(np.array_equal(x, z) for x, z in zip(b, a))


def test_evaluation_marker_is_scoped_and_restored():
    assert not epochs.building_evaluation_inputs()
    with epochs.evaluation_inputs():
        assert epochs.building_evaluation_inputs()
        with epochs.evaluation_inputs(False):
            assert not epochs.building_evaluation_inputs()
        assert epochs.building_evaluation_inputs()
    assert not epochs.building_evaluation_inputs()


def test_data_handler_hook_leaves_models_without_the_strategy_alone():
    patches.install("keras_data_handler")
    patches.install("keras_data_handler")  # Idempotent.
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    model.compile("sgd", "mse")
    x = np.ones((7, 2), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(2)
    hist = model.fit(ds, epochs=2, verbose=0)  # 4 batches per epoch, the last partial.
    assert len(hist.history["loss"]) == 2
    assert model.evaluate(ds, verbose=0) >= 0


def test_a_handler_of_unknown_length_waits_for_each_step_until_the_length_is_known():
    """Keras's should_sync, for an epoch of unknown length, also waits for the coordinator."""
    from tf_psplugin._internal import tf_internal  # pylint: disable=g-import-not-at-top
    from tf_psplugin._internal import tf_objects  # pylint: disable=g-import-not-at-top

    data_adapter = tf_internal.keras_private_module("engine.data_adapter")
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    model.compile("sgd", "mse")
    x = np.ones((7, 2), "float32")
    unknown = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).filter(lambda a, b: True)
    handler = data_adapter.get_data_handler(x=unknown.batch(2), model=model,
                                            steps_per_execution=model._steps_per_execution)
    kind = type(handler)
    waits = []
    tf_objects.wait_for_each_step_while_length_unknown(handler, lambda: waits.append(1))
    assert isinstance(handler, kind) and type(handler).__name__ == kind.__name__
    assert handler.inferred_steps is None
    assert handler.should_sync and handler.should_sync and len(waits) == 2
    # Keras sets the length when the first epoch ends (OutOfRangeError); then no wait.
    for _, iterator in handler.enumerate_epochs():
        with handler.catch_stop_iteration():
            for _ in handler.steps():
                next(iterator)
        break
    assert handler.inferred_steps == 4  # 7 examples in batches of 2.
    assert not handler.should_sync and len(waits) == 2
    # One subclass per Keras handler class, not one per handler.
    other = data_adapter.get_data_handler(x=unknown.batch(3), model=model,
                                          steps_per_execution=model._steps_per_execution)
    tf_objects.wait_for_each_step_while_length_unknown(other, lambda: None)
    assert type(other) is type(handler)


@pytest.mark.parametrize("value, want", [(None, 1), (3, 3), (tf.Variable(2, dtype=tf.int64), 2)])
def test_steps_per_execution_is_read_from_a_variable_or_a_number(value, want):
    assert epochs._steps_per_execution(value) == want  # pylint: disable=protected-access


def test_a_long_counting_pass_is_reported_until_it_ends(monkeypatch):
    """A counting pass that takes long (an endless input never ends) is not silent."""
    said = []
    monkeypatch.setattr(epochs.logging, "warning", lambda msg, *a: said.append(msg % a))
    with epochs._SlowCountNotice(every=0.05) as notice:  # pylint: disable=protected-access
        time.sleep(0.3)
    count = len(said)
    time.sleep(0.15)
    assert count >= 2 and len(said) == count  # Repeated while counting, then quiet.
    assert "still counting" in said[0] and "steps_per_epoch" in said[0]
    assert not notice._thread.is_alive()  # pylint: disable=protected-access
