"""Collective communication among the workers of the AllReduce group.

Dense gradients are summed across workers with packed all-reduces: one per
step, or one per bucket of about `HybridOptions.dense_bucket_bytes` when the
step's gradients are split (`plan_buckets`), so that the last layers'
gradients, which the backward pass produces first, are summed while it still
computes the earlier layers' (as Horovod's tensor fusion and PyTorch DDP's
buckets do). With `HybridOptions.dense_allreduce_dtype` the gradients
travel in 16 bits (`wire_dtypes`): each is cast to that dtype for its
collective and back to its own dtype after it, halving the bytes the ring
moves (PyTorch DDP's ``bf16_compress_hook``, Horovod's
``Compression.fp16``); the values riding along in the last bucket (metric
and batch-norm deltas, the loss-scaling count) stay in their own dtype, in
a collective of their own. Embedding gradients in
``"sync"`` mode are summed on their PS (`sparse_exchange.py`) after a
barrier from here; with ``experimental_sparse_exchange="allgather"`` they are
all-gathered, also packed, so every worker sees the global sparse gradient
and exactly one worker applies it to each PS shard.

Instance keys are handed out at trace time, one per collective op, as
MultiWorkerMirroredStrategy's CollectiveKeys do. The coordinator traces one
copy of a step per update role, all in `CollectiveGroup.same_keys_per_trace`, so
the copies of a collective share its key; a collective reused
in later steps (or in a `tf.range` loop) is ordered by its data dependencies.
"""

import contextlib
import threading
from typing import List, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal.tf_internal import collective_ops
from tf_psplugin.cluster import ports
from tf_psplugin.sync import replicated

# Padded all-gathers use buffers of 2**b elements, b in this range.
_MIN_BUCKET_LOG2, _MAX_BUCKET_LOG2 = 8, 40

# Group keys below 100 are left to TF's own strategies.
DEFAULT_GROUP_KEY = 7001

# HybridOptions.dense_allreduce_dtype's values: the dtypes a dense gradient
# may travel in. CollectiveReduceV2 sums both on CPU (ring reducer, TF 2.15
# and 2.21; tests/unit/test_collectives.py checks it on the TF it runs).
WIRE_DTYPES = ("bfloat16", "float16")

# The gradients that are compressed: wider floats (a gradient already in 16
# bits, an integer or a complex one travels in its own dtype).
_COMPRESSIBLE = (tf.float32, tf.float64)


class CollectiveGroup:
    """The workers' collective group: size, group key and instance keys.

    Args:
        group_size: Number of workers taking part.
        group_key: Integer naming the group; identical on every worker.

    Collectives are issued without a per-op timeout: TF's collective executor
    (TF 2.15-2.21) arms the timeout by scheduling a closure on a *new OS
    thread* per op (`Env::SchedClosureAfter`), which sleeps for the whole
    timeout even when the op finished in a millisecond, so a job doing ~20
    collectives a second with a 60 s timeout holds ~1,200 sleeping threads
    per worker and dies of thread exhaustion after ~700 steps. A hung peer is
    detected by the coordinator's step watchdog instead (one thread on the
    chief, see `coordinator.py`).
    """

    def __init__(self, group_size: int, group_key: int = DEFAULT_GROUP_KEY):
        if group_size < 1:
            raise ValueError(f"CollectiveGroup.group_size must be >= 1, got {group_size}.")
        self.group_size = int(group_size)
        self.group_key = int(group_key)
        self._lock = threading.Lock()
        self._next_key = 1
        self._block_start = self._block_end = self._block_graph = None

    def next_instance_key(self) -> int:
        """Returns a fresh instance key (called while tracing)."""
        with self._lock:
            if self._block_start is not None:
                # Inside `same_keys_per_trace`: every function graph traced
                # in the block numbers its collectives from the block's start.
                graph = replicated.outermost_function_graph()
                if graph is not self._block_graph:
                    self._block_end = max(self._block_end, self._next_key)
                    self._block_graph = graph
                    self._next_key = self._block_start
            key = self._next_key
            self._next_key += 1
            return key

    @contextlib.contextmanager
    def same_keys_per_trace(self):
        """Gives every function traced in this block the same instance keys.

        The coordinator traces one copy of a step per update role. The
        copies issue the same collectives in the same order, and the copies
        of one collective must share its instance key, so each trace numbers
        its collectives from the key where the block began. (A tf.function
        that creates variables is traced twice on its first call; both traces
        get the same keys too.) Not reentrant.
        """
        with self._lock:
            if self._block_start is not None:
                raise RuntimeError("CollectiveGroup.same_keys_per_trace is not reentrant.")
            self._block_start = self._block_end = self._next_key
            self._block_graph = None
        try:
            yield
        finally:
            with self._lock:
                self._next_key = max(self._block_end, self._next_key)
                self._block_start = self._block_end = self._block_graph = None

    def all_reduce(self, tensor: tf.Tensor, merge_op: str = "Add",
                   final_op: str = "Id") -> tf.Tensor:
        """All-reduces one dense tensor across the group."""
        if self.group_size == 1:
            return tf.identity(tensor)
        return collective_ops.all_reduce_v2(
            tensor, group_size=self.group_size, group_key=self.group_key,
            instance_key=self.next_instance_key(), merge_op=merge_op, final_op=final_op)

    def all_gather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Concatenates every worker's tensor along axis 0 (equal shapes)."""
        if self.group_size == 1:
            return tf.identity(tensor)
        return collective_ops.all_gather_v2(
            tensor, group_size=self.group_size, group_key=self.group_key,
            instance_key=self.next_instance_key())

    def all_reduce_packed(self, tensors: Sequence[tf.Tensor], mean: bool = False,
                          wire: Optional[Sequence[Optional[tf.DType]]] = None) -> List[tf.Tensor]:
        """Sums (or averages) a list of dense tensors with one collective per dtype.

        Tensors are flattened, grouped by the dtype they travel in,
        concatenated, reduced once per group and split back.

        Args:
            tensors: Dense tensors, any shapes.
            mean: Divide by the group size.
            wire: Per tensor, the dtype it travels in (`wire_dtypes`), None
                for its own; None: every tensor in its own. A tensor sent in
                another dtype is cast to it before the collective and back
                after it (then divided, with `mean`, in its own dtype). With
                a group of one nothing is cast: there is no collective.

        Returns:
            The reduced tensors, same shapes and dtypes as the inputs.
        """
        if wire is None or self.group_size == 1:
            wire = [None] * len(tensors)
        if len(wire) != len(tensors):
            raise ValueError(f"all_reduce_packed: {len(wire)} wire dtypes for "
                             f"{len(tensors)} tensors.")
        results: List[Optional[tf.Tensor]] = [None] * len(tensors)
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(wire[i] or t.dtype, []).append(i)
        for dtype, idxs in by_dtype.items():
            cast = [tensors[i].dtype != dtype for i in idxs]
            flat = [tf.reshape(tf.cast(tensors[i], dtype) if c else tensors[i], [-1])
                    for i, c in zip(idxs, cast)]
            packed = flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)
            # A compressed pack is summed, and averaged after the cast back.
            divide_here = mean and any(cast)
            reduced = self.all_reduce(packed, final_op="Div" if mean and not divide_here else "Id")
            sizes = [tf.size(f) for f in flat]
            pieces = [reduced] if len(flat) == 1 else tf.split(reduced, tf.stack(sizes), num=len(flat))
            for i, c, piece in zip(idxs, cast, pieces):
                if c:
                    piece = tf.cast(piece, tensors[i].dtype)
                if divide_here:
                    piece = piece / tf.cast(self.group_size, piece.dtype)
                results[i] = tf.reshape(piece, tf.shape(tensors[i]))
        return results  # type: ignore[return-value]

    def all_reduce_buckets(self, buckets: Sequence[Sequence[tf.Tensor]], mean: bool = False,
                           compress_to: Optional[str] = None) -> List[List[tf.Tensor]]:
        """Sums (or averages) each bucket of dense tensors with its own packed collective.

        The buckets' collectives take their instance keys in the order of
        `buckets` (the same on every worker, as every worker traces the same
        step), and each runs as soon as its own tensors are ready: a bucket
        waits neither for the tensors of another bucket nor for its
        collective. Each element is reduced as by `all_reduce_packed` of
        all the tensors at once (one sum of the same values per element).

        Args:
            buckets: Lists of dense tensors, any shapes and dtypes.
            mean: Divide by the group size.
            compress_to: `HybridOptions.dense_allreduce_dtype`: the float32
                and float64 tensors travel in that dtype (`wire_dtypes`);
                None: every tensor in its own.

        Returns:
            Per bucket, the reduced tensors, same shapes and dtypes as the inputs.
        """
        return [self.all_reduce_packed(
            bucket, mean=mean, wire=wire_dtypes([t.dtype for t in bucket], compress_to))
            for bucket in buckets]

    def all_gather_indexed_slices(self, slices: Sequence[tf.IndexedSlices]) -> List[tf.IndexedSlices]:
        """All-gathers sparse gradients from every worker, packed.

        Workers may hold different numbers of rows, so row counts are gathered
        first, every buffer is padded to the longest, gathered, and the
        padding is masked away. Three collectives in total, whatever the
        number of tables.

        Args:
            slices: IndexedSlices; values of each may have any row width.

        Returns:
            For each input, the concatenation of every worker's slices (the
            global sparse gradient, duplicates not combined).
        """
        if not slices:
            return []
        if self.group_size == 1:
            return list(slices)
        k = len(slices)
        rows = [tf.shape(s.indices, out_type=tf.int64)[0] for s in slices]
        widths = [row_width(s) for s in slices]
        value_dtype = slices[0].values.dtype
        counts = tf.stack(rows)  # [k]
        all_counts = tf.reshape(self.all_gather(counts), [self.group_size, k])
        flat_idx = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0)
        flat_val = tf.concat(
            [tf.reshape(tf.cast(s.values, value_dtype), [-1]) for s in slices], axis=0)
        width_t = tf.constant(widths, tf.int64)
        idx_len = tf.reduce_sum(all_counts, axis=1)  # per worker
        val_len = tf.reduce_sum(all_counts * width_t[tf.newaxis, :], axis=1)
        max_idx, max_val = tf.reduce_max(idx_len), tf.reduce_max(val_len)
        g_idx = tf.reshape(self._all_gather_bucketed(flat_idx, max_idx), [self.group_size, -1])
        g_val = tf.reshape(self._all_gather_bucketed(flat_val, max_val), [self.group_size, -1])
        per_var_idx: List[List[tf.Tensor]] = [[] for _ in range(k)]
        per_var_val: List[List[tf.Tensor]] = [[] for _ in range(k)]
        for w in range(self.group_size):
            c = all_counts[w]
            idx_parts = tf.split(g_idx[w, :idx_len[w]], c, num=k)
            val_parts = tf.split(g_val[w, :val_len[w]], c * width_t, num=k)
            for j in range(k):
                per_var_idx[j].append(idx_parts[j])
                per_var_val[j].append(val_parts[j])
        out = []
        for j, s in enumerate(slices):
            values = tf.concat(per_var_val[j], axis=0)
            values = tf.reshape(values, tf.concat([[-1], tf.shape(s.values)[1:]], axis=0))
            indices = tf.cast(tf.concat(per_var_idx[j], axis=0), s.indices.dtype)
            out.append(tf.IndexedSlices(tf.cast(values, s.values.dtype), indices, s.dense_shape))
        return out

    def _all_gather_bucketed(self, flat: tf.Tensor, max_len: tf.Tensor) -> tf.Tensor:
        """All-gathers a 1-D tensor padded to the power of two >= `max_len`.

        A collective instance keeps the shape of its first execution (TF
        2.15: "Shape mismatch in the collective instance N ... expected shape
        [17000] but another member in the group expected shape [17264]" on
        the next step whose longest buffer differs, e.g. with de-duplicated
        ids). So every bucket size gets its own collective (own instance key,
        assigned identically on every worker at trace time) and the step runs
        the one its `max_len` (equal on every worker) selects.

        Args:
            flat: This worker's 1-D buffer, at most `max_len` long.
            max_len: int64 scalar, the longest buffer of any worker.

        Returns:
            [group_size * bucket] gathered, padded buffers.
        """
        bounds = [1 << b for b in range(_MIN_BUCKET_LOG2, _MAX_BUCKET_LOG2 + 1)]
        index = tf.reduce_sum(tf.cast(max_len > tf.constant(bounds, tf.int64), tf.int32))
        length = tf.shape(flat, out_type=tf.int64)[0]

        def branch(bound):
            return lambda: self.all_gather(tf.pad(flat, [[0, bound - length]]))

        return tf.switch_case(index, [branch(b) for b in bounds])

    def barrier(self, control_inputs: Sequence = ()) -> tf.Tensor:
        """A collective that completes only when every worker reached it.

        Args:
            control_inputs: Ops that must have run on this worker first.

        Returns:
            A scalar tensor; depend on it to order later ops after the barrier.
        """
        with tf.control_dependencies(list(control_inputs)):
            token = tf.constant(0.0)
        return self.all_reduce(token)


def plan_buckets(nbytes: Sequence[Optional[int]], bucket_bytes: Optional[int]) -> List[List[int]]:
    """Splits tensors into all-reduce buckets of about `bucket_bytes`, last tensor first.

    Backpropagation produces the gradients of a model's last layers first,
    and a model's variables (so its gradients) come in the order of its
    layers, so buckets are filled from the end of the list: bucket 0 holds
    the last tensors. A bucket is closed once it holds `bucket_bytes` or
    more (a tensor of that size or more closes the bucket it joins).

    Args:
        nbytes: Each tensor's size in bytes; None when not known while
            tracing (such a tensor closes its bucket, as a large one does).
        bucket_bytes: The bucket size; 0 or None: one bucket of everything.

    Returns:
        Lists of indices into `nbytes`, each list in the tensors' order;
        together every index once. No list when `nbytes` is empty.
    """
    if not nbytes:
        return []
    if not bucket_bytes:
        return [list(range(len(nbytes)))]
    buckets: List[List[int]] = []
    current: List[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        current.append(i)
        size += bucket_bytes if nbytes[i] is None else nbytes[i]
        if size >= bucket_bytes:
            buckets.append(sorted(current))
            current, size = [], 0
    if current:
        buckets.append(sorted(current))
    return buckets


# `HybridOptions(dense_bucket_bytes=None)` on workers of more than one host:
# measured 1.10x examples/s on 8 emulated hosts at 50 Mbit/s, against 1.04x
# with 1 MiB buckets (benchmarks/README.md, "Bucketed dense all-reduce").
MULTI_HOST_BUCKET_BYTES = 262144

# Addresses of this machine however a cluster spec names it.
_LOOPBACK_HOSTS = ("localhost", "::1", "0.0.0.0")


def _host_of(address: str) -> str:
    """The host part of a ``host:port`` task address (``[v6]:port`` too), lower case."""
    address = address.strip().lower()
    # "host:port" and "[v6]:port" end in their port; a bare v6 literal has none.
    if address.count(":") == 1 or "]:" in address:
        address = address.rsplit(":", 1)[0]
    host = ports.strip_brackets(address)
    if host.startswith("127.") or host in _LOOPBACK_HOSTS:
        return "localhost"
    return host


def bucket_bytes_for(bucket_bytes: Optional[int], worker_addresses) -> int:
    """The bucket size a step uses: `bucket_bytes`, or, if None, one chosen for the cluster.

    Buckets let the last layers' all-reduce run during the backward pass:
    on workers of separate hosts the ring's transfers then overlap the
    compute (1.10x on 8 emulated hosts). Workers that share one host share
    its cores too: there the backward passes compete with each other and
    the extra collectives cost more than they hide (0.84-0.87x on one
    2-core box). The sums are the same either way, bit for bit
    (`plan_buckets` only splits the packed all-reduce).

    Args:
        bucket_bytes: `HybridOptions.dense_bucket_bytes` (0: one all-reduce;
            None: chosen here).
        worker_addresses: The workers' ``host:port`` addresses (a list, or
            a sparse cluster spec's ``{index: address}``).

    Returns:
        0 (one packed all-reduce) if `bucket_bytes` is 0, or if it is None
        and every worker is on one host (loopback counts as one);
        `MULTI_HOST_BUCKET_BYTES` if it is None and the workers span hosts;
        else `bucket_bytes`.
    """
    if bucket_bytes is not None:
        return int(bucket_bytes)
    if isinstance(worker_addresses, dict):  # A sparse cluster spec: {index: address}.
        worker_addresses = list(worker_addresses.values())
    hosts = {_host_of(a) for a in worker_addresses}
    return MULTI_HOST_BUCKET_BYTES if len(hosts) > 1 else 0


def wire_dtypes(dtypes: Sequence[tf.DType],
                compress_to: Optional[str]) -> List[Optional[tf.DType]]:
    """The dtype each dense gradient travels in (`HybridOptions.dense_allreduce_dtype`).

    Args:
        dtypes: The gradients' dtypes.
        compress_to: One of `WIRE_DTYPES`, or None (no compression).

    Returns:
        Per gradient, `compress_to` as a `tf.DType` for a float32 or float64
        gradient, None (its own dtype) for any other and for all of them
        without `compress_to`.

    Raises:
        ValueError: `compress_to` is not one of `WIRE_DTYPES`.
    """
    if compress_to is None:
        return [None] * len(dtypes)
    if compress_to not in WIRE_DTYPES:
        raise ValueError(f"dense_allreduce_dtype={compress_to!r} is not supported. Fix: use "
                         f"None or one of {', '.join(map(repr, WIRE_DTYPES))}.")
    target = tf.as_dtype(compress_to)
    return [target if tf.as_dtype(d).base_dtype in _COMPRESSIBLE else None for d in dtypes]


def row_width(s: tf.IndexedSlices) -> int:
    """Elements per row of a sparse gradient (its static embedding width)."""
    shape = s.values.shape[1:]
    if not shape.is_fully_defined():
        raise ValueError(
            "tf_psplugin: an embedding gradient has rows of unknown width "
            f"{s.values.shape}; tables must have a static embedding dimension.")
    width = 1
    for d in shape:
        width *= int(d)
    return width
