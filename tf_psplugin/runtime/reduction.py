"""Reduction in a synchronous step: dense gradients all-reduced, sparse ones via the PS.

While a synchronous step is traced, `HybridExtended._reduce_to` and
`_batch_reduce_to` (what Keras's optimizers call through the strategy) come
here: dense values are summed across workers with packed collective
all-reduces, one per bucket of about `HybridOptions.dense_bucket_bytes`
(the last layers' gradients first, so their all-reduce overlaps the rest of
the backward pass; metric and batch-norm deltas riding along in the last
bucket), in 16 bits with `HybridOptions.dense_allreduce_dtype` (the
gradients only: what rides along stays exact), embedding gradients
are handed in to the PS that holds their shard and summed there (or
all-gathered, `experimental_sparse_exchange="allgather"`). Every reduction is counted
(`reduced_steps`, for failover) before any update may run.
"""

from typing import List, NamedTuple

import tensorflow as tf

from tf_psplugin.runtime.variable_creation import _unwrap
from tf_psplugin.sync import collectives
from tf_psplugin.sync import loss_scaling as loss_scaling_lib
from tf_psplugin.sync import replicated
from tf_psplugin.sync import sparse_exchange as sparse_exchange_lib


class Reduction:
    """A synchronous step's reductions among the workers.

    One per `HybridExtended` (its `reduction`), which calls it while a sync
    step is traced and keeps stock's reduction otherwise. Owns the per-PS
    gradient queues of the ``"ps"`` sparse exchange (`sparse_exchange.py`).

    Example (what `HybridExtended._batch_reduce_to` does in a sync step):

    ```python
    reduction = Reduction(extended, creation, num_workers=2)
    grads = reduction.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)
    ```

    Args:
        extended: The `HybridExtended` (modes, collective group, on-read
            updates, tracing state, step counters).
        creation: Its `VariableCreation` (which destinations are tables).
        num_workers: Workers in the cluster.
    """

    def __init__(self, extended, creation, num_workers: int):
        self._extended = extended
        self._creation = creation
        self._num_workers = num_workers
        self._gradient_queues = sparse_exchange_lib.PsGradientQueues(num_workers)

    def _sync_embeddings(self) -> bool:
        return self._extended.embedding_updates == "sync"

    def reduce_to(self, reduce_op, value):
        """`HybridExtended._reduce_to` in a sync step: one packed all-reduce among the workers."""
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        flat = tf.nest.flatten(value)
        dense = [tf.convert_to_tensor(v) for v in flat]
        reduced = self._extended.collective_group.all_reduce_packed(dense, mean=mean)
        return tf.nest.pack_sequence_as(value, reduced)

    def batch_reduce_to(self, reduce_op, value_destination_pairs):
        """`HybridExtended._batch_reduce_to` in a sync step (Keras's gradient reduction).

        Dense values (and the step's pending metric deltas) in packed
        all-reduces, one per bucket (`_all_reduce_dense`); table gradients
        summed on their PS (``"ps"`` exchange) or all-gathered; then the reduction is counted (`_after_reduction`).

        Args:
            reduce_op: `tf.distribute.ReduceOp.SUM` or `MEAN`.
            value_destination_pairs: (value, destination variable) pairs.

        Returns:
            The reduced values, in order.
        """
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        values = [v for v, _ in value_destination_pairs]
        out = list(values)
        dense_idx, sparse_idx = [], []
        for i, (v, dest) in enumerate(value_destination_pairs):
            if isinstance(v, tf.IndexedSlices) and self._creation.is_table_var(dest):
                sparse_idx.append(i)
            else:
                dense_idx.append(i)
                if isinstance(v, tf.IndexedSlices):
                    values[i] = tf.convert_to_tensor(v)
        through_ps = bool(sparse_idx) and self._sync_embeddings() and self._exchange_through_ps()
        hand_in = None
        if through_ps:
            hand_in = self._hand_in([values[i] for i in sparse_idx],
                                    [value_destination_pairs[i][1] for i in sparse_idx])
        token = None
        # Under Keras's LossScaleOptimizer: this worker's non-finite values,
        # dense and table gradients, summed among the workers below.
        nonfinite = (loss_scaling_lib.local_nonfinite_count(values)
                     if loss_scaling_lib.agreeing() else None)
        if dense_idx or nonfinite is not None:
            # Metric and batch-norm updates recorded so far in the step ride
            # along (sums: only with a summed gradient).
            pending = self._extended.on_read_updates.take() if not mean else []
            extra = [] if nonfinite is None else [nonfinite]
            reduced, token = self._all_reduce_dense(
                [values[i] for i in dense_idx],
                [value_destination_pairs[i][1] for i in dense_idx],
                extra + self._extended.on_read_updates.deltas(pending),
                hand_in.ops if hand_in else [], mean)
            n = len(dense_idx)
            self._extended.on_read_updates.apply(pending, reduced[n + len(extra):])
            if nonfinite is not None:
                # (Averaged with a MEAN reduction: still 0 iff every value is finite.)
                loss_scaling_lib.record_agreed(reduced[n])
            for i, r in zip(dense_idx, reduced):
                out[i] = r
        if sparse_idx and self._sync_embeddings():
            sparse = [values[i] for i in sparse_idx]
            if through_ps:
                if token is None:
                    token = self._extended.collective_group.barrier(hand_in.ops)
                gathered = self._take(hand_in, token)
            else:
                gathered = self._extended.collective_group.all_gather_indexed_slices(sparse)
            for i, g in zip(sparse_idx, gathered):
                if mean:
                    # On the PS when summed there.
                    with sparse_exchange_lib.on_ps_device_of(g.values):
                        g = tf.IndexedSlices(g.values / self._num_workers, g.indices,
                                             g.dense_shape)
                out[i] = g
        return self._after_reduction(out)

    def _all_reduce_dense(self, dense, destinations, riders, hand_in_ops, mean: bool):
        """All-reduces a step's dense values, in buckets (`HybridOptions.dense_bucket_bytes`).

        The dense values are split into buckets of about that many bytes,
        last variable first (`collectives.plan_buckets`): each bucket's
        collective starts as soon as backpropagation has produced its
        gradients, while the earlier layers' are still being computed. The
        riders (the non-finite count under loss scaling, the metric and
        batch-norm deltas) go in the last bucket, which also waits for this
        worker's hand-ins to the PS queues: then that all-reduce doubles as
        the barrier the PS exchange needs (it completes on a worker only once
        every worker has handed in), one collective fewer a step. With no
        bucket size, everything is one packed all-reduce. With
        `HybridOptions.dense_allreduce_dtype` the float32 (and float64)
        dense values travel in that dtype (`collectives.wire_dtypes`) and the
        riders in their own, so the last bucket is two collectives.

        Args:
            dense: The dense values, in the variables' order.
            destinations: Their destination variables (sizes when a value's
                static shape is unknown).
            riders: Further dense tensors summed in the last bucket.
            hand_in_ops: The hand-in ops the last bucket waits for.
            mean: Average instead of sum.

        Returns:
            (`dense` + `riders` reduced, in that order; the token: a value of
            the last bucket, done only once every worker handed in).
        """
        group = self._extended.collective_group
        sizes = []
        for v, dest in zip(dense, destinations):
            elements = v.shape.num_elements()
            if elements is None:
                elements = dest.shape.num_elements()
            sizes.append(None if elements is None else elements * v.dtype.size)
        buckets = collectives.plan_buckets(sizes, self._extended.dense_bucket_bytes) or [[]]
        # The last bucket: the riders, and the wait for the hand-ins.
        *early, last = buckets
        compress_to = self._extended.dense_allreduce_dtype
        reduced: List = [None] * (len(dense) + len(riders))
        for bucket, results in zip(early, group.all_reduce_buckets(
                [[dense[i] for i in b] for b in early], mean=mean, compress_to=compress_to)):
            for i, r in zip(bucket, results):
                reduced[i] = r
        # Only the gradients are compressed: the riders travel in their own dtype.
        wire = (collectives.wire_dtypes([dense[i].dtype for i in last], compress_to)
                + [None] * len(riders))
        with tf.control_dependencies(hand_in_ops):
            results = group.all_reduce_packed([dense[i] for i in last] + list(riders), mean=mean,
                                              wire=wire)
        for i, r in zip(list(last) + list(range(len(dense), len(reduced))), results):
            reduced[i] = r
        return reduced, results[0]

    def _exchange_through_ps(self) -> bool:
        # A trace shared by several update roles (`tracing_worker_index` is
        # None: a concrete function was scheduled) cannot know which PS it
        # takes from; it all-gathers instead.
        return (self._extended.sparse_exchange == "ps" and self._num_workers > 1
                and self._extended.tracing_worker_index is not None)

    def _hand_in(self, slices, destinations) -> "_HandIn":
        """Hands this worker's sparse gradients to the PS queues (see `sparse_exchange`).

        Groups them by PS and dtype, in an order every worker shares.
        """
        groups = {}
        for j, (s, dest) in enumerate(zip(slices, destinations)):
            ps = tf.DeviceSpec.from_string(_unwrap(dest).device or "").task or 0
            groups.setdefault((ps, s.values.dtype), []).append(j)
        worker = replicated.current_worker_index()
        in_order = sorted(groups.items(), key=lambda g: (g[0][0], g[0][1].name))
        ops_ = [self._gradient_queues.hand_in(ps, worker, [slices[j] for j in js])
                for (ps, _), js in in_order]
        return _HandIn(list(slices), groups, ops_)

    def _take(self, hand_in: "_HandIn", token) -> List[tf.IndexedSlices]:
        """The global sparse gradients, once every worker handed in (`token`).

        Returns, per input, the global sparse gradient (on its PS) where this
        trace's role updates that PS, else the local slices (never applied:
        `_update` leaves other roles' shards out). All of them depend on the
        token, so no worker takes before every worker handed in.
        """
        slices = hand_in.slices
        role = self._extended.update_role(self._extended.tracing_worker_index)
        out = list(slices)
        with tf.control_dependencies([token]):
            for (ps, _), js in hand_in.groups.items():
                if ps in role:
                    taken = self._gradient_queues.take(ps, [slices[j] for j in js])
                    for j, g in zip(js, taken):
                        out[j] = g
                else:
                    for j in js:
                        out[j] = tf.IndexedSlices(tf.identity(slices[j].values),
                                                  slices[j].indices, slices[j].dense_shape)
        return out

    def _after_reduction(self, out):
        """Counts the reduction, makes every update wait for the count, opens the step."""
        if self._extended.reduced_steps is None:
            return out
        tensors, on_ps = [], {}
        for o in out:
            for t in [o.values, o.indices] if isinstance(o, tf.IndexedSlices) else [o]:
                device = sparse_exchange_lib.ps_device_of(t)
                if device:
                    on_ps.setdefault(device, []).append(t)
                else:
                    tensors.append(t)
        # Gradients summed on a PS stay there: one control edge per PS, and
        # the identities below are made on the PS too (an identity here
        # would copy the global gradient to this worker and back).
        for device, ts in on_ps.items():
            with tf.device(device):
                tensors.append(tf.group(ts))
        with tf.control_dependencies(tensors):
            counted = self._extended.reduced_steps.assign_add(1, read_value=False)
        result = []
        with tf.control_dependencies([counted]):
            for o in out:
                tensor = o.values if isinstance(o, tf.IndexedSlices) else o
                with sparse_exchange_lib.on_ps_device_of(tensor):
                    if isinstance(o, tf.IndexedSlices):
                        result.append(tf.IndexedSlices(tf.identity(o.values), o.indices,
                                                       o.dense_shape))
                    else:
                        result.append(tf.identity(o))
        replicated.open_step()
        return result


class _HandIn(NamedTuple):
    """One worker's sparse gradients handed in to the PS queues in a step."""

    slices: List[tf.IndexedSlices]
    groups: dict  # (ps task, dtype) -> indices into `slices`
    ops: list  # the enqueue ops, one per group
