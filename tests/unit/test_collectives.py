"""Instance keys, dense buckets and 16-bit wire dtypes of `CollectiveGroup` (no cluster needed).

The coordinator traces one copy of a synchronous step per worker; the copies
of one collective must carry the same instance key, and collectives of
different functions must not share one.
"""

import pytest
import tensorflow as tf

from tf_psplugin.sync import collectives
from tf_psplugin.sync.collectives import CollectiveGroup


def _keys_of_trace(group, n):
    keys = []

    @tf.function(autograph=False)
    def step():
        for _ in range(n):
            keys.append(group.next_instance_key())
        return tf.constant(0)

    step.get_concrete_function()
    return keys


def test_every_trace_in_a_block_gets_the_same_keys():
    group = CollectiveGroup(2)
    before = _keys_of_trace(group, 2)
    with group.same_keys_per_trace():
        per_worker = [_keys_of_trace(group, 3) for _ in range(3)]
    after = _keys_of_trace(group, 1)
    assert per_worker[0] == per_worker[1] == per_worker[2]
    assert len(set(per_worker[0])) == 3
    # Keys of other functions never collide with the block's.
    assert not set(before) & set(per_worker[0])
    assert after[0] > max(per_worker[0])


def test_a_block_without_traces_uses_no_keys():
    group = CollectiveGroup(2)
    first = _keys_of_trace(group, 1)
    with group.same_keys_per_trace():
        pass
    assert _keys_of_trace(group, 1) == [first[0] + 1]


def test_a_longer_trace_moves_the_counter_past_its_keys():
    group = CollectiveGroup(2)
    with group.same_keys_per_trace():
        short = _keys_of_trace(group, 1)
        long = _keys_of_trace(group, 4)
    assert long[0] == short[0]
    assert _keys_of_trace(group, 1)[0] == long[-1] + 1


# -- buckets of the dense all-reduce (HybridOptions.dense_bucket_bytes) ---------------


@pytest.mark.parametrize("nbytes,bucket_bytes,expected", [
    # No bucket size: one bucket of everything, in order.
    ([8, 8, 8], 0, [[0, 1, 2]]),
    ([8, 8, 8], None, [[0, 1, 2]]),
    ([], 16, []),
    # Filled from the last tensor, closed at >= bucket_bytes.
    ([8, 8, 8, 8, 8], 16, [[3, 4], [1, 2], [0]]),
    # A large tensor closes the bucket it joins; a large first one too.
    ([4, 100, 4, 4], 16, [[1, 2, 3], [0]]),
    ([100, 4, 4], 16, [[0, 1, 2]]),
    # A size not known while tracing closes its bucket as a large one does.
    ([4, None, 4], 16, [[1, 2], [0]]),
    # Every tensor over the size: one bucket each, the last first.
    ([32, 32, 32], 16, [[2], [1], [0]]),
])
def test_buckets_are_filled_from_the_last_tensor(nbytes, bucket_bytes, expected):
    assert collectives.plan_buckets(nbytes, bucket_bytes) == expected


@pytest.mark.parametrize("bucket_bytes,workers,expected", [
    # Asked for: used as asked, wherever the workers are.
    (0, ["10.0.0.1:2222", "10.0.0.2:2222"], 0),
    (4096, ["127.0.0.1:1", "127.0.0.1:2"], 4096),
    # The default (None) on one host: one packed all-reduce (loopback in any spelling).
    (None, ["127.0.0.1:20001", "127.0.0.1:20002"], 0),
    (None, ["localhost:1", "127.0.0.2:2", "[::1]:3"], 0),
    (None, ["trainer-0.svc:2222", "TRAINER-0.svc:2223"], 0),
    (None, ["10.0.0.1:2222"], 0),
    (None, [], 0),
    # ... on workers of several hosts: buckets (a sparse spec's {index: address} too).
    (None, ["10.0.0.1:2222", "10.0.0.2:2222"], collectives.MULTI_HOST_BUCKET_BYTES),
    (None, ["worker-0.job:2222", "worker-1.job:2222"], collectives.MULTI_HOST_BUCKET_BYTES),
    (None, ["[fd00::1]:2222", "[fd00::2]:2222"], collectives.MULTI_HOST_BUCKET_BYTES),
    (None, {0: "10.0.0.1:2222", 3: "10.0.0.4:2222"}, collectives.MULTI_HOST_BUCKET_BYTES),
])
def test_default_bucket_size_follows_the_workers_hosts(bucket_bytes, workers, expected):
    """HybridOptions(dense_bucket_bytes=None): buckets only when the workers span hosts."""
    assert collectives.bucket_bytes_for(bucket_bytes, workers) == expected


def test_every_bucket_is_its_own_collective_and_waits_for_no_later_bucket():
    """Keys in bucket order (the same on every worker); a bucket never waits for a later one.

    tf.function's automatic control dependencies chain the collectives (stateful
    ops without a resource input) in trace order: each bucket's all-reduce
    starts once its own tensors are ready and the bucket before it is summed.
    """
    group = CollectiveGroup(2)
    specs = [tf.TensorSpec([3], tf.float32), tf.TensorSpec([2, 2], tf.float32),
             tf.TensorSpec([5], tf.float32), tf.TensorSpec([], tf.int64)]

    @tf.function(autograph=False)
    def step(a, b, c, n):
        return group.all_reduce_buckets([[c, n], [a, b]])

    graph = step.get_concrete_function(*specs).graph
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    # Bucket 0: one collective per dtype (float32 c, int64 n); bucket 1: a and b packed.
    keys = [int(tf.get_static_value(op.inputs[3])) for op in reduces]
    assert keys == sorted(keys) and len(set(keys)) == 3
    placeholders = {op.name: op for op in graph.get_operations() if op.type == "Placeholder"}
    a, b, c, n = (placeholders[x] for x in ("a", "b", "c", "n"))
    for op in reduces[:2]:
        assert not {a.name, b.name} & _ancestors(op), op.name
    assert {a.name, b.name} <= _ancestors(reduces[2])
    assert {reduces[0].name, reduces[1].name} <= _ancestors(reduces[2])


def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        if o.name not in seen:
            seen.add(o.name)
            todo.extend(t.op for t in o.inputs)
            todo.extend(o.control_inputs)
    return seen


# -- the dense gradients in 16 bits (HybridOptions.dense_allreduce_dtype) --------------


@pytest.mark.parametrize("compress_to,expected", [
    (None, [None, None, None, None, None]),
    # float32 and float64 travel in 16 bits; 16-bit floats and integers in their own.
    ("bfloat16", [tf.bfloat16, tf.bfloat16, None, None, None]),
    ("float16", [tf.float16, tf.float16, None, None, None]),
])
def test_only_wider_floats_are_compressed(compress_to, expected):
    dtypes = [tf.float32, tf.float64, tf.bfloat16, tf.float16, tf.int64]
    assert collectives.wire_dtypes(dtypes, compress_to) == expected


def test_an_unknown_wire_dtype_is_refused():
    with pytest.raises(ValueError, match="dense_allreduce_dtype='int8'.*Fix:"):
        collectives.wire_dtypes([tf.float32], "int8")


def _reduce_graph(group, specs, wire, mean=False):
    @tf.function(autograph=False)
    def step(*tensors):
        return group.all_reduce_packed(list(tensors), mean=mean, wire=wire)

    fn = step.get_concrete_function(*specs)
    return fn, [op for op in fn.graph.get_operations() if op.type == "CollectiveReduceV2"]


def test_compressed_gradients_share_a_16_bit_collective_and_riders_keep_theirs():
    """The cast plan: gradients cast to bfloat16, packed, summed, cast back; riders exact."""
    group = CollectiveGroup(2)
    specs = [tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([5], tf.float64),
             tf.TensorSpec([], tf.float32)]  # Two gradients, then a rider (a count).
    wire = collectives.wire_dtypes([s.dtype for s in specs[:2]], "bfloat16") + [None]
    fn, reduces = _reduce_graph(group, specs, wire)
    assert [op.inputs[0].dtype for op in reduces] == [tf.bfloat16, tf.float32]
    assert reduces[0].inputs[0].shape.as_list() == [11]  # Both gradients in one pack.
    assert reduces[1].inputs[0].shape.as_list() == [1]
    assert [o.dtype for o in fn.outputs] == [tf.float32, tf.float64, tf.float32]
    assert [o.shape.as_list() for o in fn.outputs] == [[3, 2], [5], []]


def test_a_compressed_mean_is_divided_after_the_cast_back():
    group = CollectiveGroup(2)
    specs = [tf.TensorSpec([4], tf.float32), tf.TensorSpec([2], tf.float32)]
    _, reduces = _reduce_graph(group, specs, [tf.bfloat16, None], mean=True)
    final_ops = {op.inputs[0].dtype: op.get_attr("final_op") for op in reduces}
    assert final_ops == {tf.bfloat16: b"Id", tf.float32: b"Div"}


def test_a_group_of_one_casts_nothing():
    # No collective, so nothing to compress: the values come back exact.
    group = CollectiveGroup(1)
    value = tf.constant([1.0 + 2.0**-12, 3.0], tf.float32)  # Not a bfloat16 value.
    out, = group.all_reduce_packed([value], wire=[tf.bfloat16])
    assert out.dtype == tf.float32 and out.numpy().tolist() == value.numpy().tolist()
