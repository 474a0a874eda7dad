"""checkpoint_write: checkpoint writes traced once, values and layout unchanged."""

import os

import numpy as np
import tensorflow as tf

from tf_psplugin.state import checkpoint_write


class _IntValue:
    """An int saved as Python state."""

    def __init__(self, value=0):
        self.value = value

    def serialize(self):
        return str(self.value)

    def deserialize(self, string_value):
        self.value = int(string_value)


class _State(_IntValue, checkpoint_write.FedPythonState):
    pass


class _PlainState(_IntValue, tf.train.experimental.PythonState):
    pass


def _read(path, **objects):
    tf.train.Checkpoint(**objects).read(path).assert_consumed()
    return objects


def _tracing_count(ckpt):
    """Traces of every write function the checkpoint built (1: one, reused)."""
    cache = ckpt._write_cache  # pylint: disable=protected-access
    return cache.traces * cache.write.experimental_get_tracing_count()


def test_the_traced_write_is_not_itself_checkpointed(tmp_path):
    ckpt = checkpoint_write.TracedWriteCheckpoint(v=tf.Variable(1.0))
    before = len(list(tf.train.TrackableView(ckpt).descendants()))
    ckpt.write(str(tmp_path / "ck"))
    assert len(list(tf.train.TrackableView(ckpt).descendants())) == before


def test_writes_trace_once_and_save_current_values(tmp_path):
    var, state = tf.Variable([1.0, 2.0]), _State(1)
    ckpt = checkpoint_write.TracedWriteCheckpoint(v=var, state=state)
    for i in range(4):
        var.assign([float(i), float(i) + 0.5])
        state.value = 10 + i
        ckpt.write(str(tmp_path / f"ck{i}"))
    assert _tracing_count(ckpt) == 1
    for i in range(4):
        got = _read(str(tmp_path / f"ck{i}"), v=tf.Variable([0.0, 0.0]), state=_State())
        np.testing.assert_array_equal(got["v"].numpy(), [i, i + 0.5])
        assert got["state"].value == 10 + i


def test_file_layout_is_tf_own(tmp_path):
    var, state = tf.Variable([1.0, 2.0]), _State(3)
    checkpoint_write.TracedWriteCheckpoint(v=var, state=state).write(str(tmp_path / "a" / "ck"))
    tf.train.Checkpoint(v=var, state=state).write(str(tmp_path / "b" / "ck"))
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
    a = tf.train.load_checkpoint(str(tmp_path / "a" / "ck")).get_variable_to_shape_map()
    b = tf.train.load_checkpoint(str(tmp_path / "b" / "ck")).get_variable_to_shape_map()
    assert a == b


def test_retraced_when_the_checkpointed_objects_change(tmp_path):
    ckpt = checkpoint_write.TracedWriteCheckpoint(v=tf.Variable(1.0))
    ckpt.write(str(tmp_path / "one"))
    ckpt.w = tf.Variable(2.0)  # e.g. optimizer slots created after a first save.
    ckpt.write(str(tmp_path / "two"))
    got = _read(str(tmp_path / "two"), v=tf.Variable(0.0), w=tf.Variable(0.0))
    assert (got["v"].numpy(), got["w"].numpy()) == (1.0, 2.0)
    assert ckpt._write_cache.traces == 2  # pylint: disable=protected-access


def test_other_python_state_takes_tf_own_path(tmp_path):
    plain = _PlainState(1)
    ckpt = checkpoint_write.TracedWriteCheckpoint(state=plain)
    for value in (5, 6):
        plain.value = value
        ckpt.write(str(tmp_path / f"ck{value}"))
        assert _read(str(tmp_path / f"ck{value}"), state=_PlainState())["state"].value == value
    assert ckpt._write_cache.traces == 0  # pylint: disable=protected-access


def test_checkpoint_manager_keeps_its_bookkeeping(tmp_path):
    var = tf.Variable(0.0)
    ckpt = checkpoint_write.TracedWriteCheckpoint(v=var)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        var.assign(float(step))
        manager.save(checkpoint_number=step)
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-3")
    assert not any(name.startswith("ckpt-1.") for name in os.listdir(tmp_path))
    restored = tf.Variable(0.0)
    tf.train.Checkpoint(v=restored).read(manager.latest_checkpoint).assert_existing_objects_matched()
    assert restored.numpy() == 3.0
    assert _tracing_count(ckpt) == 1


def test_a_loss_scale_is_saved_as_tf_own_write_saves_it(tmp_path):
    """Keras's dynamic loss scale (mixed_float16) lists its variables per graph.

    Its `_trackable_children` gives the current graph's only: inside the
    traced write it gave none, and checkpoints lost the loss scale.
    """
    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.1))
    var = tf.Variable([1.0, 2.0])
    optimizer.apply_gradients([(tf.constant([0.5, 0.5]), var)])
    assert int(optimizer.dynamic_counter) == 1
    ckpt = checkpoint_write.TracedWriteCheckpoint(optimizer=optimizer, var=var)
    traced = ckpt.write(str(tmp_path / "traced"))
    own = tf.train.Checkpoint(optimizer=optimizer, var=var).write(str(tmp_path / "own"))
    traced_keys = tf.train.load_checkpoint(traced).get_variable_to_shape_map()
    assert set(traced_keys) == set(tf.train.load_checkpoint(own).get_variable_to_shape_map())
    assert any("loss_scale/current_loss_scale" in key for key in traced_keys), sorted(traced_keys)
    fresh = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.1))
    fresh_var = tf.Variable([0.0, 0.0])
    fresh.build([fresh_var])
    tf.train.Checkpoint(optimizer=fresh, var=fresh_var).read(traced).assert_consumed()
    assert int(fresh.dynamic_counter) == 1
    assert float(fresh.loss_scale) == float(optimizer.loss_scale)
    ckpt.write(str(tmp_path / "again"))  # The loss scale is listed eagerly again after a write.
    assert _tracing_count(ckpt) == 1
    assert any("loss_scale" in key for key in
               tf.train.load_checkpoint(str(tmp_path / "again")).get_variable_to_shape_map())
