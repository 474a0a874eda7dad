"""A live optimizer's slots of a stack, split with it (`slot_split`, issue 40).

In one process, with the stand-in strategy of test_table_stacking.py: a
Keras (new) optimizer trains a stack and lives on; a user's legacy
optimizer, not known to update a stack elementwise, gets the stack split
apart at its step's first trace (`stacked_fallback.trace_splitting`). The
Keras optimizer's slots of the old stack shards move to the new ones, and
it trains on: weights, what it lists (names, shapes, values) and a
checkpoint of the model and the optimizer end as unstacked tables'. A live
slot of a layout the split does not know keeps the stack whole: refused,
naming the fix.

(The strategy's variable creator records each slot of a stack shard;
this harness has none, so the tests record them as it would, and a moved
slot, made without it, is recorded by the test too.)
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit.test_stacked_slots import _assert_same_tensors, _tensors
from tests.unit.test_table_stacking import (  # noqa: F401
    _batches, _dispatch, _model, _RmsScaledAdagrad, _stacked_updates, _tables, _train,
    _train_splitting)
from tf_psplugin.errors import StackingError
from tf_psplugin.state import export
from tf_psplugin.tables import slot_split, stacked_slots
from tf_psplugin.tables.stacking import TableStacks

OPTIMIZERS = {
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.Adam(0.05),
    "sgd": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.5),
}


def _record_stack_slots(stacks, optimizer) -> int:
    """Records the optimizer's stack slots as the strategy's slot creator would; their count."""
    recorded = 0
    for var in optimizer.variables:
        for slot, _, _ in getattr(var, "pieces", ()):
            shard = stacked_slots.stack_shard_of(slot)
            if shard is not None:
                stacks.seal(shard, slot=slot)
                recorded += 1
    return recorded


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_live_keras_optimizer_s_slots_are_split_with_the_stack(tmp_path, name):
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    firsts = {"stacked": OPTIMIZERS[name](), "plain": OPTIMIZERS[name]()}
    seconds = {"stacked": _RmsScaledAdagrad(0.3), "plain": _RmsScaledAdagrad(0.3)}
    first_step = _train(stacked, firsts["stacked"], _batches(2))
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    assert narrow[0].stack is narrow[1].stack is narrow[2].stack
    assert _record_stack_slots(stacks, firsts["stacked"])
    old_slots = slot_split.keras_slots_of(firsts["stacked"], narrow[0].stack.shards[0])
    assert old_slots and narrow[0].stack.slots_held_by()
    _train_splitting(stacked, seconds["stacked"], _batches(2, seed=2), stacks)
    assert len({id(t.stack) for t in narrow}) == 3  # Split, with the slots.
    for table in narrow:  # The moved slots: one per new stack shard, of its rows.
        for shard in table.stack.shards:
            moved = slot_split.keras_slots_of(firsts["stacked"], shard)
            assert len(moved) == len(old_slots)
            assert all(m.shape == shard.shape for m in moved)
            assert not any(m is o for m in moved for o in old_slots)
    for o in old_slots:  # Emptied (no key leads there any more): no rows left.
        assert tf.raw_ops.ReadVariableOp(resource=o.handle, dtype=o.dtype).shape[0] == 0
    _dispatch(first_step, _batches(2, seed=3), stacks)  # The first again, traced anew.
    _train(plain, firsts["plain"], _batches(2))
    _train(plain, seconds["plain"], _batches(2, seed=2))
    _train(plain, firsts["plain"], _batches(2, seed=3))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    mine, theirs = firsts["stacked"].variables, firsts["plain"].variables
    assert [(v.name, v.shape.as_list()) for v in mine] == [
        (v.name, v.shape.as_list()) for v in theirs]
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), b.numpy(), rtol=0,
                                   atol=1e-6, err_msg=b.name)
    assert any(isinstance(v, stacked_slots.SlotView) and np.abs(v.numpy()).max() > 1e-3
               for v in mine)  # Its table slots trained (not a comparison of zeros).
    got = _tensors(tf.train.Checkpoint(model=stacked, optimizer=firsts["stacked"]).write(
        str(tmp_path / "stacked")))
    want = _tensors(tf.train.Checkpoint(model=plain, optimizer=firsts["plain"]).write(
        str(tmp_path / "plain")))
    _assert_same_tensors(got, want)


class _PerVariableSGD(tf.keras.optimizers.Optimizer):
    """A custom Keras optimizer with a velocity per variable (Keras's own slots, per table)."""

    def __init__(self, learning_rate=0.1, name="PerVariableSGD"):
        super().__init__(name=name)
        self._learning_rate = self._build_learning_rate(learning_rate)

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self.velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]
        self._built = True

    def update_step(self, gradient, variable):
        velocity = self.velocities[self._index_dict[self._var_key(variable)]]
        velocity.assign(0.5 * velocity + tf.convert_to_tensor(gradient))
        variable.assign_sub(tf.cast(self.learning_rate, variable.dtype) * velocity)

    def get_config(self):
        config = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter(self._learning_rate)
        return config


def test_a_live_slot_of_an_unknown_layout_keeps_the_stack_whole_naming_the_fix():
    """A Keras optimizer outside the known ones (its slots per table): the split is refused."""
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    custom = _PerVariableSGD()
    _train(model, custom, _batches(1))  # A custom loop: applied per table, the stack shared.
    narrow = [_tables(model)[f"emb_{f}"] for f in range(3)]
    assert narrow[0].stack is narrow[1].stack
    for table in narrow:  # What the strategy's creator records (a slot colocated with a view).
        for view in table.views:
            stacks.seal(view, slot=custom.velocities[custom._index_dict[custom._var_key(view)]])
    with pytest.raises(StackingError,
                       match=r"stack_tables=False.*cannot be split: an optimizer that is still "
                             r"alive has slots for it that a split cannot move"):
        _train_splitting(model, _RmsScaledAdagrad(0.3), _batches(1), stacks)
    assert narrow[0].stack is narrow[1].stack is narrow[2].stack  # Nothing split.


def test_movable_refuses_a_list_layout_it_does_not_know():
    """Pure bookkeeping: a slot no optimizer list holds at its shard's position is not moved."""
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    adagrad = tf.keras.optimizers.Adagrad(0.3)
    _train(model, adagrad, _batches(1))
    _record_stack_slots(stacks, adagrad)
    stack = _tables(model)["emb_0"].stack
    found = slot_split.movable(stack.live_slots())
    assert found and all(m.optimizer is adagrad and m.lists for m in found)
    assert {m.shard for m in found} == {0, 1}
    assert len({m.key for m in found}) == 2  # One position per stack shard.
    stray = tf.Variable(tf.zeros(stack.shards[0].shape))
    stacks.seal(stack.shards[0], slot=stray)  # A slot of the shard no optimizer recorded.
    assert slot_split.movable(stack.live_slots()) is None
