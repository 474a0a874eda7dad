"""How table gradients meet: PS-side accumulators and the two barriers.

Why this module exists: in TF1 graph mode the hybrid strategy cannot move
sparse gradients between workers with collectives (a collective's shape is
fixed per instance key for the session, a sparse gradient's changes every
step). The PS task that holds a shard is the natural meeting point instead:
every worker pushes into a conditional accumulator next to the shard, and the
chief takes the sum. The barriers that order steps (see `_strategy`) are
plain scalar collectives; the initialization barrier rides on the input
iterator's initialization, the one thing Estimator runs on every worker after
its session exists and before the first step.
"""

from typing import Any

import tensorflow as tf

_NEVER_STALE = 1 << 62  # Accumulator local_step: no gradient is ever dropped as stale.


def scale(grad, factor):
    """Multiplies a dense or sparse gradient by ``factor``."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def tensors_of(grad):
    """The tensor(s) holding a dense or sparse gradient's values."""
    if isinstance(grad, tf.IndexedSlices):
        return grad.values
    return grad


def identity(grad):
    """`tf.identity` for a dense or sparse gradient (picks up control deps)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                                grad.dense_shape)
    return tf.identity(grad)


def densify(value):
    """Turns IndexedSlices into a dense tensor (fixed shape for collectives)."""
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def accumulate_on_ps(grad, table, num_workers: int):
    """Sums every worker's gradient for ``table`` on the table's own PS task.

    Each worker pushes its (deduplicated) gradient into a
    `SparseConditionalAccumulator` (or `ConditionalAccumulator` for a dense
    gradient) shared by name and colocated with the shard; the chief takes the
    sum once all ``num_workers`` pushes arrived. Sparse gradients change shape
    every step, which graph-mode collectives cannot carry; the accumulator
    can, and the data goes to the PS task that needs it, once.

    Args:
        grad: This worker's gradient for the shard (IndexedSlices or dense).
        table: The table shard (a variable on a PS task).
        num_workers: Pushes the chief waits for.

    Returns:
        ``(push_op, take_fn)``; ``take_fn()`` builds the chief's take, which
        runs after this worker's own push.
    """
    shared_name = f"{table.op.name}/tf_psplugin_grad_sum"
    if isinstance(grad, tf.IndexedSlices):  # Deduplicate on the worker: less to send.
        unique, position = tf.unique(grad.indices)
        values = tf.math.unsorted_segment_sum(grad.values, position, tf.size(unique))
        grad = tf.IndexedSlices(values, tf.cast(unique, tf.int64),
                                tf.constant(table.shape.as_list(), tf.int64))
    with tf.device(table.device):
        if isinstance(grad, tf.IndexedSlices):
            accumulator = tf.compat.v1.SparseConditionalAccumulator(
                grad.dtype, shape=table.shape, shared_name=shared_name, reduction_type="SUM"
            )
            push = accumulator.apply_indexed_slices_grad(grad, local_step=_NEVER_STALE)
            take = accumulator.take_indexed_slices_grad
        else:
            accumulator = tf.compat.v1.ConditionalAccumulator(
                grad.dtype, shape=table.shape, shared_name=shared_name, reduction_type="SUM"
            )
            push = accumulator.apply_grad(grad, local_step=_NEVER_STALE)
            take = accumulator.take_grad

    def take_fn():
        with tf.device(table.device), tf.control_dependencies([push]):
            return take(num_required=num_workers)

    return push, take_fn


class InitBarrierIterator:
    """Wraps the input iterator so that its initialization ends with a barrier.

    Estimator initializes the distributed input iterator in a session hook's
    ``after_create_session``, i.e. after the session ran its init op or
    restored the checkpoint, and before the first step, on every worker. That
    is exactly where non-chief workers must wait for the chief's tables.
    """

    def __init__(self, iterator: Any, barrier_fn):
        self._iterator = iterator
        self._barrier_fn = barrier_fn

    def initialize(self):
        """Returns the wrapped iterator's init ops plus the barrier."""
        init = self._iterator.initialize()
        init = list(init) if isinstance(init, (list, tuple)) else [init]
        return init + [self._barrier_fn()]

    def __getattr__(self, name):
        return getattr(self._iterator, name)
