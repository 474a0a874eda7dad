"""Single-process tests of model_dir paths, checkpoint naming, commit markers and atomicity.

No cluster: a tiny Keras model (an embedding table and a dense layer) trained
in this process. The distributed parts (pull/push of replicas, PS shards,
resharding) are covered by tests/cluster/test_checkpoint.py.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.keras import checkpoint_callback
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import model_dir as md
from tf_psplugin.tables import slot_order

VOCAB, DIM = 20, 3


def tiny_model(seed=0):
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    x = tf.keras.layers.Embedding(VOCAB, DIM, name="table", embeddings_initializer=(
        tf.keras.initializers.RandomUniform(seed=seed)))(ids)
    x = tf.keras.layers.Flatten()(x)
    out = tf.keras.layers.Dense(1, name="out", kernel_initializer=(
        tf.keras.initializers.GlorotUniform(seed=seed + 1)))(x)
    model = tf.keras.Model(ids, out)
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.5), "mse")
    return model


def data(n=16, offset=0):
    rng = np.random.default_rng(offset)
    ids = rng.integers(0, VOCAB, size=(n, 2))
    return tf.data.Dataset.from_tensor_slices((ids, (ids[:, :1] % 3).astype("float32"))).batch(4)


def train(model, steps, offset=0, callbacks=()):
    model.fit(data(4 * steps, offset), epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=list(callbacks))


def values(model):
    out = {f"w{i}": w.numpy() for i, w in enumerate(model.trainable_variables)}
    out.update({f"slot{i}": model.optimizer.get_slot(w, "accumulator").numpy()
                for i, w in enumerate(model.trainable_variables)})
    out["iter"] = model.optimizer.iterations.numpy()
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


@pytest.fixture
def saved(tmp_path):
    """A model dir with committed checkpoints at steps 2 and 4; values at each."""
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path / "m", model=model,
                                              optimizer=model.optimizer)
    refs = {}
    for step in (2, 4):
        train(model, 2, offset=step)
        manager.save(step)
        refs[step] = values(model)
    return tmp_path / "m", refs


def restore_new(model_dir):
    model = tiny_model(seed=7)
    info = ckpt_lib.ChiefCheckpointManager(model_dir, model=model,
                                      optimizer=model.optimizer).restore_or_initialize()
    return info, model


# --- model_dir paths ---------------------------------------------------------


def test_relative_and_home_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert md.resolve("runs/x") == str(tmp_path / "runs" / "x")
    assert md.resolve(tmp_path / "y") == str(tmp_path / "y")  # PathLike.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert md.resolve("~/z") == str(tmp_path / "z")
    assert md.resolve(f"file://{tmp_path}/w") == str(tmp_path / "w")


@pytest.mark.parametrize("path", ["gs://bucket/run", "hdfs://nn:8020/user/run",
                                  "s3://bucket/a/b", "gs://bucket/run/"])
def test_remote_paths_pass_through(path):
    assert md.resolve(path) == path.rstrip("/")
    assert md.is_remote(path)


@pytest.mark.parametrize("bad,problem", [
    (None, "is not set"), ("", "is empty"), ("   ", "is empty"), (" /tmp/x", "whitespace"),
    ("/tmp/a\0b", "NUL"), (123, "not a path"), ("gs://", "names no bucket"),
])
def test_malformed_paths_get_one_clear_error(bad, problem):
    with pytest.raises(md.ModelDirError) as err:
        md.resolve(bad)
    message = str(err.value)
    assert problem in message and "Fix:" in message and repr(bad) in message
    assert "\n" not in message


def test_unwritable_paths_name_the_path_and_fix(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(md.ModelDirError, match="is a file"):
        md.ensure_writable(a_file)
    with pytest.raises(md.ModelDirError, match=r"not writable.*Fix:"):
        md.ensure_writable(a_file / "sub")  # A parent is a file.
    with pytest.raises(md.ModelDirError, match="tensorflow-io"):
        md.ensure_writable("nosuchfs://bucket/run")
    created = md.ensure_writable(tmp_path / "a" / "b")
    assert os.path.isdir(created) and os.listdir(created) == []  # Probe removed.


@pytest.mark.parametrize("tf_config,chief", [
    (None, True),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
      "task": {"type": "chief", "index": 0}}, True),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
      "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
      "task": {"type": "ps", "index": 0}}, False),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"], "evaluator": ["h:4"]},
      "task": {"type": "evaluator", "index": 0}}, False),
    ({"cluster": {"worker": ["h:1", "h:2"], "ps": ["h:3"]},  # Promoted to chief.
      "task": {"type": "worker", "index": 0}}, True),
])
def test_only_the_chief_writes(tf_config, chief):
    environ = {} if tf_config is None else {"TF_CONFIG": json.dumps(tf_config)}
    assert md.is_chief_task(environ) is chief


def test_atomic_json_leaves_no_temp_files(tmp_path):
    path = str(tmp_path / "m.json")
    md.write_json_atomic(path, {"a": 1})
    md.write_json_atomic(path, {"a": 2})
    assert md.read_json(path) == {"a": 2} and os.listdir(tmp_path) == ["m.json"]
    (tmp_path / "bad.json").write_text('{"step": 3')  # Torn write.
    assert md.read_json(str(tmp_path / "bad.json")) is None
    assert md.read_json(str(tmp_path / "missing.json")) is None


# --- Naming, markers, restore ------------------------------------------------


def test_save_names_commits_and_restores_exactly(saved):
    model_dir, refs = saved
    names = sorted(os.listdir(model_dir))
    assert names == ["checkpoint", "ckpt-2.commit", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
                     "ckpt-4.commit", "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    marker = json.loads((model_dir / "ckpt-4.commit").read_text())
    assert marker["step"] == 4 and marker["input_position"] == 4  # 1 batch per step here.
    assert marker["files"] == {n: os.path.getsize(model_dir / n) for n in (
        "ckpt-4.index", "ckpt-4.data-00000-of-00001")}
    assert [i.step for i in ckpt_lib.list_checkpoints(model_dir)] == [2, 4]
    assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-4")  # Stock tools agree.
    info, model = restore_new(model_dir)
    assert info.step == 4 and info.path == str(model_dir / "ckpt-4")
    assert_same(values(model), refs[4])
    model = tiny_model(seed=7)
    ckpt_lib.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer).restore(
        str(model_dir / "ckpt-2"))
    assert_same(values(model), refs[2])


@pytest.mark.parametrize("tear", [
    "truncate_data", "truncate_index", "delete_data", "delete_index", "delete_marker",
    "garbage_marker", "marker_of_other_size",
])
def test_torn_newest_checkpoint_falls_back_to_last_complete(saved, tear):
    model_dir, refs = saved
    data, index = model_dir / "ckpt-4.data-00000-of-00001", model_dir / "ckpt-4.index"
    marker = model_dir / "ckpt-4.commit"
    if tear == "truncate_data":
        data.write_bytes(data.read_bytes()[:-8])
    elif tear == "truncate_index":
        index.write_bytes(index.read_bytes()[:10])
    elif tear == "delete_data":
        data.unlink()
    elif tear == "delete_index":
        index.unlink()
    elif tear == "delete_marker":  # Crash after TF's state file, before the marker.
        marker.unlink()
    elif tear == "garbage_marker":
        marker.write_text('{"step": 4, "fi')
    else:  # Same size in the marker but the data were rewritten shorter.
        data.write_bytes(b"x" * 3)
    if tear != "delete_index":  # TF's own choice would be the torn one.
        assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-4")
    assert ckpt_lib.latest_checkpoint_info(model_dir).step == 2
    info, model = restore_new(model_dir)
    assert info.step == 2
    assert_same(values(model), refs[2])


def test_state_file_pointing_to_missing_checkpoint_is_ignored(saved):
    model_dir, refs = saved
    (model_dir / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-99"\nall_model_checkpoint_paths: "ckpt-99"\n')
    info, model = restore_new(model_dir)
    assert info.step == 4
    assert_same(values(model), refs[4])


def test_nothing_complete_fails_clearly(saved, tmp_path):
    model_dir, _ = saved
    for name in ("ckpt-2.index", "ckpt-4.commit"):
        os.remove(model_dir / name)
    assert ckpt_lib.latest_checkpoint_info(model_dir) is None
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer)
    assert manager.restore_or_initialize() is None
    with pytest.raises(ckpt_lib.CheckpointError, match="no committed checkpoint"):
        manager.restore()
    with pytest.raises(ckpt_lib.CheckpointError, match="damaged: ckpt-2.index is missing"):
        manager.restore(str(model_dir / "ckpt-2"))
    with pytest.raises(ckpt_lib.CheckpointError, match="no committed checkpoint"):
        ckpt_lib.load_into(tiny_model(), model_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt_lib.latest_checkpoint_info(empty) is None


def test_overwriting_a_step_drops_its_marker_first(saved, monkeypatch):
    model_dir, _ = saved
    model = tiny_model(seed=3)
    manager = ckpt_lib.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer)

    def crash(*args, **kwargs):
        raise tf.errors.NotFoundError(None, None, "simulated crash while writing")

    monkeypatch.setattr(manager._manager, "save", crash)
    with pytest.raises(ckpt_lib.CheckpointError, match="shared filesystem"):
        manager.save(4)
    assert not (model_dir / "ckpt-4.commit").exists()
    assert ckpt_lib.latest_checkpoint_info(model_dir).step == 2


def test_max_to_keep_removes_files_and_markers(tmp_path):
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path, model=model, optimizer=model.optimizer,
                                         max_to_keep=2)
    for step in (1, 2, 3):
        train(model, 1, offset=step)
        manager.save(step)
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == [2, 3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ckpt-1.")]


@pytest.mark.parametrize("max_to_keep", [1, 2])
def test_failure_before_the_commit_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                 max_to_keep):
    """TF's manager deletes old checkpoints inside `save`: only after our commit."""
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path, model=model, optimizer=model.optimizer,
                                         max_to_keep=max_to_keep)
    for step in range(1, max_to_keep + 1):
        train(model, 1, offset=step)
        manager.save(step)
    expected = values(model)

    def crash(*args, **kwargs):  # The chief dies after the write, before the commit.
        raise ckpt_lib.CheckpointError("simulated crash between the write and the commit")

    monkeypatch.setattr(ckpt_lib, "commit_checkpoint", crash)
    train(model, 1, offset=9)
    with pytest.raises(ckpt_lib.CheckpointError, match="simulated crash"):
        manager.save(max_to_keep + 1)
    monkeypatch.undo()
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == list(
        range(1, max_to_keep + 1))
    assert not (tmp_path / f"ckpt-{max_to_keep + 1}.commit").exists()
    info, restored = restore_new(tmp_path)
    assert info.step == max_to_keep
    assert_same(values(restored), expected)


def test_save_schedule_by_steps_and_seconds(tmp_path):
    now = [0.0]
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path, model=model, optimizer=model.optimizer,
                                         save_every_steps=3, save_every_seconds=60,
                                         clock=lambda: now[0])
    assert [manager.should_save(s) for s in (1, 2, 3)] == [False, False, True]
    manager.save(3)
    assert not manager.should_save(3) and not manager.should_save(5)
    now[0] = 61.0
    assert manager.should_save(4)  # By time.
    first = os.path.getmtime(tmp_path / "ckpt-3.commit")
    assert manager.save(3).step == 3  # Already saved by this manager: not rewritten.
    assert os.path.getmtime(tmp_path / "ckpt-3.commit") == first
    manager.save(3, final=True)
    assert md.read_training_done(str(tmp_path))["step"] == 3


def test_non_chief_never_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
        "task": {"type": "worker", "index": 0}}))
    model = tiny_model()
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path / "m", model=model,
                                              optimizer=model.optimizer)
    train(model, 1)
    assert manager.save(1, final=True) is None
    assert not (tmp_path / "m").exists()



def test_load_into_new_optimizer_table_slots_marked_or_refused(tmp_path):
    # Keras's new optimizers' table slots: a manager made before the
    # optimizer's slots writes them per table in row order with the
    # `slot_order` marker, and `load_into` restores them; a checkpoint
    # without the marker (as before that layout: slots made before the
    # manager) may come from a cluster job that saved a table's slots per
    # shard or in shard order, and is refused with the fix.
    model = tiny_model()
    model.compile(tf.keras.optimizers.Adagrad(0.5), "mse")
    manager = ckpt_lib.ChiefCheckpointManager(tmp_path / "m", model=model,
                                              optimizer=model.optimizer)
    train(model, 2)
    manager.save(2)
    assert slot_order.is_marked(tf.train.load_checkpoint(manager.latest.path)
                                .get_variable_to_shape_map())
    plain = tiny_model(seed=5)
    plain.compile(tf.keras.optimizers.Adagrad(0.5), "mse")
    assert ckpt_lib.load_into(plain, tmp_path / "m", include_optimizer=True).step == 2
    assert len(plain.optimizer.variables) == len(model.optimizer.variables)
    for got, want in zip(plain.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())

    unmarked = tiny_model()
    unmarked.compile(tf.keras.optimizers.Adagrad(0.5), "mse")
    train(unmarked, 2)  # Slots made before the manager: Keras's own listing, no marker.
    ckpt_lib.ChiefCheckpointManager(tmp_path / "u", model=unmarked,
                                    optimizer=unmarked.optimizer).save(2)
    plain = tiny_model(seed=5)
    plain.compile(tf.keras.optimizers.Adagrad(0.5), "mse")
    with pytest.raises(ckpt_lib.CheckpointError, match=r"cannot restore Adagrad's slots.*"
                       r"no slot-order marker.*Fix: include_optimizer=False"):
        ckpt_lib.load_into(plain, tmp_path / "u", include_optimizer=True)
    assert ckpt_lib.load_into(plain, tmp_path / "u").step == 2
    for got, want in zip(plain.trainable_variables, unmarked.trainable_variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_load_into_plain_model_and_save_weights_format(saved, tmp_path):
    model_dir, refs = saved
    model = tiny_model(seed=5)
    assert ckpt_lib.load_into(model, model_dir).step == 4
    for i, w in enumerate(model.trainable_variables):
        np.testing.assert_array_equal(w.numpy(), refs[4][f"w{i}"])
    model = tiny_model(seed=5)
    ckpt_lib.load_into(model, model_dir, include_optimizer=True)
    assert_same(values(model), refs[4])
    # Stock `model.save_weights` checkpoints (ModelCheckpoint(save_weights_only=True)).
    source = tiny_model(seed=9)
    train(source, 2)
    source.save_weights(str(tmp_path / "weights" / "w"))
    target = tiny_model(seed=5)
    ckpt_lib.load_into(target, str(tmp_path / "weights" / "w"))
    for a, b in zip(source.get_weights(), target.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_load_into_other_architecture_fails_clearly(saved):
    model_dir, _ = saved
    ids = tf.keras.Input((2,), dtype=tf.int64)
    other = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.cast(ids, tf.float32)))
    with pytest.raises(ckpt_lib.CheckpointError, match="does not match"):
        ckpt_lib.load_into(other, model_dir)


def test_keras_callback_saves_restores_and_marks_done(tmp_path):
    model = tiny_model()
    callback = checkpoint_callback.ChiefCheckpoint(tmp_path, save_every_steps=2, final_step=8)
    train(model, 5, callbacks=[callback])
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == [2, 4, 5]
    assert md.read_training_done(str(tmp_path)) is None  # 5 < final_step.
    at5 = values(model)
    # A new process: the callback restores step 5 at train begin, ends at 8.
    fresh = tiny_model(seed=4)
    callback = checkpoint_callback.ChiefCheckpoint(tmp_path, save_every_steps=2, final_step=8)
    seen = {}

    class Probe(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.update(values(self.model))

    train(fresh, 3, offset=9, callbacks=[callback, Probe()])
    assert callback.restored.step == 5
    assert_same(seen, at5)
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)][-2:] == [7, 8]
    assert md.read_training_done(str(tmp_path))["step"] == 8
    assert ckpt_lib.latest_checkpoint_info(tmp_path).input_position == 8


def test_keras_callback_saves_every_600_s_by_default(tmp_path):
    now = [0.0]
    model = tiny_model()

    class Clock(tf.keras.callbacks.Callback):  # 250 s per step.
        def on_train_batch_end(self, batch, logs=None):
            now[0] += 250.0

    callback = checkpoint_callback.ChiefCheckpoint(tmp_path, clock=lambda: now[0])
    assert ckpt_lib.DEFAULT_SAVE_EVERY_SECS == 600.0
    train(model, 6, callbacks=[Clock(), callback])
    # 750 s after step 3, 750 s more after step 6 (also the final save).
    assert [i.step for i in ckpt_lib.list_checkpoints(tmp_path)] == [3, 6]
    # 0: only the final checkpoint; steps alone: no time-based saves.
    for kwargs, expected in (({"save_every_seconds": 0}, [6]),
                             ({"save_every_steps": 4}, [4, 6])):
        now[0] = 0.0
        model_dir = tmp_path / str(sorted(kwargs))
        callback = checkpoint_callback.ChiefCheckpoint(model_dir, clock=lambda: now[0], **kwargs)
        train(tiny_model(), 6, callbacks=[Clock(), callback])
        assert [i.step for i in ckpt_lib.list_checkpoints(model_dir)] == expected, kwargs
    with pytest.raises(ValueError, match="save_every_seconds"):
        checkpoint_callback.ChiefCheckpoint(tmp_path, save_every_seconds=-1)
