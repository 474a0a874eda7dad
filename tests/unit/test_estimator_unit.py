"""Single-process tests of the Estimator front-end (no servers started).

Covers the version gate (simulated on TF 2.15, real on newer TF), the
RunConfig's cluster handling and argument checks, and the table sharding the
strategy relies on: shard layout, lookups and -- the property the evaluator
and restarts depend on -- checkpoints that restore into an unsharded variable
or a different number of shards.
"""

import copy
import functools
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from tf_psplugin._internal import compat as _compat

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_estimator = pytest.mark.skipif(
    not _compat.HAS_ESTIMATOR, reason="tf.estimator was removed in TensorFlow 2.16"
)


# ---- version gate ------------------------------------------------------------


def test_import_raises_clear_error_on_simulated_tf_216(monkeypatch):
    monkeypatch.setattr(_compat, "HAS_ESTIMATOR", False)
    monkeypatch.setattr(_compat, "TF_VERSION", (2, 16))
    for name in [m for m in sys.modules if m.startswith("tf_psplugin.estimator")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError) as info:
        importlib.import_module("tf_psplugin.estimator")
    message = str(info.value)
    assert "TensorFlow 2.15" in message and "removed in TensorFlow 2.16" in message
    assert "this is TensorFlow 2.16" in message
    assert "tf.estimator" in message


@pytest.mark.skipif(_compat.HAS_ESTIMATOR, reason="real check needs TensorFlow >= 2.16")
def test_import_raises_clear_error_on_real_newer_tf():
    result = subprocess.run(
        [sys.executable, "-c", "import tf_psplugin.estimator"], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "ImportError: tf_psplugin.estimator needs TensorFlow 2.15.x" in result.stderr


def test_package_import_does_not_import_estimator():
    code = "import sys, tf_psplugin; print('tf_psplugin.estimator' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


# ---- RunConfig ---------------------------------------------------------------


def _flag_values(*argv):
    from tf_psplugin.cluster import flags as cluster_flags

    fv = flags.FlagValues()
    cluster_flags.define_flags(fv)
    fv(["prog", *argv])
    return fv


@needs_estimator
def test_run_config_without_cluster_is_stock(monkeypatch):
    import tf_psplugin.estimator as est

    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = est.RunConfig(model_dir="/tmp/x", flag_values=_flag_values())
    assert config.cluster is None
    assert config.train_distribute is None
    assert config.is_chief and config.num_ps_replicas == 0
    assert "TF_CONFIG" not in os.environ


@needs_estimator
def test_run_config_from_flags_promotes_first_worker_and_exports_tf_config(monkeypatch):
    import tf_psplugin.estimator as est

    monkeypatch.delenv("TF_CONFIG", raising=False)
    fv = _flag_values("--job_name=worker", "--task_index=0",
                      "--worker_hosts=localhost:1001,localhost:1002", "--ps_hosts=localhost:1003")
    config = est.RunConfig(model_dir="/tmp/x", flag_values=fv, save_checkpoints_steps=10)
    assert config.cluster.task_type == "chief" and config.cluster.chief_promoted_from_worker
    exported = json.loads(os.environ["TF_CONFIG"])
    assert exported["cluster"] == {"chief": ["localhost:1001"], "worker": ["localhost:1002"],
                                   "ps": ["localhost:1003"]}
    assert exported["task"] == {"type": "chief", "index": 0}
    # Estimator 2.15 selects its multi-worker path by this class name.
    assert type(config.train_distribute).__name__ == "CollectiveAllReduceStrategyV1"
    assert config.placement_mode == est.MODE_HYBRID
    assert config.table_update == est.TABLE_UPDATE_SYNC
    # Estimator deep-copies its config (config property, replace, coordinator).
    copied = copy.deepcopy(config)
    assert copied.placement_mode == est.MODE_HYBRID and copied.cluster == config.cluster
    replaced = config.replace(model_dir="/tmp/y")
    assert replaced.model_dir == "/tmp/y" and replaced.cluster == config.cluster


@needs_estimator
def test_run_config_ps_async_fallback_from_tf_config(monkeypatch):
    import tf_psplugin.estimator as est

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"],
                    "ps": ["localhost:3", "localhost:4"]},
        "task": {"type": "worker", "index": 0}}))
    config = est.RunConfig(dense_placement="ps", flag_values=_flag_values())
    assert config.placement_mode == "ps_async"
    assert isinstance(config.train_distribute,
                      tf.compat.v1.distribute.experimental.ParameterServerStrategy)


@needs_estimator
@pytest.mark.parametrize("new, old, properties", [
    ({"dense_placement": "ps"}, {"mode": "ps_async"},
     {"dense_placement": "ps", "placement_mode": "ps_async"}),
    ({"dense_placement": "allreduce", "embedding_updates": "async"},
     {"mode": "hybrid", "table_update": "local"},
     {"dense_placement": "allreduce", "embedding_updates": "async", "table_update": "local"}),
])
def test_run_config_takes_the_strategys_names_and_the_old_ones_with_a_warning(
        monkeypatch, new, old, properties):
    import warnings

    import tf_psplugin.estimator as est
    from tf_psplugin import PlacementPolicy

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"],
                    "ps": ["localhost:3", "localhost:4"]},
        "task": {"type": "worker", "index": 0}}))
    policy = PlacementPolicy(min_table_bytes=1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # The new names warn about nothing.
        config = est.RunConfig(flag_values=_flag_values(), placement=policy, **new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_config = est.RunConfig(flag_values=_flag_values(), placement_policy=policy, **old)
    messages = {str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)}
    renames = {"mode": "dense_placement", "table_update": "embedding_updates",
               "placement_policy": "placement"}
    assert messages == {f"tf_psplugin.estimator.RunConfig({name}=...) is deprecated: use "
                        f"{renames[name]}=..." for name in [*old, "placement_policy"]}
    for c in (config, old_config):
        assert {name: getattr(c, name) for name in properties} == properties
        assert c.placement is policy and c.placement_policy is policy
        assert type(c.train_distribute) is type(config.train_distribute)


@needs_estimator
@pytest.mark.parametrize("kwargs, match", [
    ({"dense_placement": "allreduce", "mode": "ps_async"},
     "RunConfig: mode='ps_async' and dense_placement='hybrid' are the same option"),
    ({"embedding_updates": "local"}, "RunConfig.embedding_updates: unknown value 'local'"),
    ({"dense_placement": "hybrid"}, "RunConfig.dense_placement: unknown value 'hybrid'"),
])
def test_run_config_names_the_keyword_in_errors(monkeypatch, kwargs, match):
    import tf_psplugin.estimator as est

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=match):
        est.RunConfig(flag_values=_flag_values(), **kwargs)


@needs_estimator
@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "everything_on_gpu"}, "unknown mode"),
    ({"table_update": "eventually"}, "unknown value"),
    ({"device_fn": lambda op: ""}, "device_fn"),
    ({"train_distribute": "anything"}, "train_distribute"),
])
def test_run_config_rejects_conflicting_arguments(monkeypatch, kwargs, match):
    import contextlib

    import tf_psplugin.estimator as est

    monkeypatch.delenv("TF_CONFIG", raising=False)
    former = {"mode", "table_update"} & set(kwargs)  # Former names: they warn, then refuse.
    with pytest.raises(ValueError, match=match), (
            pytest.warns(DeprecationWarning, match="is deprecated") if former
            else contextlib.nullcontext()):
        est.RunConfig(flag_values=_flag_values(), **kwargs)


@needs_estimator
def test_run_config_cluster_without_ps_is_rejected(monkeypatch):
    import tf_psplugin.estimator as est
    from tf_psplugin.cluster import config

    monkeypatch.delenv("TF_CONFIG", raising=False)
    fv = _flag_values("--job_name=worker", "--worker_hosts=localhost:1001")
    with pytest.raises(config.ConfigError, match="ps_hosts"):
        est.RunConfig(flag_values=fv)


@needs_estimator
def test_run_config_invalid_cluster_is_an_error_not_local(monkeypatch):
    import tf_psplugin.estimator as est
    from tf_psplugin.cluster import config

    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(config.ConfigError):
        est.RunConfig(flag_values=_flag_values())


# ---- table sharding ----------------------------------------------------------


@pytest.fixture
def tables(monkeypatch):
    """The sharding module with every "PS task" mapped to the local CPU."""
    if not _compat.HAS_ESTIMATOR:
        pytest.skip("tf.estimator was removed in TensorFlow 2.16")
    from tf_psplugin.estimator import _tables

    monkeypatch.setattr(_tables, "ps_device", lambda task: "/cpu:0")
    return _tables


def _creator(**kwargs):
    return tf.compat.v1.Variable(**kwargs)


def _table_kwargs(name, rows, dim, seed=3):
    init = tf.keras.initializers.RandomUniform(-1.0, 1.0, seed=seed)
    return {"name": name, "shape": [rows, dim], "dtype": tf.float32, "trainable": True,
            "use_resource": True,
            "initial_value": functools.partial(init, [rows, dim], dtype=tf.float32)}


def test_row_offsets_match_tf_div_layout(tables):
    assert tables.row_offsets(10, 3) == [0, 4, 7, 10]
    assert tables.row_offsets(4, 4) == [0, 1, 2, 3, 4]


def test_already_partitioned_names(tables):
    assert tables.already_partitioned("a/embedding_weights/part_3")
    assert tables.already_partitioned("a/embedding_weights/part_0:0")
    assert not tables.already_partitioned("a/embedding_weights")


def test_is_table_request_uses_the_shared_policy(tables):
    from tf_psplugin.tables import placement

    policy = placement.PlacementPolicy()
    assert tables.is_table_request(policy, _table_kwargs("embedding_weights", 10, 4))
    assert tables.is_table_request(policy, _table_kwargs("x/embeddings", 10, 4))
    assert not tables.is_table_request(policy, _table_kwargs("kernel", 10, 4))
    with placement.embedding_table_scope():
        assert tables.is_table_request(policy, _table_kwargs("kernel", 10, 4))


def test_sharded_table_lookups_and_checkpoint_restore_unsharded(tables, tmp_path):
    ids = np.array([0, 3, 4, 9, 6, 3])
    prefix = str(tmp_path / "ckpt")
    with tf.Graph().as_default():
        table = tables.create_sharded_table(_creator, _table_kwargs("emb/embedding_weights", 10, 3),
                                            num_ps=3)
        assert isinstance(table, tables.tf_variables.PartitionedVariable)
        shards = list(table)
        assert [s.shape.as_list() for s in shards] == [[4, 3], [3, 3], [3, 3]]
        assert [s.op.name for s in shards] == [f"emb/embedding_weights/part_{i}" for i in range(3)]
        lookup = tf.nn.embedding_lookup(table, ids)  # partition_strategy "div"
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            full, got = sess.run([tf.concat(shards, 0), lookup])
            tf.compat.v1.train.Saver().save(sess, prefix)
    np.testing.assert_array_equal(got, full[ids])
    assert dict(tf.train.list_variables(prefix)) == {"emb/embedding_weights": [10, 3]}
    # The evaluator's plain variable, and a job with 2 PS tasks, restore it.
    with tf.Graph().as_default():
        plain = tf.compat.v1.get_variable("emb/embedding_weights", [10, 3])
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(plain), full)
    with tf.Graph().as_default():
        two = tables.create_sharded_table(_creator, _table_kwargs("emb/embedding_weights", 10, 3),
                                          num_ps=2)
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, prefix)
            np.testing.assert_array_equal(sess.run(tf.concat(list(two), 0)), full)


def test_sharded_table_initializer_generates_shards_only(tables):
    with tf.Graph().as_default():
        table = tables.create_sharded_table(_creator, _table_kwargs("t/embeddings", 1000, 8),
                                            num_ps=2)
        for shard in table:
            init_value = shard.initial_value
            assert init_value.shape.as_list() == shard.shape.as_list()


def test_small_table_and_unknown_shape_stay_whole(tables):
    with tf.Graph().as_default():
        one_row = tables.create_sharded_table(_creator, _table_kwargs("a/embeddings", 1, 4),
                                              num_ps=2)
        assert not isinstance(one_row, tables.tf_variables.PartitionedVariable)


def test_placement_records_label_tables_slots_and_dense(tables):
    from tf_psplugin.estimator import _report

    with tf.Graph().as_default():
        table = tables.create_sharded_table(_creator, _table_kwargs("e/embedding_weights", 6, 2),
                                            num_ps=2)
        slot_name = list(table)[0].op.name + "/Adagrad"
        tf.compat.v1.Variable(tf.zeros([3, 2]), name=slot_name, use_resource=True)
        tf.compat.v1.Variable(tf.zeros([2, 1]), name="dense/kernel", use_resource=True)
        kinds = {r.name: r.kind for r in _report.placement_records()}
    assert kinds == {
        "e/embedding_weights/part_0": "table",
        "e/embedding_weights/part_1": "table",
        "e/embedding_weights/part_0/Adagrad": "table_slot",
        "dense/kernel": "dense",
    }


@needs_estimator
def test_strategy_copies_start_with_no_tables():
    from tf_psplugin.tables import placement
    from tf_psplugin.estimator import _strategy

    strategy = _strategy.make_strategy("hybrid", placement.PlacementPolicy(), "sync")
    copied = copy.deepcopy(strategy)
    assert type(copied).__name__ == "CollectiveAllReduceStrategyV1"
    with pytest.raises(ValueError, match="table_update"):
        _strategy.CollectiveAllReduceStrategyV1(placement.PlacementPolicy(), "eventually")
