"""Unit tests for interleaved table sharding (single process, CPU devices).

Shards go on several logical CPU devices when this module is the first to
start the TF runtime in the process, so the multi-device save/restore path
(one tf.function over several device savers) is exercised; otherwise they all
share /cpu:0 and the tests still check every numerical property.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.framework import ops

from tf_psplugin._internal.compat import keras
from tf_psplugin.tables.sharded import (
    InterleavedShardedVariable,
    create_interleaved,
    logical_rows_of_shard,
    shard_lookup_counts,
    shard_rows,
)
from tf_psplugin.tables.sharded_slots import install_interleaved_slot_lookup


def _configure_devices(count=3):
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError:  # Runtime already initialised by another test module.
        pass
    return [d.name for d in tf.config.list_logical_devices("CPU")]


DEVICES = _configure_devices()


def _table(rows, cols, seed=0):
    return np.random.RandomState(seed).uniform(-1, 1, size=(rows, cols)).astype(np.float32)


def _interleaved(full, num_shards, name="emb"):
    shards = []
    for s in range(num_shards):
        with tf.device(DEVICES[s % len(DEVICES)]):
            shards.append(tf.Variable(full[s::num_shards], name=f"{name}/part_{s}"))
    return InterleavedShardedVariable(shards, name=name)


def _contiguous(full, num_shards, name="emb"):
    sizes = shard_rows(full.shape[0], num_shards, "contiguous")
    bounds = np.cumsum([0] + sizes)
    shards = [tf.Variable(full[bounds[s] : bounds[s + 1]]) for s in range(num_shards)]
    return sharded_variable.ShardedVariable(shards, name=name)


def _dense(grad):
    return tf.convert_to_tensor(grad).numpy()


def _logical_from_shards(per_shard, num_rows):
    """Reassembles per-shard arrays (shard s = rows s::n) into logical order."""
    n = len(per_shard)
    out = np.zeros((num_rows,) + per_shard[0].shape[1:], per_shard[0].dtype)
    for s, part in enumerate(per_shard):
        out[s::n] = part
    return out


# ---------------------------------------------------------------- layout ----


def test_shard_rows_and_logical_rows():
    assert shard_rows(10, 3, "interleaved") == [4, 3, 3]
    assert shard_rows(10, 3, "contiguous") == [4, 3, 3]
    assert shard_rows(2, 3, "interleaved") == [1, 1, 0]
    ids = np.arange(10)
    assert list(ids[logical_rows_of_shard(10, 3, 1, "interleaved")]) == [1, 4, 7]
    assert list(ids[logical_rows_of_shard(10, 3, 1, "contiguous")]) == [4, 5, 6]
    covered = np.concatenate(
        [ids[logical_rows_of_shard(10, 3, s, "interleaved")] for s in range(3)]
    )
    assert sorted(covered) == list(range(10))
    with pytest.raises(ValueError, match="scheme"):
        shard_rows(10, 3, "div")
    with pytest.raises(ValueError):
        logical_rows_of_shard(10, 3, 3, "interleaved")


def test_interleaved_balances_zipf_ids_and_contiguous_does_not():
    num_rows, num_shards = 100_000, 4
    ids = np.random.RandomState(0).zipf(1.2, size=200_000) - 1
    ids = ids[ids < num_rows]
    inter = shard_lookup_counts(ids, num_rows, num_shards, "interleaved")
    contig = shard_lookup_counts(ids, num_rows, num_shards, "contiguous")
    assert inter.sum() == contig.sum() == ids.size
    assert inter.max() / inter.mean() < 1.5  # Near even.
    assert contig[0] / contig.sum() > 0.8  # Shard 0 takes almost everything.
    with pytest.raises(ValueError, match="ids"):
        shard_lookup_counts([num_rows], num_rows, num_shards, "interleaved")


def test_rejects_shards_not_laid_out_interleaved():
    with pytest.raises(ValueError, match=r"needs \[4, 3, 3\]"):
        InterleavedShardedVariable(
            [tf.Variable(tf.zeros([3, 2])) for _ in range(2)] + [tf.Variable(tf.zeros([4, 2]))]
        )


# --------------------------------------------------------------- lookups ----


@pytest.mark.parametrize("num_rows,num_shards", [(12, 3), (11, 3), (7, 2)])
def test_lookups_match_plain_variable(num_rows, num_shards):
    full = _table(num_rows, 4)
    table = _interleaved(full, num_shards)
    plain = tf.Variable(full)
    ids = tf.constant([[num_rows - 1, 0, 3], [5, 5, 1]], tf.int64)

    np.testing.assert_array_equal(tf.nn.embedding_lookup(table, ids), full[ids.numpy()])
    for strategy in ("div", "mod"):  # v1: the table's layout wins whatever is passed.
        np.testing.assert_array_equal(
            tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy=strategy),
            full[ids.numpy()],
        )
    np.testing.assert_allclose(
        tf.nn.embedding_lookup(table, ids, max_norm=0.5),
        tf.nn.embedding_lookup(plain, ids, max_norm=0.5),
        rtol=1e-6,
    )
    ragged = tf.ragged.constant([[num_rows - 1, 2], [4]], dtype=tf.int64)
    np.testing.assert_array_equal(
        tf.nn.embedding_lookup(table, ragged).flat_values, full[[num_rows - 1, 2, 4]]
    )
    np.testing.assert_array_equal(
        tf.compat.v1.nn.embedding_lookup(table, ragged).flat_values, full[[num_rows - 1, 2, 4]]
    )

    sp_ids = tf.SparseTensor([[0, 0], [0, 1], [1, 0], [3, 0]], [num_rows - 1, 2, 0, 4], [4, 2])
    sp_ids = tf.cast(sp_ids, tf.int64)
    sp_w = tf.SparseTensor(sp_ids.indices, [2.0, 0.5, 1.0, 3.0], sp_ids.dense_shape)
    for combiner in ("sum", "mean", "sqrtn"):
        for weights in (None, sp_w):
            got = tf.nn.embedding_lookup_sparse(table, sp_ids, weights, combiner=combiner)
            want = tf.nn.embedding_lookup_sparse(plain, sp_ids, weights, combiner=combiner)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            got = tf.compat.v1.nn.embedding_lookup_sparse(
                table, sp_ids, weights, partition_strategy="div", combiner=combiner
            )
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            for default_id in (None, 1):
                want = tf.nn.safe_embedding_lookup_sparse(
                    plain, sp_ids, weights, combiner=combiner, default_id=default_id
                )
                got = tf.nn.safe_embedding_lookup_sparse(
                    table, sp_ids, weights, combiner=combiner, default_id=default_id
                )
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
                got = tf.compat.v1.nn.safe_embedding_lookup_sparse(
                    table, sp_ids, weights, combiner=combiner, default_id=default_id
                )
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_safe_lookup_with_invalid_ids_and_in_tf_function():
    full = _table(9, 3)
    table, plain = _interleaved(full, 2), tf.Variable(full)
    sp_ids = tf.SparseTensor([[0, 0], [0, 1], [2, 0]], tf.constant([-1, 8, 3], tf.int64), [3, 2])

    @tf.function
    def lookup(params):
        return (
            tf.nn.embedding_lookup(params, tf.constant([8, 0, 5])),
            tf.nn.safe_embedding_lookup_sparse(params, sp_ids, combiner="sum"),
            tf.compat.v1.nn.safe_embedding_lookup_sparse(params, sp_ids, combiner="sum"),
        )

    for got, want in zip(lookup(table), lookup(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_plain_sharded_variable_v1_safe_lookup_is_unchanged():
    """The v1 safe-lookup dispatcher we install keeps TF's behaviour for ShardedVariable."""
    full = _table(10, 3)
    _interleaved(full, 2)  # Installs the override.
    contiguous = _contiguous(full, 3)
    sp_ids = tf.SparseTensor([[0, 0], [1, 0], [1, 1]], tf.constant([9, 0, 4], tf.int64), [2, 2])
    np.testing.assert_allclose(
        tf.compat.v1.nn.safe_embedding_lookup_sparse(contiguous, sp_ids),
        tf.nn.safe_embedding_lookup_sparse(tf.Variable(full), sp_ids),
        rtol=1e-6,
    )


def test_gradients_are_indexed_slices_per_shard():
    num_rows, num_shards = 11, 3
    full = _table(num_rows, 4)
    table, plain = _interleaved(full, num_shards), tf.Variable(full)
    ids = tf.constant([10, 0, 3, 3, 7])
    sp_ids = tf.cast(tf.SparseTensor([[0, 0], [0, 1], [1, 0]], [2, 9, 4], [2, 2]), tf.int64)
    weight = tf.constant(np.arange(20, dtype=np.float32).reshape(5, 4))

    def loss(params):
        dense = tf.reduce_sum(tf.nn.embedding_lookup(params, ids) * weight)
        sparse = tf.reduce_sum(tf.nn.safe_embedding_lookup_sparse(params, sp_ids) ** 2)
        return dense + sparse

    with tf.GradientTape() as tape:
        value = loss(table)
    grads = tape.gradient(value, table.variables)
    with tf.GradientTape() as tape:
        want_value = loss(plain)
    want = _dense(tape.gradient(want_value, plain))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)
    got = _logical_from_shards([_dense(g) for g in grads], num_rows)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ------------------------------------------------ conversion, reads, writes ----


def test_conversion_and_reads_are_in_logical_order():
    full = _table(11, 3)
    table = _interleaved(full, 3)
    np.testing.assert_array_equal(tf.convert_to_tensor(table), full)
    np.testing.assert_array_equal(table.numpy(), full)
    np.testing.assert_array_equal(table.read_value(), full)
    np.testing.assert_array_equal(table.value(), full)
    np.testing.assert_allclose(table * 2.0 + 1.0, full * 2 + 1)
    np.testing.assert_allclose(tf.matmul(table, tf.ones([3, 1])), full @ np.ones([3, 1]), rtol=1e-6)
    np.testing.assert_array_equal(tf.function(lambda: tf.identity(table))(), full)
    np.testing.assert_array_equal(table[4], full[4])
    np.testing.assert_array_equal(table[-1], full[-1])
    np.testing.assert_array_equal(table[tf.constant(7)], full[7])
    np.testing.assert_array_equal(table[2:9], full[2:9])
    np.testing.assert_array_equal(table[::-2, 1:], full[::-2, 1:])
    np.testing.assert_array_equal(table[5, 2], full[5, 2])
    np.testing.assert_array_equal(table[20:], full[20:])
    np.testing.assert_array_equal(table[..., 0], full[..., 0])
    np.testing.assert_array_equal(table[full[:, 0] > 0], full[full[:, 0] > 0])
    np.testing.assert_array_equal(table.sparse_read([[10, 1], [0, 0]]), full[[[10, 1], [0, 0]]])
    with pytest.raises(IndexError):
        table[11]


def test_assign_and_scatter_in_logical_order():
    full = _table(11, 3)
    table = _interleaved(np.zeros_like(full), 3)
    table.assign(full)
    np.testing.assert_array_equal(table.numpy(), full)
    table.assign_add(full)
    np.testing.assert_allclose(table.numpy(), 2 * full)
    table.assign_sub(full)
    np.testing.assert_allclose(table.numpy(), full)
    rows = np.ones([2, 3], np.float32)
    table.scatter_update(tf.IndexedSlices(rows, tf.constant([10, 1])))
    expected = full.copy()
    expected[[10, 1]] = 1.0
    np.testing.assert_array_equal(table.numpy(), expected)
    table.scatter_add(tf.IndexedSlices(rows, tf.constant([2, 2])))
    expected[2] += 2.0
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="logical shape"):
        table.assign(np.zeros([10, 3], np.float32))
    with pytest.raises(NotImplementedError, match="reference"):
        ops.convert_to_tensor(table, as_ref=True)


# ----------------------------------------------------------- checkpoints ----


@pytest.mark.parametrize("restore_shards", [1, 2, 3])
def test_checkpoint_n_to_m_shards(tmp_path, restore_shards):
    full = _table(11, 4)
    path = tf.train.Checkpoint(emb=_interleaved(full, 2)).write(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["emb/.ATTRIBUTES/VARIABLE_VALUE"] == [11, 4]
    saved = tf.train.load_variable(path, "emb/.ATTRIBUTES/VARIABLE_VALUE")
    np.testing.assert_array_equal(saved, full)
    restored = _interleaved(np.zeros_like(full), restore_shards)
    tf.train.Checkpoint(emb=restored).read(path).assert_consumed()
    np.testing.assert_array_equal(restored.numpy(), full)


def test_checkpoint_interleaved_to_contiguous_and_plain_and_back(tmp_path):
    full = _table(10, 3)
    path = tf.train.Checkpoint(emb=_interleaved(full, 3)).write(str(tmp_path / "inter"))

    contiguous = _contiguous(np.zeros_like(full), 2)
    tf.train.Checkpoint(emb=contiguous).read(path).assert_consumed()
    np.testing.assert_array_equal(tf.concat(contiguous.variables, 0), full)

    plain = tf.Variable(tf.zeros_like(full))
    tf.train.Checkpoint(emb=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), full)

    other = _table(10, 3, seed=1)
    plain_path = tf.train.Checkpoint(emb=tf.Variable(other)).write(str(tmp_path / "plain"))
    table = _interleaved(np.zeros_like(full), 3)
    tf.train.Checkpoint(emb=table).read(plain_path).assert_consumed()
    np.testing.assert_array_equal(table.numpy(), other)

    contiguous_path = tf.train.Checkpoint(emb=_contiguous(full, 3)).write(str(tmp_path / "cont"))
    table = _interleaved(np.zeros_like(full), 2)
    tf.train.Checkpoint(emb=table).read(contiguous_path).assert_consumed()
    np.testing.assert_array_equal(table.numpy(), full)


def test_async_checkpoint_keeps_logical_order(tmp_path):
    full = _table(11, 2)
    table = _interleaved(full, 3)
    ckpt = tf.train.Checkpoint(emb=table)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    path = ckpt.write(str(tmp_path / "async"), options=options)
    ckpt.sync()
    np.testing.assert_array_equal(
        tf.train.load_variable(path, "emb/.ATTRIBUTES/VARIABLE_VALUE"), full
    )
    restored = _interleaved(np.zeros_like(full), 2)
    # An async write also records save_counter, which this Checkpoint lacks.
    tf.train.Checkpoint(emb=restored).read(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(restored.numpy(), full)


def test_checkpoint_slices_are_built_on_their_shard_device():
    table = _interleaved(_table(10, 2), 3)
    factory = table._gather_saveables_for_checkpoint()["VARIABLE_VALUE"]
    specs = factory(name="emb/.ATTRIBUTES/VARIABLE_VALUE").specs
    assert [spec.device for spec in specs] == [v.device for v in table.variables]
    assert [spec.slice_spec for spec in specs] == ["10 2 0,4:0,2", "10 2 4,3:0,2", "10 2 7,3:0,2"]


def test_graph_mode_checkpoint_and_tf1_saver(tmp_path):
    """TF1 sessions: tf.train.Checkpoint restores every slice; v1 Saver works."""
    full = _table(11, 2)
    for save_with_saver in (False, True):
        prefix = str(tmp_path / f"graph{int(save_with_saver)}")
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            table = _interleaved(full, 3)
            sess.run([v.initializer for v in table.variables])
            if save_with_saver:
                path = tf.compat.v1.train.Saver({"emb": table}).save(sess, prefix)
            else:
                path = tf.train.Checkpoint(emb=table).write(prefix)
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            table = _interleaved(np.zeros_like(full), 2)
            sess.run([v.initializer for v in table.variables])
            if save_with_saver:
                tf.compat.v1.train.Saver({"emb": table}).restore(sess, path)
            else:
                tf.train.Checkpoint(emb=table).restore(path).run_restore_ops(sess)
            np.testing.assert_array_equal(sess.run(tf.convert_to_tensor(table)), full)


def test_saved_model_export_holds_full_logical_table(tmp_path):
    full = _table(11, 3)
    module = tf.Module()
    module.table = _interleaved(full, 3)
    module.lookup = tf.function(
        lambda ids: tf.nn.embedding_lookup(module.table, ids),
        input_signature=[tf.TensorSpec([None], tf.int32)],
    )
    tf.saved_model.save(module, str(tmp_path / "sm"))
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    np.testing.assert_array_equal(loaded.table.numpy(), full)
    np.testing.assert_array_equal(loaded.lookup(tf.constant([10, 0, 4])), full[[10, 0, 4]])


def test_tf_function_argument_keeps_interleaved_layout():
    full = _table(7, 2)
    table = _interleaved(full, 2)
    lookup = tf.function(lambda params, ids: tf.nn.embedding_lookup(params, ids))
    np.testing.assert_array_equal(lookup(table, tf.constant([6, 1])), full[[6, 1]])
    flat = tf.nest.flatten(table, expand_composites=True)
    rebuilt = tf.nest.pack_sequence_as(table, flat, expand_composites=True)
    assert isinstance(rebuilt, InterleavedShardedVariable)
    np.testing.assert_array_equal(rebuilt.numpy(), full)


# ---------------------------------------------------------------- Keras ----


def test_legacy_adagrad_on_shards_matches_plain_variable():
    num_rows, num_shards = 13, 3
    full = _table(num_rows, 4)
    table, plain = _interleaved(full, num_shards), tf.Variable(full)
    opt_table = keras.optimizers.legacy.Adagrad(learning_rate=0.3)
    opt_plain = keras.optimizers.legacy.Adagrad(learning_rate=0.3)
    rng = np.random.RandomState(3)
    for _ in range(4):
        ids = tf.constant(rng.randint(0, num_rows, size=8))
        target = tf.constant(rng.randn(8, 4).astype(np.float32))
        for params, opt, var_list in (
            (table, opt_table, table.variables),
            (plain, opt_plain, [plain]),
        ):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((tf.nn.embedding_lookup(params, ids) - target) ** 2)
            grads = tape.gradient(loss, var_list)
            assert all(isinstance(g, tf.IndexedSlices) for g in grads)
            opt.apply_gradients(zip(grads, var_list))
    np.testing.assert_allclose(table.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)
    accumulators = [opt_table.get_slot(v, "accumulator").numpy() for v in table.variables]
    np.testing.assert_allclose(
        _logical_from_shards(accumulators, num_rows),
        opt_plain.get_slot(plain, "accumulator").numpy(),
        rtol=1e-6,
    )


def _train_adagrad(params, optimizer, var_list, steps, seed=3):
    rng = np.random.RandomState(seed)
    num_rows = int(params.shape[0])
    for _ in range(steps):
        ids = tf.constant(rng.randint(0, num_rows, size=8))
        target = tf.constant(rng.randn(8, 4).astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((tf.nn.embedding_lookup(params, ids) - target) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, var_list), var_list))


def _create_slots(optimizer, var_list):
    """Creates slots with an empty sparse update (slots must exist before a restore)."""
    empty = [tf.IndexedSlices(tf.zeros([0, 4]), tf.zeros([0], tf.int64)) for _ in var_list]
    optimizer.apply_gradients(zip(empty, var_list))


def test_optimizer_slots_checkpoint_in_logical_order_and_reshard(tmp_path):
    def Adagrad(learning_rate):  # noqa: N802 - reads like the class it builds.
        return install_interleaved_slot_lookup(keras.optimizers.legacy.Adagrad(learning_rate))

    full = _table(13, 4)
    table, plain = _interleaved(full, 2), tf.Variable(full)
    opt, opt_plain = Adagrad(0.3), keras.optimizers.legacy.Adagrad(0.3)
    _train_adagrad(table, opt, table.variables, steps=3)
    _train_adagrad(plain, opt_plain, [plain], steps=3)
    want = opt_plain.get_slot(plain, "accumulator").numpy()
    assert isinstance(opt.get_slot(table, "accumulator"), InterleavedShardedVariable)
    assert opt.get_slot(table, "accumulator") is opt.get_slot(table, "accumulator")
    assert install_interleaved_slot_lookup(opt) is opt  # Idempotent.
    path = tf.train.Checkpoint(emb=table, opt=opt).write(str(tmp_path / "ckpt"))
    key = "emb/.OPTIMIZER_SLOT/opt/accumulator/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_allclose(tf.train.load_variable(path, key), want, rtol=1e-6)

    table3, opt3 = _interleaved(np.zeros_like(full), 3), Adagrad(0.3)
    _create_slots(opt3, table3.variables)
    tf.train.Checkpoint(emb=table3, opt=opt3).read(path).assert_consumed()
    np.testing.assert_allclose(opt3.get_slot(table3, "accumulator").numpy(), want, rtol=1e-6)

    plain2, opt_plain2 = tf.Variable(tf.zeros_like(full)), keras.optimizers.legacy.Adagrad(0.3)
    _create_slots(opt_plain2, [plain2])
    tf.train.Checkpoint(emb=plain2, opt=opt_plain2).read(path).assert_consumed()
    np.testing.assert_allclose(opt_plain2.get_slot(plain2, "accumulator").numpy(), want, rtol=1e-6)

    # Training continues identically after resharding 2 -> 3.
    _train_adagrad(table3, opt3, table3.variables, steps=2, seed=4)
    _train_adagrad(plain, opt_plain, [plain], steps=2, seed=4)
    np.testing.assert_allclose(table3.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)


def test_keras_embedding_layer_with_interleaved_weight():
    full = _table(11, 4)
    layer = keras.layers.Embedding(11, 4)
    layer.build((None, 2))
    layer.embeddings = _interleaved(full, 3)
    ids = np.array([[10, 0], [3, 7]])
    np.testing.assert_array_equal(layer(ids), full[ids])
    np.testing.assert_array_equal(layer(tf.constant(ids, tf.float32)), full[ids])


# --------------------------------------------------------------- creation ----


def _plain_creator(**kwargs):
    return tf.Variable(**kwargs)


def test_create_interleaved_from_full_value_and_tensor():
    full = _table(11, 3)
    devices = [DEVICES[s % len(DEVICES)] for s in range(3)]
    for value in (full, tf.constant(full)):
        table = create_interleaved(
            "emb", [11, 3], tf.float32, value, 3, devices.__getitem__, _plain_creator
        )
        np.testing.assert_array_equal(table.numpy(), full)
        assert [v.name for v in table.variables] == [f"emb/part_{s}:0" for s in range(3)]
        if len(DEVICES) > 1:
            for v, device in zip(table.variables, devices):
                assert v.device.endswith(device.lstrip("/")), (v.device, device)
    with pytest.raises(ValueError, match="does not match"):
        create_interleaved("emb", [10, 3], tf.float32, full, 3, lambda s: None, _plain_creator)


def test_create_interleaved_partitions_random_initializer():
    calls = []

    class Recording(keras.initializers.RandomUniform):
        def __call__(self, shape, dtype=None, **kwargs):
            calls.append(kwargs.get("partition_shape"))
            return super().__call__(shape, dtype=dtype, **kwargs)

    table = create_interleaved(
        "emb", [10, 4], tf.float32, Recording(seed=1), 3, lambda s: None, _plain_creator
    )
    assert [v.shape.as_list() for v in table.variables] == [[4, 4], [3, 4], [3, 4]]
    assert calls == [(4, 4), (3, 4), (3, 4)]  # Never the full table.
    values = table.numpy()
    assert np.all(np.abs(values) <= 0.05) and len(np.unique(values)) == values.size

    # An initializer without partition support still works (full value, sliced).
    table = create_interleaved(
        "eye", [6, 6], tf.float32, keras.initializers.Identity(), 4, lambda s: None, _plain_creator
    )
    np.testing.assert_array_equal(table.numpy(), np.eye(6))
    table = create_interleaved(
        "z", [5, 2], tf.float32, lambda: tf.ones([5, 2]), 2, lambda s: None, _plain_creator
    )
    np.testing.assert_array_equal(table.numpy(), np.ones([5, 2]))


def test_create_interleaved_restore_on_create_through_keras(tmp_path):
    """Keras add_weight after checkpoint.read passes a CheckpointInitialValueCallable."""
    full = _table(11, 4)
    source = keras.layers.Embedding(11, 4)
    source.build((None,))
    source.embeddings.assign(full)
    path = tf.train.Checkpoint(layer=source).write(str(tmp_path / "ckpt"))

    def creator(next_creator, **kwargs):
        if kwargs.get("name") != "embeddings":
            return next_creator(**kwargs)
        initial = kwargs["initial_value"]
        while isinstance(initial, functools.partial):
            initial = initial.func
        assert isinstance(initial, tf.__internal__.tracking.CheckpointInitialValueCallable)
        shard_creator = functools.partial(
            next_creator, dtype=kwargs["dtype"], trainable=kwargs.get("trainable")
        )
        return create_interleaved(
            kwargs["name"],
            kwargs["shape"],
            kwargs["dtype"],
            kwargs["initial_value"],
            3,
            lambda s: DEVICES[s % len(DEVICES)],
            shard_creator,
        )

    layer = keras.layers.Embedding(11, 4)
    status = tf.train.Checkpoint(layer=layer).read(path)
    with tf.variable_creator_scope(creator):
        layer.build((None,))
    status.assert_consumed()
    assert isinstance(layer.embeddings, InterleavedShardedVariable)
    np.testing.assert_array_equal(layer.embeddings.numpy(), full)
    np.testing.assert_array_equal(layer(np.array([10, 2])), full[[10, 2]])
