"""sparse_exchange.PsGradientQueues in one process (a local device stands in for the PS).

The cluster tests (tests/cluster/test_strategy.py) check the whole sync step
against single-process training; these check the queue's own contract: the
take returns every worker's slices per shard, in worker order, whatever order
the workers handed them in.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.sync import sparse_exchange


def _slices(rows, width, vocab, seed):
    rng = np.random.default_rng(seed)
    return tf.IndexedSlices(
        tf.constant(rng.normal(size=(rows, width)).astype(np.float32)),
        tf.constant(rng.integers(0, vocab, size=rows).astype(np.int64)),
        tf.constant([vocab, width], tf.int64))


@pytest.mark.parametrize("arrival", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_take_returns_every_workers_slices_in_worker_order(arrival):
    queues = sparse_exchange.PsGradientQueues(3, device_fn=lambda p: "/device:CPU:0")
    # Per worker: two shards on this PS, widths 4 and 2, varying row counts
    # (one worker has no rows for the second shard).
    per_worker = {w: [_slices(3 + w, 4, 50, 10 * w), _slices(2 * (w != 1), 2, 30, 10 * w + 1)]
                  for w in range(3)}
    for w in arrival:
        queues.hand_in(0, tf.constant(w), per_worker[w])
    taken = queues.take(0, per_worker[0])
    assert len(taken) == 2
    for shard, got in enumerate(taken):
        want_idx = np.concatenate([per_worker[w][shard].indices.numpy() for w in range(3)])
        want_val = np.concatenate([per_worker[w][shard].values.numpy() for w in range(3)])
        np.testing.assert_array_equal(got.indices.numpy(), want_idx)
        np.testing.assert_array_equal(got.values.numpy(), want_val)
        assert got.values.shape[1] == per_worker[0][shard].values.shape[1]
        np.testing.assert_array_equal(got.dense_shape.numpy(),
                                      per_worker[0][shard].dense_shape.numpy())


def test_queues_are_per_ps_and_dtype_and_created_once():
    queues = sparse_exchange.PsGradientQueues(1, device_fn=lambda p: "/device:CPU:0")
    a = _slices(2, 4, 10, 0)
    for _ in range(3):  # three steps through the same queue
        queues.hand_in(1, tf.constant(0), [a])
        got = queues.take(1, [a])[0]
        np.testing.assert_array_equal(got.values.numpy(), a.values.numpy())
    half = tf.IndexedSlices(tf.cast(a.values, tf.float16), a.indices, a.dense_shape)
    queues.hand_in(1, tf.constant(0), [half])
    assert queues.take(1, [half])[0].values.dtype == tf.float16
    assert len(queues._queues) == 2  # pylint: disable=protected-access


def test_a_new_instance_never_reuses_an_abandoned_queue():
    # A chief that failed mid-step leaves worker 0's element in its queue on
    # the PS; the restarted chief (same program, same seed) must get queues
    # of its own: the leftover would fill the new queue and block a hand-in.
    tf.keras.utils.set_random_seed(7)
    old = sparse_exchange.PsGradientQueues(2, device_fn=lambda p: "/device:CPU:0")
    a, b = _slices(3, 4, 10, 1), _slices(1, 4, 10, 2)
    old.hand_in(0, tf.constant(0), [a])  # the step that failed
    tf.keras.utils.set_random_seed(7)
    new = sparse_exchange.PsGradientQueues(2, device_fn=lambda p: "/device:CPU:0")
    assert new._name != old._name  # pylint: disable=protected-access
    fresh = new._queue(0, tf.float32, 0)  # pylint: disable=protected-access
    assert int(tf.raw_ops.QueueSizeV2(handle=fresh)) == 0
    new.hand_in(0, tf.constant(1), [b])
    new.hand_in(0, tf.constant(0), [a])
    np.testing.assert_array_equal(new.take(0, [a])[0].values.numpy(),
                                  np.concatenate([a.values.numpy(), b.values.numpy()]))
    old_queue = old._queue(0, tf.float32, 0)  # pylint: disable=protected-access
    assert int(tf.raw_ops.QueueSizeV2(handle=old_queue)) == 1


def test_take_in_a_traced_function_uses_the_eager_queue():
    queues = sparse_exchange.PsGradientQueues(2, device_fn=lambda p: "/device:CPU:0")
    a, b = _slices(3, 4, 10, 1), _slices(1, 4, 10, 2)

    @tf.function
    def step():
        queues.hand_in(0, tf.constant(1), [b])
        queues.hand_in(0, tf.constant(0), [a])
        return queues.take(0, [a])[0].values

    for _ in range(2):
        np.testing.assert_array_equal(step().numpy(),
                                      np.concatenate([a.values.numpy(), b.values.numpy()]))
    assert len(queues._queues) == 2  # one per worker  # pylint: disable=protected-access


def _worker_traced_queues(num_workers):
    """Queues and a hand-in traced once for every worker (its index a run-time input)."""
    queues = sparse_exchange.PsGradientQueues(num_workers, device_fn=lambda p: "/device:CPU:0")

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([None, 4]),
                                  tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None, 2]), tf.TensorSpec([None], tf.int64)])
    def hand_in(worker, values0, indices0, values1, indices1):
        # As in a step traced once per update role: the index is not known
        # when the hand-in is traced.
        queues.hand_in(0, worker, [tf.IndexedSlices(values0, indices0, [50, 4]),
                                   tf.IndexedSlices(values1, indices1, [30, 2])])

    return queues, hand_in


@pytest.mark.parametrize("arrival", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_a_hand_in_traced_for_every_worker_picks_its_workers_queue(arrival):
    queues, hand_in = _worker_traced_queues(3)
    per_worker = {w: [_slices(3 + w, 4, 50, 10 * w), _slices(2 * (w != 1), 2, 30, 10 * w + 1)]
                  for w in range(3)}
    for step in range(2):  # the queues are empty again after each take
        for w in arrival:
            s0, s1 = per_worker[w]
            hand_in(tf.constant(w, tf.int64), s0.values, s0.indices, s1.values, s1.indices)
        taken = queues.take(0, per_worker[0])
        for shard, got in enumerate(taken):
            np.testing.assert_array_equal(
                got.indices.numpy(),
                np.concatenate([per_worker[w][shard].indices.numpy() for w in range(3)]))
            np.testing.assert_array_equal(
                got.values.numpy(),
                np.concatenate([per_worker[w][shard].values.numpy() for w in range(3)]))
    assert hand_in.experimental_get_tracing_count() == 1
    for w in range(3):
        handle = queues._queue(0, tf.float32, w)  # pylint: disable=protected-access
        assert int(tf.raw_ops.QueueSizeV2(handle=handle)) == 0


def test_the_take_neither_sorts_nor_partitions():
    # The take concatenates each shard's pieces in worker order; it used to
    # sort the elements by worker, ragged-stack and dynamic_partition them.
    queues = sparse_exchange.PsGradientQueues(2, device_fn=lambda p: "/device:CPU:0")
    shards = [_slices(3, 4, 50, 0), _slices(2, 2, 30, 1)]

    @tf.function
    def take():
        return [s.values for s in queues.take(0, shards)]

    op_types = {op.type for op in take.get_concrete_function().graph.get_operations()}
    assert "QueueDequeueV2" in op_types
    assert not op_types & {"DynamicPartition", "TopKV2", "GatherV2"}


def test_unknown_row_width_is_a_clear_error():
    queues = sparse_exchange.PsGradientQueues(1, device_fn=lambda p: "/device:CPU:0")

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
    def step(values):
        s = tf.IndexedSlices(values, tf.constant([0], tf.int64))
        return queues.take(0, [s])[0].values

    with pytest.raises(ValueError, match="static embedding dimension"):
        step.get_concrete_function()
