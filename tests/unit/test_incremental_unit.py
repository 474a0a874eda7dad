"""Single-process tests of incremental checkpoints: naming, markers, chains, torn deltas, retention.

The writing side (row stamps on the PS, deltas written by each PS) needs a
cluster: tests/cluster/test_incremental_checkpoint.py. Here deltas are
written by hand in the documented format (`tf_psplugin.state.incremental`), which
is also what a serving-side loader would read.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import incremental
from tf_psplugin.state import model_dir as md

VOCAB, DIM = 20, 3
TABLE_KEY = "model/layer_with_weights-0/embeddings/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def tiny_model(optimizer=None):
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    x = tf.keras.layers.Embedding(VOCAB, DIM, name="table", embeddings_initializer=(
        tf.keras.initializers.RandomUniform(seed=1)))(ids)
    x = tf.keras.layers.Flatten()(x)
    out = tf.keras.layers.Dense(1, name="out", kernel_initializer=(
        tf.keras.initializers.GlorotUniform(seed=2)))(x)
    model = tf.keras.Model(ids, out)
    model.compile(optimizer or tf.keras.optimizers.legacy.Adagrad(0.5), "mse")
    return model


def write_full(model_dir, step, model=None):
    model = model or tiny_model()
    prefix = os.path.join(model_dir, f"ckpt-{step}")
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(prefix)
    return md.commit_checkpoint(prefix, step, None)


def write_delta(model_dir, step, base, parent, model=None, ids=(), rows=None):
    """A delta in the documented format: row bundle(s), dense bundle, marker."""
    prefix = os.path.join(model_dir, f"delta-{step}")
    tf.io.gfile.makedirs(prefix)
    ids = np.asarray(ids, np.int64)
    rows = np.zeros([len(ids), DIM], np.float32) if rows is None else rows
    tf.raw_ops.SaveV2(prefix=os.path.join(prefix, "ps-0"),
                      tensor_names=[TABLE_KEY + "/.DELTA/ids", TABLE_KEY + "/.DELTA/rows"],
                      shape_and_slices=["", ""], tensors=[ids, rows])
    dense = {}
    if model is not None:
        variables, _, _ = incremental.object_keys(
            tf.train.Checkpoint(model=model, optimizer=model.optimizer))
        dense = {k: v.numpy() for k, v in variables.items() if k != TABLE_KEY}
    if not dense:
        dense = {"unused": np.zeros([1], np.float32)}
    tf.raw_ops.SaveV2(prefix=os.path.join(prefix, "dense"), tensor_names=list(dense),
                      shape_and_slices=[""] * len(dense), tensors=list(dense.values()))
    manifest = {"tables": {TABLE_KEY: {"shape": [VOCAB, DIM], "dtype": "float32", "slots": []}},
                "row_files": [f"delta-{step}/ps-0"], "dense": f"delta-{step}/dense"}
    return md.commit_delta(prefix, step, None, base=base, parent=parent, manifest=manifest)


def test_deltas_have_their_own_names_and_markers(tmp_path):
    full = write_full(str(tmp_path), 2)
    delta = write_delta(str(tmp_path), 4, "ckpt-2", "ckpt-2")
    assert full.kind == "full" and full.name == "ckpt-2"
    assert (delta.kind, delta.name, delta.base, delta.parent) == ("delta", "delta-4", "ckpt-2",
                                                                  "ckpt-2")
    assert sorted(delta.files) == ["delta-4/dense.data-00000-of-00001", "delta-4/dense.index",
                                   "delta-4/ps-0.data-00000-of-00001", "delta-4/ps-0.index"]
    assert md.verify_checkpoint(delta) is None
    # Tools that read full checkpoints never see a delta.
    assert [i.name for i in md.list_checkpoints(str(tmp_path))] == ["ckpt-2"]
    assert md.latest_checkpoint_info(str(tmp_path)).name == "ckpt-2"
    assert [i.name for i in md.list_deltas(str(tmp_path))] == ["delta-4"]
    data = md.read_json(os.path.join(str(tmp_path), "delta-4.commit"))
    assert data["kind"] == "delta" and data["manifest"]["row_files"] == ["delta-4/ps-0"]
    assert md.read_json(os.path.join(str(tmp_path), "ckpt-2.commit"))["kind"] == "full"


def test_chain_is_the_latest_full_and_its_unbroken_deltas(tmp_path):
    d = str(tmp_path)
    write_full(d, 2)
    write_delta(d, 4, "ckpt-2", "ckpt-2")
    write_delta(d, 6, "ckpt-2", "delta-4")
    full, deltas = md.checkpoint_chain(d)
    assert full.name == "ckpt-2" and [x.name for x in deltas] == ["delta-4", "delta-6"]
    # A newer full checkpoint starts a new chain; the old deltas are not on it.
    write_full(d, 8)
    write_delta(d, 10, "ckpt-8", "ckpt-8")
    full, deltas = md.checkpoint_chain(d)
    assert full.name == "ckpt-8" and [x.name for x in deltas] == ["delta-10"]


def test_torn_delta_ends_the_chain_before_it(tmp_path):
    d = str(tmp_path)
    write_full(d, 2)
    write_delta(d, 4, "ckpt-2", "ckpt-2")
    torn = write_delta(d, 6, "ckpt-2", "delta-4")
    write_delta(d, 8, "ckpt-2", "delta-6")
    with open(os.path.join(d, "delta-6", "ps-0.data-00000-of-00001"), "r+b") as f:
        f.truncate(3)
    assert "has 3 bytes" in md.verify_checkpoint(torn)
    full, deltas = md.checkpoint_chain(d)
    assert full.name == "ckpt-2" and [x.name for x in deltas] == ["delta-4"]
    # A missing file too; and a torn full checkpoint is skipped with its deltas.
    os.remove(os.path.join(d, "delta-4", "dense.index"))
    assert md.checkpoint_chain(d)[1] == []


def test_a_delta_whose_parent_never_committed_ends_the_chain(tmp_path):
    d = str(tmp_path)
    write_full(d, 2)
    write_delta(d, 4, "ckpt-2", "ckpt-2")
    write_delta(d, 8, "ckpt-2", "delta-6")  # delta-6 crashed before its marker.
    assert [x.name for x in md.checkpoint_chain(d)[1]] == ["delta-4"]


def test_retention_deletes_deltas_only_with_their_base(tmp_path):
    d = str(tmp_path)
    write_full(d, 2)
    write_delta(d, 4, "ckpt-2", "ckpt-2")
    write_full(d, 6)
    write_delta(d, 8, "ckpt-6", "ckpt-6")
    assert md.drop_orphan_deltas(d, {"ckpt-2", "ckpt-6"}) == []
    dropped = md.drop_orphan_deltas(d, {"ckpt-6"})
    assert dropped == [os.path.join(d, "delta-4")]
    assert not os.path.exists(os.path.join(d, "delta-4"))
    assert not os.path.exists(os.path.join(d, "delta-4.commit"))
    assert [x.name for x in md.list_deltas(d)] == ["delta-8"]
    assert [x.name for x in md.checkpoint_chain(d)[1]] == ["delta-8"]


def test_load_into_applies_the_chain_by_logical_row_id(tmp_path):
    d = str(tmp_path)
    writer = tiny_model()
    write_full(d, 2, writer)
    base_table = writer.layers[1].embeddings.numpy()
    rows = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM) + 100.0
    writer.layers[-1].kernel.assign(writer.layers[-1].kernel + 1.0)  # Dense state moves on.
    write_delta(d, 4, "ckpt-2", "ckpt-2", model=writer, ids=[3, 17], rows=rows)
    write_delta(d, 6, "ckpt-2", "delta-4", model=writer, ids=[17], rows=rows[:1] * 2)
    reader = tiny_model()
    info = ckpt_lib.load_into(reader, d)
    assert (info.name, info.step) == ("delta-6", 6)
    expected = base_table.copy()
    expected[3], expected[17] = rows[0], rows[0] * 2
    np.testing.assert_array_equal(reader.layers[1].embeddings.numpy(), expected)
    np.testing.assert_array_equal(reader.layers[-1].kernel.numpy(),
                                  writer.layers[-1].kernel.numpy())
    # A prefix loads that checkpoint alone.
    info = ckpt_lib.load_into(tiny_model(), os.path.join(d, "ckpt-2"))
    assert info.name == "ckpt-2"


def test_a_delta_that_does_not_match_the_model_is_refused(tmp_path):
    d = str(tmp_path)
    writer = tiny_model()
    write_full(d, 2, writer)
    write_delta(d, 4, "ckpt-2", "ckpt-2", model=None, ids=[1])  # Dense key "unused".
    with pytest.raises(ckpt_lib.CheckpointError, match="does not have"):
        ckpt_lib.load_into(tiny_model(), d)


def test_object_keys_are_the_full_checkpoints_keys(tmp_path):
    model = tiny_model()
    ckpt_lib.build_optimizer_slots(model)
    root = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    variables, slots, _ = incremental.object_keys(root)
    prefix = root.write(os.path.join(str(tmp_path), "ckpt"))
    saved = set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())
    assert set(variables) <= saved
    assert TABLE_KEY in variables
    assert any(owner == TABLE_KEY and name == "accumulator" for owner, name in slots.values())
    assert saved - set(variables) <= {"_CHECKPOINTABLE_OBJECT_GRAPH",
                                      "save_counter/.ATTRIBUTES/VARIABLE_VALUE"}


@pytest.mark.parametrize("optimizer,names", [
    (lambda: tf.keras.optimizers.legacy.Adam(0.1), "LazyAdam"),
    (lambda: tf.keras.optimizers.Adam(0.1), "tf.keras.optimizers.Adam"),
    (lambda: tf.keras.optimizers.Ftrl(0.1), "legacy.Ftrl"),
    (lambda: tf.keras.optimizers.SGD(0.1), "legacy.SGD"),
    (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9), "legacy.SGD"),
    (lambda: tf.keras.optimizers.Adagrad(0.1, weight_decay=0.01), "weight_decay"),
    (lambda: tf.keras.optimizers.RMSprop(0.1), "row_local_sparse_updates"),
    (lambda: tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.1)),
     "tf.keras.optimizers.Adam"),  # mixed_float16: judged by its inner optimizer.
    (lambda: None, "no optimizer"),
])
def test_optimizers_whose_sparse_update_touches_every_row_are_refused(optimizer, names):
    check = incremental.IncrementalSaver._check_optimizer  # pylint: disable=protected-access
    with pytest.raises(ckpt_lib.CheckpointError, match=names):
        check(optimizer())


@pytest.mark.parametrize("optimizer", [
    lambda: tf.keras.optimizers.legacy.Adagrad(0.1),
    lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
    lambda: tf.keras.optimizers.Adagrad(0.1),
    lambda: tf_psplugin.LazyAdam(0.1),
    # mixed_float16: Keras's loss scaling applies with its inner optimizer (or not at all).
    lambda: tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adagrad(0.1)),
])
def test_row_local_optimizers_are_accepted_and_are_row_local(optimizer):
    """Accepted, and measured: two sparse steps on disjoint rows leave every other row alone."""
    incremental.IncrementalSaver._check_optimizer(optimizer())  # pylint: disable=protected-access
    opt = optimizer()
    table = tf.Variable(tf.random.stateless_uniform([6, 2], seed=(1, 2)))
    before = table.numpy()
    for rows in ([0, 1], [2]):
        grad = tf.IndexedSlices(tf.ones([len(rows), 2]), tf.constant(rows, tf.int64),
                                tf.constant([6, 2], tf.int64))
        opt.apply_gradients([(grad, table)])
        if rows == [0, 1]:
            after_first = table.numpy()
            slots_first = [v.numpy() for v in _slots(opt, table)]
    after = table.numpy()
    np.testing.assert_array_equal(after[0:2], after_first[0:2])  # Not moved by step 2.
    np.testing.assert_array_equal(after[3:], before[3:])  # Never looked up.
    assert not np.array_equal(after[2], before[2])
    for first, last in zip(slots_first, [v.numpy() for v in _slots(opt, table)]):
        np.testing.assert_array_equal(last[0:2], first[0:2])
        np.testing.assert_array_equal(last[3:], first[3:])


def _slots(opt, var):
    if hasattr(opt, "get_slot_names"):
        return [opt.get_slot(var, name) for name in opt.get_slot_names()]
    return [v for v in opt.variables if v.shape == var.shape]


def test_lazy_adam_equals_adam_on_the_rows_it_updates():
    """Rows looked up in every step move exactly (bit for bit) as under Keras's Adam."""
    lazy, adam = tf_psplugin.LazyAdam(0.05), tf.keras.optimizers.Adam(0.05)
    start = tf.random.stateless_uniform([5, 3], seed=(3, 4))
    a, b = tf.Variable(start), tf.Variable(start)
    for step in range(3):
        values = tf.random.stateless_normal([2, 3], seed=(step, 9))
        grad = tf.IndexedSlices(values, tf.constant([1, 3], tf.int64), tf.constant([5, 3]))
        lazy.apply_gradients([(grad, a)])
        adam.apply_gradients([(tf.convert_to_tensor(grad), b)])
    np.testing.assert_array_equal(a.numpy()[[1, 3]], b.numpy()[[1, 3]])
    np.testing.assert_array_equal(a.numpy()[[0, 2, 4]], start.numpy()[[0, 2, 4]])
    with pytest.raises(ValueError, match="amsgrad"):
        tf_psplugin.LazyAdam(amsgrad=True)


def test_every_write_through_a_variable_stamps_its_rows():
    """assign* stamps every row, scatter_* (also nd, also in a tf.function) only its rows."""
    shard = tf.Variable(tf.zeros([10, 2]))
    generation = tf.Variable(1, dtype=tf.int32)
    stamps = incremental.RowStamps(shard, generation, tf.Variable(tf.zeros([10], tf.int32)))
    stamps.watch(shard)
    stamps.watch(shard)  # Idempotent.
    since = [1]

    def rows():
        out = sorted(stamps.dirty_rows(since[0]).numpy().tolist())
        since[0] = int(generation.assign_add(1).numpy())
        return out

    shard.scatter_update(tf.IndexedSlices(tf.ones([2, 2]), tf.constant([4, 8])))
    assert rows() == [4, 8]
    shard.scatter_add(sparse_delta=tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1])))
    assert rows() == [1]
    shard.scatter_nd_update(tf.constant([[6], [2]]), tf.ones([2, 2]))
    assert rows() == [2, 6]
    assert rows() == []

    @tf.function
    def reset_row(i):
        shard.scatter_update(tf.IndexedSlices(tf.zeros([1, 2]), tf.reshape(i, [1])))

    reset_row(tf.constant(3))
    reset_row(tf.constant(5))  # The same trace, run twice: both stamped.
    assert rows() == [3, 5]
    shard.assign(tf.zeros([10, 2]))  # set_weights, EarlyStopping, a reset.
    assert rows() == list(range(10))
    shard.assign_sub(tf.ones([10, 2]))
    assert rows() == list(range(10))
    np.testing.assert_array_equal(shard.numpy(), -np.ones([10, 2]))  # The writes themselves.


def test_a_delta_commits_only_once_every_file_is_visible(tmp_path, monkeypatch):
    """A data file a shared FS shows late is waited for; one that never shows is an error."""
    import threading  # pylint: disable=g-import-not-at-top

    write_full(str(tmp_path), 1)
    info = write_delta(str(tmp_path), 2, "ckpt-1", "ckpt-1", ids=[3], rows=np.ones([1, DIM]))
    bundle = os.path.join(str(tmp_path), "delta-2", "ps-0")
    data = bundle + ".data-00000-of-00001"
    md.remove_commit_marker(info.path)
    os.rename(data, data + ".late")
    timer = threading.Timer(0.3, os.rename, (data + ".late", data))
    timer.start()
    try:
        late = md.commit_delta(info.path, 2, None, base="ckpt-1", parent="ckpt-1",
                               manifest={}, bundles=[bundle])
    finally:
        timer.join(timeout=10)
    assert "delta-2/ps-0.data-00000-of-00001" in late.files
    assert md.checkpoint_chain(str(tmp_path))[1][-1].name == "delta-2"
    md.remove_commit_marker(info.path)
    os.remove(data)
    monkeypatch.setattr(md.time, "sleep", lambda _: None)
    with pytest.raises(ckpt_lib.CheckpointError, match="cannot see the files"):
        md.commit_delta(info.path, 2, None, base="ckpt-1", parent="ckpt-1", manifest={},
                        bundles=[bundle])
    assert not os.path.exists(info.path + md.COMMIT_SUFFIX)


def test_full_every_needs_the_hybrid_strategy(tmp_path):
    model = tiny_model()
    with pytest.raises(ckpt_lib.CheckpointError, match="HybridParameterServerStrategy"):
        ckpt_lib.ChiefCheckpointManager(str(tmp_path), model=model, optimizer=model.optimizer,
                                   full_every_saves=3)
    with pytest.raises(ValueError, match="full_every"):
        ckpt_lib.ChiefCheckpointManager(str(tmp_path), model=model, optimizer=model.optimizer,
                                   full_every_saves=0)
    # full_every_saves=1 (or None): every save is full, no tracking needed.
    manager = ckpt_lib.ChiefCheckpointManager(str(tmp_path), model=model,
                                         optimizer=model.optimizer, full_every_saves=1)
    assert manager.save(1).kind == "full"


def test_row_stamps_never_lose_a_row_updated_between_saves():
    shard = tf.Variable(tf.zeros([10, 2]))
    generation = tf.Variable(1, dtype=tf.int32)
    stamps = incremental.RowStamps(shard, generation, tf.Variable(tf.zeros([10], tf.int32)))
    saver = object.__new__(incremental.IncrementalSaver)  # Only its generation bookkeeping.
    saver._generations, saver._since = {"ps-0": generation}, {"ps-0": 1}

    def rows(since):
        return sorted(stamps.dirty_rows(since["ps-0"]).numpy().tolist())

    def mark(ids):
        stamps.mark(tf.IndexedSlices(tf.ones([len(ids), 2]), tf.constant(ids, tf.int64)))

    mark([2, 5])
    saver.advance()  # A full save: what was updated before it is in it.
    mark([7])
    since = saver.advance()  # Delta 1 starts: rows stamped since the full save.
    mark([3])  # Updated while delta 1 is being gathered...
    assert rows(since) == [3, 7]
    since = saver.advance()  # ...so delta 2 has it too.
    assert rows(since) == [3]
    assert rows(saver.advance()) == []  # Nothing updated since delta 2.
    stamps.mark(tf.ones([10, 2]))  # A dense gradient (e.g. a regularizer): every row.
    assert rows(saver.advance()) == list(range(10))
