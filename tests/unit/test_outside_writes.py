"""Eager writes outside a step are numbered (`sync.outside_writes`), and the manager's
same-step save decision follows them (`ChiefCheckpointManager.save`).

Single process, no cluster: the variables are watched by the manager itself
(`checkpoint._watch_writes`), as they are for a model without the strategy;
under the strategy the variable creation watches them from their birth
(the composition suite, tests/cluster/test_composition.py, checks that on a
cluster: the ``export`` and ``full_every`` cells with ``ema`` and
``early_stop``).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.keras import checkpoint_callback
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import model_dir as md
from tf_psplugin.state import row_stamps
from tf_psplugin.sync import outside_writes
from tests.unit.test_checkpoint_unit import data, tiny_model, train


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def names(variables):
    return [v.name for v in variables]


def test_eager_writes_are_numbered_per_variable_and_traced_ones_are_not():
    a, b = tf.Variable(tf.zeros([4, 2]), name="a"), tf.Variable(tf.zeros([4, 2]), name="b")
    outside_writes.watch(a)
    outside_writes.watch(a)  # Idempotent: one number per write.
    outside_writes.watch(b)
    start = outside_writes.generation()
    assert outside_writes.written_after([a, b], start) == []
    a.assign(tf.ones([4, 2]))
    assert outside_writes.generation() == start + 1
    assert names(outside_writes.written_after([a, b], start)) == [a.name]
    after_a = outside_writes.generation()
    b.scatter_update(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2])))
    b.scatter_nd_add(tf.constant([[1]]), tf.ones([1, 2]))
    assert outside_writes.generation() == after_a + 2
    assert names(outside_writes.written_after([a, b], after_a)) == [b.name]

    @tf.function
    def step():  # A write in a traced function (the optimizer's apply): not counted.
        a.assign_add(tf.ones([4, 2]))
        b.scatter_add(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])))

    before = outside_writes.generation()
    step()
    step()
    assert outside_writes.generation() == before
    np.testing.assert_array_equal(a.numpy(), 3 * np.ones([4, 2]))  # The writes themselves.
    np.testing.assert_array_equal(b.numpy()[[0, 1, 2]], [[2, 2], [1, 1], [1, 1]])


def test_row_stamps_and_write_numbers_both_see_a_write():
    """`RowStamps.watch` on a variable the strategy already watches keeps both wrappers."""
    shard = tf.Variable(tf.zeros([6, 2]))
    outside_writes.watch(shard)
    generation = tf.Variable(1, dtype=tf.int32)
    stamps = row_stamps.RowStamps(shard, generation, tf.Variable(tf.zeros([6], tf.int32)))
    stamps.watch(shard)
    generation.assign(2)
    before = outside_writes.generation()
    shard.scatter_update(tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 4])))
    assert sorted(stamps.dirty_rows(2).numpy().tolist()) == [1, 4]
    assert names(outside_writes.written_after([shard], before)) == [shard.name]
    np.testing.assert_array_equal(shard.numpy()[[1, 4]], np.ones([2, 2]))


@pytest.fixture
def written(monkeypatch):
    """The step of every checkpoint really written (TF's manager's saves), in order."""
    calls = []
    save = tf.train.CheckpointManager.save

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("checkpoint_number"))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(tf.train.CheckpointManager, "save", spy)
    return calls


def ema_adagrad():
    return tf.keras.optimizers.Adagrad(0.5, use_ema=True, ema_momentum=0.5)


def restored_weights(model_dir, optimizer=None):
    """The weights `load_into` gives a new model (compiled with `optimizer()` if given)."""
    model = tiny_model(seed=9)
    if optimizer is not None:
        model.compile(optimizer(), "mse")
    ckpt_lib.load_into(model, str(model_dir))
    return model.get_weights()


def assert_weights_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_a_write_after_a_save_of_the_same_step_saves_it_again(tmp_path, written):
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path, model=model, optimizer=model.optimizer)
    train(model, 2)
    first = manager.save(2)
    assert manager.save(2, final=True) is first  # Nothing written since: not rewritten.
    assert written == [2]
    table = model.get_layer("table").embeddings
    table.assign(tf.fill(table.shape, 0.25))  # A user's write, no step.
    again = manager.save(2, final=True)
    assert written == [2, 2]
    assert again.path == first.path and again.step == 2
    assert md.read_training_done(str(tmp_path))["checkpoint"] == again.path
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == [2]
    assert_weights_equal(restored_weights(tmp_path), model.get_weights())
    assert manager.save(2) is again  # And not once more.
    assert written == [2, 2]


def test_a_restore_then_a_save_of_its_step_writes_nothing(tmp_path, written):
    model = tiny_model()
    train(model, 2)
    ckpt_lib.ChiefCheckpointManager(tmp_path, model=model, optimizer=model.optimizer).save(2)
    fresh = tiny_model(seed=5)
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path, model=fresh, optimizer=fresh.optimizer)
    manager.restore()
    assert manager.save(2, final=True).step == 2
    assert written == [2]  # The first manager's save only: the restore's writes are no change.


class SetWeights(tf.keras.callbacks.Callback):
    """A user's callback: sets every weight to `value` at the end of the last epoch."""

    def __init__(self, value, epochs):
        super().__init__()
        self.value, self.epochs = value, epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epochs - 1:
            self.model.set_weights([np.full_like(w, self.value) for w in
                                    self.model.get_weights()])


class WeightsAtLastBatch(tf.keras.callbacks.Callback):
    """Records the weights at the end of each batch (after the callbacks before it saved)."""

    def on_train_batch_end(self, batch, logs=None):
        self.weights = self.model.get_weights()


def fit_with(model, model_dir, extra, epochs=2, steps=2, validation=False):
    """Fits with `ChiefCheckpoint` listed after `extra`: without the strategy, its train-end
    save comes where it is listed (tf-keras 2.16+'s EarlyStopping sets the best weights back
    in its `on_train_end`; under the strategy `fit` moves the save last itself).
    """
    checkpoint = checkpoint_callback.ChiefCheckpoint(model_dir, save_every_steps=steps)
    probe = WeightsAtLastBatch()
    model.fit(data(4 * steps * epochs), epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=list(extra) + [checkpoint, probe],
              validation_data=data(8, offset=5) if validation else None)
    return checkpoint, probe


@pytest.mark.parametrize("situation", ["set_weights", "early_stopping", "use_ema"])
def test_the_final_checkpoint_holds_the_weights_fit_returns_with(tmp_path, written, situation):
    """A change after the last batch's save (same step) is in the train-end checkpoint."""
    model = tiny_model()
    extra = []
    if situation == "set_weights":
        extra = [SetWeights(0.5, epochs=2)]
    elif situation == "early_stopping":
        # Only a loss 1e9 below the best counts: epoch 1 stays the best, and
        # its weights are set back at the end of epoch 2, after its last save.
        extra = [tf.keras.callbacks.EarlyStopping(monitor="loss", mode="min", min_delta=1e9,
                                                  patience=1, restore_best_weights=True)]
    else:
        model.compile(ema_adagrad(), "mse")
    checkpoint, probe = fit_with(model, tmp_path, extra)
    final = model.get_weights()
    changed = max(float(np.max(np.abs(a - b))) for a, b in zip(probe.weights, final))
    assert changed > 1e-3, "the situation changed nothing after the last batch"
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == [2, 4]
    assert written == [2, 4, 4]  # Step 4 saved again at train end.
    assert_weights_equal(
        restored_weights(tmp_path, ema_adagrad if situation == "use_ema" else None), final)
    done = md.read_training_done(str(tmp_path))
    assert done["step"] == 4 and done["checkpoint"] == checkpoint.manager.latest.path


def test_an_unchanged_final_step_is_saved_once_also_with_validation(tmp_path, written):
    """Metrics reset by validation after the last batch are no weights: no second write."""
    model = tiny_model()
    fit_with(model, tmp_path, [], validation=True)
    assert written == [2, 4]  # The train-end save of step 4 found it unchanged.
    assert md.read_training_done(str(tmp_path))["step"] == 4
    assert_weights_equal(restored_weights(tmp_path), model.get_weights())
