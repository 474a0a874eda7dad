"""`tables/lookups.py`'s `lookup_tables`: several tables, one round trip per PS.

In one process the shard variables stand in for the PS tasks: the fused path
is the same graph, only the devices differ. The cluster test of the same
lookups under the strategy is tests/cluster/test_lookup_tables.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.tables.lookups import lookup_tables
from tf_psplugin.tables.sharded import InterleavedShardedVariable


def _tables(row_counts, width=4, num_shards=3, seed=0):
    rng = np.random.default_rng(seed)
    fulls = [rng.normal(size=(v, width)).astype("float32") for v in row_counts]
    tables = [InterleavedShardedVariable([tf.Variable(f[s::num_shards]) for s in range(num_shards)],
                                         name=f"t{i}") for i, f in enumerate(fulls)]
    return fulls, tables


def _lookup_and_grads(tables, ids, fused):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            if fused:
                outs = lookup_tables(tables, [tf.constant(i) for i in ids])
            else:
                outs = [tf.nn.embedding_lookup(t, tf.constant(i)) for t, i in zip(tables, ids)]
            # Weights make every row's gradient distinct.
            loss = sum(tf.reduce_sum(o * o * float(k + 1)) for k, o in enumerate(outs))
        grads = tape.gradient(loss, [v for t in tables for v in t.variables])
        return outs, [tf.convert_to_tensor(g) for g in grads]

    outs, grads = step()
    return [o.numpy() for o in outs], [g.numpy() for g in grads]


IDS = [np.array([[0, 9], [3, 3]]),       # 2-D, a duplicate
       np.array([10, 1, 2, 5, 1]),       # 1-D, this table has 11 rows
       np.array([[[7]]]),                # 3-D, one id
       np.zeros([0], "int64")]           # empty


def test_rows_and_gradients_equal_separate_lookups():
    fulls, tables = _tables([10, 11, 10, 10])
    outs, grads = _lookup_and_grads(tables, IDS, fused=True)
    for out, full, ids in zip(outs, fulls, IDS):
        assert out.shape == ids.shape + (4,)
        np.testing.assert_array_equal(out, full[ids])
    ref_outs, ref_grads = _lookup_and_grads(tables, IDS, fused=False)
    for a, b in zip(outs, ref_outs):
        np.testing.assert_array_equal(a, b)
    assert len(grads) == 12
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-6)
    assert np.abs(grads[0]).sum() > 0  # Not vacuous: the gradients flow.


def test_the_fused_graph_gathers_each_shard_once_per_table():
    _, tables = _tables([10, 10], num_shards=2)
    fn = tf.function(lambda a, b: lookup_tables(tables, [a, b]))
    graph = fn.get_concrete_function(tf.TensorSpec([None], tf.int64),
                                     tf.TensorSpec([None], tf.int64)).graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("ResourceGather") == 4      # 2 tables x 2 shards.
    assert ops.count("DynamicPartition") == 3    # Ids, table of each id, positions: once.
    assert ops.count("DynamicStitch") == 1


def test_plain_variables_and_a_single_table_take_the_separate_path():
    plain = [tf.Variable(np.eye(5, 3, dtype="float32")), tf.Variable(np.ones((4, 3), "float32"))]
    outs = lookup_tables(plain, [[4, 0], [[3]]])
    np.testing.assert_array_equal(outs[0].numpy(), np.eye(5, 3)[[4, 0]])
    assert outs[1].shape == (1, 1, 3)
    fulls, tables = _tables([10])
    np.testing.assert_array_equal(lookup_tables(tables, [[2]])[0].numpy(),
                                  fulls[0][[2]])


@pytest.mark.parametrize("tables,ids,needle", [
    (lambda: _tables([10, 10])[1], [[1]], "2 tables but 1 id tensors"),
    (lambda: [_tables([10], width=4)[1][0], _tables([10], width=8)[1][0]], [[1], [1]],
     "row width"),
])
def test_mismatched_arguments_name_the_fix(tables, ids, needle):
    with pytest.raises(ValueError, match=needle):
        lookup_tables(tables(), ids)
