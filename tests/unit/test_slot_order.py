"""Keras's new optimizers' table slots checkpointed per table in logical order (`slot_order`, issue 40).

In one process, with the stand-in strategy of test_table_stacking.py (tables
of 2 or 3 interleaved shards, stacked or not): the checkpoint holds each
table's slots as one logical ``[V, D]`` tensor under the key a plain model
gives it, with the format marker; it restores into another shard count,
the other stacking and a plain model, and training then goes on as from the
source; a checkpoint without the marker keeps the old listing.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit import test_table_stacking
from tf_psplugin._internal.tf_internal import sharded_variable
from tests.unit.test_table_stacking import _batches, _model, _stacked_updates, _train  # noqa: F401
from tf_psplugin.state import export
from tf_psplugin.tables import slot_order
from tf_psplugin.tables.layout import shard_rows
from tf_psplugin.tables.stacking import TableStacks

OPTIMIZERS = {
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.Adam(0.05),
}


def _cluster_model(shards: int, stacked: bool, seed: int = 0):
    return _model(TableStacks(lambda s: None) if stacked else None, num_shards=shards, seed=seed)


@pytest.fixture
def plain_model(monkeypatch):
    """Builds the same architecture with ordinary ``[V, D]`` variables (no sharding)."""

    def build(seed=0):
        with monkeypatch.context() as patch:
            patch.setattr(test_table_stacking, "_table_creator",
                          lambda stacks, num_shards=2: lambda next_creator, **kw: next_creator(**kw))
            return _model(None, seed=seed)

    return build


def _installed(name, model):
    optimizer = slot_order.install(OPTIMIZERS[name]())
    optimizer.build(model.trainable_variables)
    return optimizer


def _write(model, optimizer, path) -> str:
    return tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(path))


def _tensors(path):
    reader = tf.train.load_checkpoint(path)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if not key.startswith("save_counter") and "_CHECKPOINTABLE_OBJECT_GRAPH" not in key}


def _trained(name, shards, stacked, steps=4):
    model = _cluster_model(shards, stacked)
    optimizer = _installed(name, model)
    _train(model, optimizer, _batches(steps))
    return model, optimizer


def _assert_equal_tensors(got, want, atol=0.0):
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key in want:
        assert got[key].shape == want[key].shape, key
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=atol, err_msg=key)


def _assert_same_training(a, a_opt, b, b_opt, tmp_path):
    """One more step from each (same batches): the same weights and slots (1e-6)."""
    _train(a, a_opt, _batches(2, seed=7))
    _train(b, b_opt, _batches(2, seed=7))
    for x, y in zip(export.logical_weights(a), export.logical_weights(b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    got = _tensors(_write(a, a_opt, tmp_path / "after_a"))
    want = _tensors(_write(b, b_opt, tmp_path / "after_b"))
    got.pop(f"optimizer/{slot_order.FORMAT_KEY}", None)
    want.pop(f"optimizer/{slot_order.FORMAT_KEY}", None)
    _assert_equal_tensors(got, want, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stacked", [False, True], ids=["unstacked", "stacked"])
def test_checkpoint_holds_logical_slots_under_plain_keys(tmp_path, plain_model, name, stacked):
    model, optimizer = _trained(name, 2, stacked)
    got = _tensors(_write(model, optimizer, tmp_path / "cluster"))
    plain = plain_model()
    plain_opt = OPTIMIZERS[name]()
    _train(plain, plain_opt, _batches(4))
    want = _tensors(_write(plain, plain_opt, tmp_path / "plain"))
    marker = f"optimizer/{slot_order.FORMAT_KEY}"
    assert got.pop(marker) == slot_order.LOGICAL
    assert slot_order.is_marked([marker]) and not slot_order.is_marked(want)
    assert sorted(got) == sorted(want)
    slots = [k for k in want if k.startswith("optimizer/_variables/")]
    assert any(want[k].shape == (test_table_stacking.VOCAB + 8, 4) for k in slots)
    for key in want:
        assert got[key].shape == want[key].shape, key


@pytest.mark.parametrize("stacked", [False, True], ids=["unstacked", "stacked"])
def test_plain_model_reads_the_slots_in_row_order(tmp_path, plain_model, stacked):
    """Adagrad's accumulator: rows the batches never looked up are exactly 0.1, most others grew.

    Rows restored into the wrong order would put grown rows where no id was looked up.
    """
    model, optimizer = _trained("adagrad", 2, stacked)
    path = _write(model, optimizer, tmp_path / "ckpt")
    plain = plain_model(seed=3)
    plain_opt = OPTIMIZERS["adagrad"]()
    plain_opt.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain_opt).read(path).assert_existing_objects_matched()
    ids = np.concatenate([x.numpy() for x, _ in _batches(4)])
    tables = [layer for layer in plain.layers if isinstance(layer, tf.keras.layers.Embedding)]
    for f, layer in enumerate(tables):
        accumulator, = [v for v in plain_opt.variables
                        if "accumulator" in v.name and f"{layer.name}/" in v.name]
        rows = accumulator.numpy()
        seen = np.zeros(rows.shape[0], bool)
        seen[ids[:, f]] = True
        assert np.all(rows[~seen] == np.float32(0.1)), layer.name
        # (A looked-up row whose gradient was 0, e.g. behind a dead ReLU, stays 0.1.)
        assert np.mean(rows[seen].max(axis=1) > np.float32(0.1)) > 0.5, layer.name
    for a, b in zip(export.logical_weights(plain), export.logical_weights(model)):
        np.testing.assert_array_equal(a, b)
    _assert_same_training(plain, plain_opt, model, optimizer, tmp_path)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("source,target", [
    ((2, False), (3, False)), ((3, False), (1, False)), ((2, True), (3, True)),
    ((3, True), (1, True)), ((2, True), (2, False)), ((2, False), (3, True)),
], ids=lambda p: f"{p[0]}{'s' if p[1] else 'u'}")
def test_slots_restore_into_another_shard_count_and_stacking(tmp_path, name, source, target):
    model, optimizer = _trained(name, *source)
    path = _write(model, optimizer, tmp_path / "source")
    restored = _cluster_model(*target, seed=5)
    restored_opt = _installed(name, restored)
    assert slot_order.match_checkpoint(restored_opt, path)
    tf.train.Checkpoint(model=restored, optimizer=restored_opt).read(
        path).assert_existing_objects_matched()
    slot_order.end_restore(restored_opt)
    _assert_equal_tensors(_tensors(_write(restored, restored_opt, tmp_path / "again")),
                          _tensors(path))
    _assert_same_training(restored, restored_opt, model, optimizer, tmp_path)


@pytest.mark.parametrize("stacked", [False, True], ids=["unstacked", "stacked"])
def test_unmarked_checkpoint_restores_with_the_old_listing(tmp_path, stacked):
    """Written before this layout (no marker): same shard count restores; later saves are logical."""
    model = _cluster_model(2, stacked)
    optimizer = OPTIMIZERS["adam"]()  # Not installed: Keras's own listing.
    _train(model, optimizer, _batches(4))
    path = _write(model, optimizer, tmp_path / "old")
    assert not slot_order.is_marked(tf.train.load_checkpoint(path).get_variable_to_shape_map())
    restored = _cluster_model(2, stacked, seed=5)
    restored_opt = _installed("adam", restored)
    assert not slot_order.match_checkpoint(restored_opt, path)
    tf.train.Checkpoint(model=restored, optimizer=restored_opt).read(
        path).assert_existing_objects_matched()
    _assert_equal_tensors(_tensors(_write(restored, restored_opt, tmp_path / "relisted")),
                          _tensors(path))
    slot_order.end_restore(restored_opt)
    after = _write(restored, restored_opt, tmp_path / "logical")
    assert slot_order.is_marked(tf.train.load_checkpoint(after).get_variable_to_shape_map())
    # Training goes on as from the source (slots restored into the right rows).
    _train(model, optimizer, _batches(2, seed=7))
    _train(restored, restored_opt, _batches(2, seed=7))
    for a, b in zip(export.logical_weights(restored), export.logical_weights(model)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_optimizer_built_before_install_keeps_the_old_listing(tmp_path):
    model = _cluster_model(2, False)
    optimizer = OPTIMIZERS["adam"]()
    optimizer.build(model.trainable_variables)
    slot_order.install(optimizer)
    keys = tf.train.load_checkpoint(_write(model, optimizer, tmp_path / "c")).get_variable_to_shape_map()
    assert not slot_order.is_marked(keys)


def test_contiguous_table_slots_load_into_a_plain_model(tmp_path, plain_model, monkeypatch):
    """A contiguous table (TF's own `ShardedVariable`, 3 row ranges): listed per table too."""

    def contiguous(stacks, num_shards=3):
        del stacks

        def creator(next_creator, **kwargs):
            if "embeddings" not in (kwargs.get("name") or ""):
                return next_creator(**kwargs)
            value = kwargs["initial_value"]
            full = tf.convert_to_tensor(value() if callable(value) else value)
            # TF's "div" sizes: the first V % n shards one row more.
            cuts = np.cumsum([0] + shard_rows(int(full.shape[0]), num_shards, "contiguous"))
            return sharded_variable.ShardedVariable([next_creator(**{
                **kwargs, "initial_value": full[a:b], "shape": None,
                "name": f"{kwargs['name']}/part_{s}"}) for s, (a, b) in enumerate(zip(cuts, cuts[1:]))])

        return creator

    with monkeypatch.context() as patch:
        patch.setattr(test_table_stacking, "_table_creator", contiguous)
        model = _model(None)
    optimizer = _installed("adagrad", model)
    assert any(isinstance(layer.embeddings, sharded_variable.ShardedVariable)
               for layer in model.layers if isinstance(layer, tf.keras.layers.Embedding))
    _train(model, optimizer, _batches(4))
    path = _write(model, optimizer, tmp_path / "contiguous")
    plain = plain_model(seed=3)
    plain_opt = OPTIMIZERS["adagrad"]()
    plain_opt.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain_opt).read(path).assert_existing_objects_matched()
    _assert_same_training(plain, plain_opt, model, optimizer, tmp_path)
