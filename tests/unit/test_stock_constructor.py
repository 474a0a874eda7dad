"""Stock ParameterServerStrategy's constructor arguments, and the partitioner's shard counts.

A stock PSS program that only renames the class must construct the strategy;
`variable_partitioner` decides how many shards a table gets
(`placement.table_shard_count`). Nothing here needs a running cluster: the
constructor cases stop at the connection (closed ports, short timeout).
"""

import inspect

import pytest
import tensorflow as tf

import tf_psplugin
from tests.unit._stub_cluster import chief_worker_ps_resolver, free_address
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.tables import placement as placement_lib

partitioners = tf.distribute.experimental.partitioners


_resolver = chief_worker_ps_resolver


# -- the constructor -------------------------------------------------------------


def test_stock_parameters_come_first_in_the_same_order():
    """Every parameter of stock's __init__ (this TF's), by name, position and default."""
    stock = inspect.signature(tf.distribute.experimental.ParameterServerStrategy.__init__)
    ours = inspect.signature(tf_psplugin.HybridParameterServerStrategy.__init__)
    stock_params = list(stock.parameters.values())
    ours_params = list(ours.parameters.values())[:len(stock_params)]
    assert [p.name for p in ours_params] == [p.name for p in stock_params]
    for s, o in zip(stock_params[1:], ours_params[1:]):
        assert o.kind == s.kind, (s.name, o.kind, s.kind)
        if s.default is not inspect.Parameter.empty:
            assert o.default == s.default, (s.name, o.default, s.default)


def test_v1_parameters_are_accepted():
    stock = inspect.signature(tf.compat.v1.distribute.experimental.ParameterServerStrategy.__init__)
    ours = inspect.signature(tf_psplugin.HybridParameterServerStrategy.__init__)
    assert set(stock.parameters) <= set(ours.parameters)


@pytest.mark.parametrize("call", [
    lambda r, p: tf_psplugin.HybridParameterServerStrategy(
        r, variable_partitioner=p, options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5)),
    lambda r, p: tf_psplugin.HybridParameterServerStrategy(
        r, p, options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5)),
    lambda r, p: tf_psplugin.HybridParameterServerStrategy(
        cluster_resolver=r, variable_partitioner=p,
        options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5)),
])
def test_stock_call_forms_get_to_the_connection(call):
    """The arguments are accepted: the only error is that no task answers."""
    partitioner = partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    with pytest.raises(tf_psplugin.StrategyError, match="cannot reach"):
        call(_resolver(), partitioner)


@pytest.mark.parametrize("bad", [3, "min_size", [2, 1]])
def test_non_callable_partitioner_is_one_clear_error(bad):
    with pytest.raises(tf_psplugin.StrategyError,
                       match=r"variable_partitioner=.* is not a partitioner.*Fix:.*Partitioner"):
        tf_psplugin.HybridParameterServerStrategy(_resolver(), variable_partitioner=bad)


def test_config_passed_in_the_partitioner_position_says_so():
    """`config` used to be the second positional argument."""
    config = config_lib.from_tf_config({
        "cluster": {"chief": [free_address()], "worker": [free_address()], "ps": [free_address()]},
        "task": {"type": "chief", "index": 0}})
    with pytest.raises(tf_psplugin.StrategyError, match=r"pass the ClusterConfig as `config=`"):
        tf_psplugin.HybridParameterServerStrategy(None, config)


# -- how many shards a table gets ------------------------------------------------------


@pytest.mark.parametrize("num_ps,rows,expected", [(2, 100, 2), (3, 100, 3), (4, 2, 2), (1, 5, 1)])
def test_no_partitioner_one_shard_per_ps(num_ps, rows, expected):
    assert placement_lib.table_shard_count(
        tf.TensorShape([rows, 8]), tf.float32, num_ps) == expected


@pytest.mark.parametrize("partitioner", [
    partitioners.FixedShardsPartitioner(1),
    partitioners.FixedShardsPartitioner(3),
    partitioners.FixedShardsPartitioner(7),
    partitioners.MinSizePartitioner(min_shard_bytes=1 << 10, max_shards=2),
    partitioners.MinSizePartitioner(min_shard_bytes=1 << 10, max_shards=16),
    partitioners.MinSizePartitioner(),  # 256 KiB, one shard at most: a small table stays whole.
    partitioners.MaxSizePartitioner(max_shard_bytes=4 << 10),
    partitioners.MaxSizePartitioner(max_shard_bytes=4 << 10, max_shards=3),
])
@pytest.mark.parametrize("shape,dtype", [
    ([1000, 16], tf.float32), ([50, 4], tf.float32), ([5000, 8], tf.float64), ([3, 2], tf.float32),
    ([20000], tf.int64),
])
def test_shard_count_is_what_the_partitioner_says(partitioner, shape, dtype):
    shape = tf.TensorShape(shape)
    said = partitioner(shape=shape, dtype=dtype)[0]
    got = placement_lib.table_shard_count(shape, dtype, num_ps=2, partitioner=partitioner)
    # Capped at the rows, as stock caps it (no empty shard).
    assert got == min(said, shape[0])


def test_partitioner_decides_even_beyond_the_ps_count():
    got = placement_lib.table_shard_count(
        tf.TensorShape([64, 4]), tf.float32, num_ps=2,
        partitioner=partitioners.MinSizePartitioner(min_shard_bytes=64, max_shards=8))
    assert got == 8


def test_plain_callable_is_a_partitioner():
    seen = []

    def partitioner(shape, dtype):
        seen.append((shape.as_list(), dtype))
        return [5] + [1] * (shape.rank - 1)

    assert placement_lib.table_shard_count(
        tf.TensorShape([40, 3]), tf.float16, 2, partitioner, name="emb") == 5
    assert seen == [([40, 3], tf.float16)]


@pytest.mark.parametrize("answer", [[0, 1], [2, 2], [], ["two", 1], [-1, 1]])
def test_bad_partitioner_answer_names_the_table(answer):
    with pytest.raises(ValueError, match=r"table 'user_emb' of shape \[40, 3\].*first axis.*Fix:"):
        placement_lib.table_shard_count(tf.TensorShape([40, 3]), tf.float32, 2,
                                        lambda shape, dtype: answer, name="user_emb")


def test_one_shard_per_ps_scope_ignores_the_partitioner():
    fixed = partitioners.FixedShardsPartitioner(5)
    shape = tf.TensorShape([100, 4])
    with placement_lib.one_shard_per_ps():
        assert placement_lib.table_shard_count(shape, tf.float32, 3, fixed) == 3
    assert placement_lib.table_shard_count(shape, tf.float32, 3, fixed) == 5
