"""Synchronous sparse gradients, summed on the PS that owns the table shards.

In ``"sync"`` embedding mode each table shard must be updated once per step
with the global sparse gradient. Every worker hands its own sparse gradients
for the shards on ps:p to ps:p, where they wait in a queue (one per worker);
once every worker has handed them in, the one worker that updates ps:p's
shards (`HybridExtended.update_role`) takes all of them out *on ps:p*
and applies the update there. A collective says when every worker has handed
in: the step's dense all-reduce, which runs after the hand-ins and so
doubles as the barrier (a separate barrier only when there is no dense
gradient). A worker therefore sends
its own sparse gradients once, to the PS, whatever the number of workers;
nothing sparse crosses between workers, and the updating worker's graph only
sends the PS control edges. This is what TF1's SyncReplicasOptimizer did
with its PS-side accumulators.

(The alternative, an all-gather of every worker's sparse gradients among the
workers, makes each worker receive W-1 workers' gradients per step: its
bytes grow linearly with the number of workers. `benchmarks.run --network`
measures both; ``experimental_sparse_exchange="allgather"`` keeps it for comparison.)

Exactness: each (PS, value dtype) has one queue per worker, and the updating
worker takes one element from each, in worker order, so the global gradient
is the same concatenation, in the same order, as the all-gather's: the
update does not depend on which worker was fastest. A trace may serve
several workers (workers with the same update role share it), so a hand-in
picks its worker's queue handle at run time, on the PS (a gather from the W
handles). The take
splits each worker's element per shard (`tf.split` by the row counts the
element carries) and concatenates the pieces: one copy of the gradient, no
sort, no ragged or partition ops.

The queues never wait: the collective that precedes the take completes only
after every worker's hand-in has completed, so each take finds its W
elements, and the end-of-step barrier keeps the next step's hand-ins out
until the update is done. A worker that dies before that collective leaves
elements behind in queues nobody takes from again: failover ends the chief,
and the next chief creates queues of its own, under new names (at most one
step's sparse gradients per failure stay behind on the PS).

Keras's (non-legacy) optimizer sums a sparse gradient's duplicate rows
before its update, outside the per-variable update and so on the worker:
for a gradient summed on a PS that would copy the global gradient to the
updating worker and back. `install_keras_dedup_hook` runs that sum on the
PS that holds the gradient instead (legacy optimizers sum inside the update,
already on the PS).
"""

import contextlib
import uuid
from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin._internal import keras_members
from tf_psplugin.cluster.devices import ps_device
from tf_psplugin.sync import collectives

SPARSE_EXCHANGES = ("ps", "allgather")

# A queue element: rows per shard, flat indices, flat values (value dtype last).
_COMPONENT_TYPES = [tf.int64, tf.int64]


def ps_device_of(tensor) -> str:
    """The PS device `tensor` lives on, or "" (a worker, no device, None)."""
    device = getattr(tensor, "device", "") or ""
    return device if "/job:ps" in device else ""


def on_ps_device_of(tensor):
    """A device scope for ops that belong beside `tensor` when it is on a PS.

    A null context for a tensor anywhere else (a worker, or no device).
    """
    device = ps_device_of(tensor)
    return tf.device(device) if device else contextlib.nullcontext()


_HALF_DTYPES = (tf.bfloat16, tf.float16)


def patch_keras_dedup():
    """Makes Keras's optimizer sum duplicate rows on the PS holding the gradient.

    Applied through `tf_psplugin._internal.patches` ("keras_dedup_on_ps");
    returns the undo.

    Keras 2's `optimizers.Optimizer.apply_gradients` (Keras 2.15, tf-keras
    2.16-2.21) calls `_deduplicate_sparse_grad` after the cross-worker
    aggregation and outside `extended.update`, so its unique/segment-sum ops
    get the worker's device. There is no public hook for where it runs; this
    wraps it (class level, once per process) so that a gradient whose values
    live on a PS task is summed there. Every other gradient, under any other
    strategy, goes through Keras's original code unchanged.
    """
    optimizer_module = _tf_internal.keras_private_module("optimizers.optimizer")
    cls = optimizer_module.Optimizer
    original = keras_members.deduplicate_sparse_grad(cls)

    def _deduplicate_sparse_grad(self, grads):
        result = []
        for grad in grads:
            values = grad.values if isinstance(grad, tf.IndexedSlices) else None
            with on_ps_device_of(values):
                if values is not None and values.dtype in _HALF_DTYPES:
                    # A half-precision table's rows (HybridOptions.table_dtype) are
                    # summed in float32: in bfloat16 a hot id's sum would stop
                    # growing once it is 256 times a row's gradient.
                    grad = tf.IndexedSlices(tf.cast(values, tf.float32), grad.indices,
                                            grad.dense_shape)
                result.extend(original(self, [grad]))
        return result

    keras_members.set_deduplicate_sparse_grad(cls, _deduplicate_sparse_grad)

    def undo():
        keras_members.set_deduplicate_sparse_grad(cls, original)

    return undo


class PsGradientQueues:
    """One queue of sparse gradients per (PS task, value dtype, worker).

    Example (what `Reduction` does in a synchronous step; every worker
    hands in, the worker that updates ps:0's shards takes after a barrier):

    ```python
    queues = PsGradientQueues(num_workers=2)
    hand_in_op = queues.hand_in(0, worker_index, slices)
    # ... a collective that waits for every worker's hand_in_op ...
    global_slices = queues.take(0, slices)
    ```

    Args:
        num_workers: Workers that hand in gradients every step.
        device_fn: PS index -> device of its queues and of the take's ops
            (default: that PS task's CPU; tests use a local device).
    """

    def __init__(self, num_workers: int, device_fn: Callable[[int], str] = ps_device):
        self.num_workers = int(num_workers)
        self._device_fn = device_fn
        # Each instance names its queues afresh. Eager `tf.queue.FIFOQueue`
        # names a queue by a process-local counter, so a restarted chief
        # would get the queue its predecessor left on the PS, with the
        # elements of the step that failed still in it (the next step's
        # hand-ins then block on the full queue). uuid4, not `random`: a
        # user's `set_random_seed` must not repeat it either.
        self._name = f"tf_psplugin_sparse_grads_{uuid.uuid4().hex}"
        self._queues: Dict[Tuple[int, tf.DType, int], tf.Tensor] = {}
        self._stacked: Dict[Tuple[int, tf.DType], tf.Tensor] = {}  # See `_handles`.

    def _queue(self, ps_index: int, dtype: tf.DType, worker: int) -> tf.Tensor:
        """The handle of ps:`ps_index`'s queue for `worker`'s `dtype` values."""
        key = (int(ps_index), dtype, int(worker))
        if key not in self._queues:
            # Created once, eagerly, on the PS (also when first needed while a
            # step is traced): the step functions capture its handle. The raw
            # op, because only it takes our shared_name in eager mode.
            # Capacity 1: a worker's next hand-in waits until its last one
            # was taken (the end-of-step barrier already keeps it out).
            with tf.init_scope(), tf.device(self._device_fn(ps_index)):
                self._queues[key] = tf.raw_ops.FIFOQueueV2(
                    component_types=_COMPONENT_TYPES + [dtype], shapes=[], capacity=1,
                    container="",
                    shared_name=f"{self._name}_ps{int(ps_index)}_{dtype.name}_w{int(worker)}")
        return self._queues[key]

    def hand_in(self, ps_index: int, worker_index: tf.Tensor,
                slices: Sequence[tf.IndexedSlices]) -> tf.Operation:
        """Enqueues this worker's sparse gradients for shards on ps:`ps_index`.

        Args:
            ps_index: The PS task that holds the shards.
            worker_index: This worker's index (a scalar tensor: one trace may
                serve several workers; its queue is then picked at run time,
                on the PS). A tensor with a static value, or an int, picks it
                while tracing.
            slices: One IndexedSlices per shard, indices local to the shard.

        Returns:
            The enqueue op (it runs on the PS; its inputs come from here).
        """
        dtype = slices[0].values.dtype
        counts = tf.stack([tf.shape(s.indices, out_type=tf.int64)[0] for s in slices])
        flat_idx = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0)
        flat_val = tf.concat([tf.reshape(s.values, [-1]) for s in slices], axis=0)
        components = [counts, flat_idx, flat_val]
        static_index = tf.get_static_value(worker_index)
        if static_index is not None:
            handle = self._queue(ps_index, dtype, int(static_index))
        else:
            # One trace may serve several workers: pick this worker's queue
            # at run time, on the PS (only the index is sent there for it).
            # The enqueue stays a plain op of the step's graph, no control
            # flow: the checks that every take waits for every hand-in see it.
            with tf.device(self._device_fn(ps_index)):
                handle = tf.gather(self._handles(ps_index, dtype), worker_index)
        return tf.raw_ops.QueueEnqueueV2(handle=handle, components=components)

    def _handles(self, ps_index: int, dtype: tf.DType) -> tf.Tensor:
        """ps:`ps_index`'s queue handles for `dtype`, one per worker, stacked (on the PS)."""
        key = (int(ps_index), dtype)
        if key not in self._stacked:
            with tf.init_scope(), tf.device(self._device_fn(ps_index)):
                self._stacked[key] = tf.stack(
                    [self._queue(ps_index, dtype, w) for w in range(self.num_workers)])
        return self._stacked[key]

    def take(self, ps_index: int, slices: Sequence[tf.IndexedSlices]) -> List[tf.IndexedSlices]:
        """Dequeues every worker's gradients for ps:`ps_index`; sums nothing.

        Runs on the PS. Call it only once every worker's `hand_in` for this
        step has completed (after a barrier), or it waits for them.

        Args:
            ps_index: The PS task.
            slices: This worker's slices for the same shards, in the order
                given to `hand_in` (for row widths, dtypes and dense shapes).

        Returns:
            Per shard, every worker's slices concatenated in worker order
            (duplicate indices not combined), on ps:`ps_index`.
        """
        k = len(slices)
        dtype = slices[0].values.dtype
        widths = [collectives.row_width(s) for s in slices]
        with tf.device(self._device_fn(ps_index)):
            idx_pieces, val_pieces = [], []  # [worker][shard]
            for w in range(self.num_workers):
                counts, flat_idx, flat_val = tf.raw_ops.QueueDequeueV2(
                    handle=self._queue(ps_index, dtype, w),
                    component_types=_COMPONENT_TYPES + [dtype])
                # The queue has no static shapes.
                counts.set_shape([k])
                flat_idx.set_shape([None])
                flat_val.set_shape([None])
                if k == 1:
                    idx_pieces.append([flat_idx])
                    val_pieces.append([flat_val])
                else:
                    idx_pieces.append(tf.split(flat_idx, counts, num=k))
                    val_pieces.append(tf.split(
                        flat_val, counts * tf.constant(widths, tf.int64), num=k))
            out = []
            for j, s in enumerate(slices):
                idx = tf.concat([pieces[j] for pieces in idx_pieces], axis=0)
                val = tf.concat([pieces[j] for pieces in val_pieces], axis=0)
                # The static row shape (`row_width` checked it is known): a
                # `tf.shape` of this worker's values under this PS device
                # would send its whole gradient to the PS a second time
                # (benchmarks.profile measured ~0.43 MB per step per worker).
                values = tf.reshape(val, [-1] + s.values.shape[1:].as_list())
                out.append(tf.IndexedSlices(values, tf.cast(idx, s.indices.dtype),
                                            s.dense_shape))
        return out
