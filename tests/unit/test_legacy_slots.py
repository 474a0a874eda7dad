"""Keras's legacy optimizers' slots of stacked tables, shown per table (`legacy_slots`, issue 40).

In one process, with the stand-in strategy of test_table_stacking.py: after
the same training, a stacked run's legacy optimizer shows what the
unstacked run's shows -- `variables()` (names, shapes, values, order),
`get_slot_names()`, `get_slot(var, name)` for every variable the model
lists, `get_weights()`, and the checkpoint's keys, shapes and values --
while the apply is still one per stack shard with the stack shard's own
slot; `set_weights` writes through to the stack shard's slot rows.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit.test_table_stacking import (  # noqa: F401  (_stacked_updates: a fixture)
    SHARDS, _batches, _checkpointed, _model, _stacked_updates, _train)
from tf_psplugin.state import export
from tf_psplugin.tables import stacked_slots
from tf_psplugin.tables.stacking import TableStacks, TableView

OPTIMIZERS = {
    "adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.legacy.Adam(0.05),
    "sgd_momentum": lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5),
    "ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
}


def _trained(stacked: bool, name: str, steps=4):
    model = _model(TableStacks(lambda s: None) if stacked else None)
    optimizer = OPTIMIZERS[name]()
    _train(model, optimizer, _batches(steps))
    return model, optimizer


def _listed(optimizer):
    return [(v.name, v.shape.as_list()) for v in optimizer.variables()]


def _assert_same_values(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6,
                                   err_msg=f"{what} {i}")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_legacy_optimizer_shows_each_table_s_slots_as_unstacked(tmp_path, name):
    stacked, stacked_opt = _trained(True, name)
    plain, plain_opt = _trained(False, name)
    # variables() / weights: same names, shapes and order; no stack named.
    assert _listed(stacked_opt) == _listed(plain_opt)
    assert [v.name for v in stacked_opt.weights] == [v.name for v in plain_opt.weights]
    assert not any("stacked_tables" in v.name for v in stacked_opt.variables())
    assert any(isinstance(v, stacked_slots.SlotView) for v in stacked_opt.variables())
    _assert_same_values(stacked_opt.get_weights(), plain_opt.get_weights(), "get_weights")
    assert stacked_opt.get_slot_names() == plain_opt.get_slot_names()
    # get_slot of every variable the model lists (a stacked table's views).
    assert [v.name for v in stacked.trainable_variables] == [
        v.name for v in plain.trainable_variables]
    for mine, theirs in zip(stacked.trainable_variables, plain.trainable_variables):
        for slot_name in plain_opt.get_slot_names():
            got, want = stacked_opt.get_slot(mine, slot_name), plain_opt.get_slot(theirs, slot_name)
            assert (got.name, got.shape) == (want.name, want.shape), (mine.name, slot_name)
            _assert_same_values([got], [want], f"{mine.name} {slot_name}")
    # The checkpoint: the same keys, shapes and values.
    got_path = _checkpointed(stacked, stacked_opt).write(str(tmp_path / "stacked"))
    want_path = _checkpointed(plain, plain_opt).write(str(tmp_path / "plain"))
    got, want = dict(tf.train.list_variables(got_path)), dict(tf.train.list_variables(want_path))
    assert got == want
    assert any(".OPTIMIZER_SLOT" in key for key in want)
    got_reader, want_reader = tf.train.load_checkpoint(got_path), tf.train.load_checkpoint(
        want_path)
    for key in want:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            _assert_same_values([got_reader.get_tensor(key)], [want_reader.get_tensor(key)], key)


@pytest.mark.parametrize("name", ["adam", "ftrl"])
def test_set_weights_writes_each_table_s_rows_of_the_stack_slots(name):
    stacked, stacked_opt = _trained(True, name, steps=2)
    plain, plain_opt = _trained(False, name, steps=2)
    rng = np.random.default_rng(3)
    values = [np.asarray(rng.normal(size=np.shape(w)), dtype=np.asarray(w).dtype)
              if np.ndim(w) else w for w in plain_opt.get_weights()]
    stacked_opt.set_weights(values)
    plain_opt.set_weights(values)
    _assert_same_values(stacked_opt.get_weights(), values, "after set_weights")
    # What the apply uses is the stack shard's slot: one more step each, the same.
    _train(stacked, stacked_opt, _batches(2, seed=7))
    _train(plain, plain_opt, _batches(2, seed=7))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _assert_same_values(stacked_opt.get_weights(), plain_opt.get_weights(), "stepped")


def test_the_apply_uses_one_slot_per_stack_shard_listed_nowhere():
    stacked, optimizer = _trained(True, "adagrad", steps=1)
    views = [v for v in stacked.trainable_variables if isinstance(v, TableView)]
    shards = {id(v.stack_shard): v.stack_shard for v in views}
    assert len(shards) == 2 * SHARDS  # Widths 4 and 8, two shards each.
    listed = {id(v) for v in optimizer.variables()}
    for shard in shards.values():
        slot = optimizer.get_slot(shard, "accumulator")
        assert slot.shape == shard.shape and id(slot) not in listed
    for view in views:
        view_slot = optimizer.get_slot(view, "accumulator")
        ((slot, start, count),) = view_slot.pieces
        assert slot is optimizer.get_slot(view.stack_shard, "accumulator")
        assert (start, count) == (view.offset, view.num_rows)
        np.testing.assert_array_equal(view_slot.numpy(), slot.numpy()[start:start + count])


def test_a_checkpoint_restores_across_stacking_with_slots_per_table(tmp_path):
    source, source_opt = _trained(True, "adam")
    path = _checkpointed(source, source_opt).write(str(tmp_path / "ckpt"))
    target = _model(None, seed=5)
    target_opt = OPTIMIZERS["adam"]()
    _checkpointed(target, target_opt).read(path).assert_existing_objects_matched()
    # (Names differ in the optimizer's scope: the target's were made outside
    # apply_gradients, in no name scope, by Keras alike for unstacked tables.)
    assert [v.shape for v in target_opt.variables()] == [
        v.shape for v in source_opt.variables()]
    _assert_same_values(target_opt.get_weights(), source_opt.get_weights(), "restored")
