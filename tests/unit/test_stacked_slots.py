"""Keras's new optimizers' slots of stacked tables, listed per table (`stacked_slots`, issue 40).

In one process, with the stand-in strategy of test_table_stacking.py: a
stacked run's checkpoint holds each table's slots under the unstacked run's
keys, with its names and shapes and (training being the same) values; it
restores into the other stacking, and `optimizer.variables` shows per-table
slots, while the apply is still one per stack shard.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit.test_table_stacking import _batches, _model, _stacked_updates, _train  # noqa: F401
from tf_psplugin.state import export
from tf_psplugin.tables import stacked_slots
from tf_psplugin.tables.stacking import TableStacks, TableView

OPTIMIZERS = {
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.Adam(0.05),
    "sgd": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.5),
    "ftrl": lambda: tf.keras.optimizers.Ftrl(0.1),
}


def _trained(stacked: bool, make, seed=0, steps=4):
    model = _model(TableStacks(lambda s: None) if stacked else None, seed=seed)
    optimizer = make()
    _train(model, optimizer, _batches(steps))
    return model, optimizer


def _tensors(path):
    reader = tf.train.load_checkpoint(path)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if not key.startswith("save_counter") and "_CHECKPOINTABLE_OBJECT_GRAPH" not in key}


def _assert_same_tensors(got, want, atol=1e-6):
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key in want:
        assert got[key].shape == want[key].shape, key
        if want[key].dtype.kind in "SUO":
            assert np.array_equal(got[key], want[key]), key
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_checkpoint_holds_per_table_slots_as_unstacked(tmp_path, name):
    stacked, stacked_opt = _trained(True, OPTIMIZERS[name])
    plain, plain_opt = _trained(False, OPTIMIZERS[name])
    got = _tensors(tf.train.Checkpoint(model=stacked, optimizer=stacked_opt).write(
        str(tmp_path / "stacked")))
    want = _tensors(tf.train.Checkpoint(model=plain, optimizer=plain_opt).write(
        str(tmp_path / "plain")))
    assert any(k.startswith("optimizer/_variables/") for k in want)
    _assert_same_tensors(got, want)
    # optimizer.variables: per-table slots, named and shaped as unstacked.
    assert [(v.name, v.shape.as_list()) for v in stacked_opt.variables] == [
        (v.name, v.shape.as_list()) for v in plain_opt.variables]
    assert not any("stacked_tables" in v.name for v in stacked_opt.variables)
    assert any(isinstance(v, stacked_slots.SlotView) for v in stacked_opt.variables)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("direction", ["stacked_to_unstacked", "unstacked_to_stacked"])
def test_slots_restore_across_stacking(tmp_path, name, direction):
    source_stacked = direction == "stacked_to_unstacked"
    source, source_opt = _trained(source_stacked, OPTIMIZERS[name])
    path = tf.train.Checkpoint(model=source, optimizer=source_opt).write(str(tmp_path / "ckpt"))
    target = _model(TableStacks(lambda s: None) if not source_stacked else None, seed=5)
    target_opt = OPTIMIZERS[name]()
    target_opt.build(target.trainable_variables)
    tf.train.Checkpoint(model=target, optimizer=target_opt).read(path).assert_consumed()
    assert len(target_opt.variables) == len(source_opt.variables)
    for a, b in zip(target_opt.variables, source_opt.variables):
        np.testing.assert_array_equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
    # Training goes on identically from there.
    _train(source, source_opt, _batches(3, seed=4))
    _train(target, target_opt, _batches(3, seed=4))
    for a, b in zip(export.logical_weights(target), export.logical_weights(source)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(target_opt.variables, source_opt.variables):
        np.testing.assert_allclose(tf.convert_to_tensor(a), tf.convert_to_tensor(b),
                                   rtol=1e-5, atol=1e-6)


def test_one_apply_per_stack_shard_with_per_table_slots(monkeypatch):
    """The slots the apply uses are the stack shards' own, one per (stack shard, slot name)."""
    applied = []
    adam = tf.keras.optimizers.Adam
    update_step = adam.update_step
    monkeypatch.setattr(adam, "update_step",
                        lambda self, g, v: applied.append(v) or update_step(self, g, v))
    model, optimizer = _trained(True, OPTIMIZERS["adam"], steps=2)
    tables = [layer.embeddings for layer in model.layers
              if isinstance(layer, tf.keras.layers.Embedding)]
    shards = {id(s) for t in tables for s in t.variables}
    # Applies (each traced call's): to the 2 stacks (widths 4 and 8) x 2
    # shards, never to a view.
    assert {id(v) for v in applied if id(v) in shards} == shards
    assert len(shards) == 4
    assert not any(isinstance(v, TableView) for v in applied)
    # Each listed slot is its table's rows of the stack shards' slots (one
    # shard's; with tf-keras 2.16+ every shard's, in shard order).
    listed = [v for v in optimizer.variables if isinstance(v, stacked_slots.SlotView)]
    assert listed
    for view_slot in listed:
        rows = [slot.numpy()[start:start + count] for slot, start, count in view_slot.pieces]
        np.testing.assert_array_equal(view_slot.numpy(), np.concatenate(rows))
