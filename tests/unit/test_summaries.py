"""TrainingSummaries: training curves under <model_dir>/train (single process).

Under a strategy the same callback gets RemoteValues (fetched); that path is
covered by tests/cluster/test_ctr_example.py through keras_examples/ctr.py.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psplugin


def _events(directory):
    """{tag: [(step, value)]} from every event file under `directory`."""
    from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top

    acc = event_accumulator.EventAccumulator(directory, size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def _fit(model_dir, steps, spe=1, every=2, epochs=1, model=None):
    tf.keras.utils.set_random_seed(1)
    if model is None:
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"], steps_per_execution=spe)
    x, y = np.random.rand(64, 3).astype("float32"), np.random.rand(64, 1).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    model.fit(ds, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[
        tf_psplugin.TrainingSummaries(model_dir, write_every_steps=every, examples_per_step=4)])
    return model


def test_loss_metrics_and_throughput_every_write_every_steps(tmp_path):
    _fit(str(tmp_path), steps=6, every=2)
    events = _events(str(tmp_path / "train"))
    assert {"loss", "mae", "steps_per_sec", "examples_per_sec"} <= set(events), events.keys()
    assert [step for step, _ in events["loss"]] == [2, 4, 6]
    assert all(np.isfinite(v) and v > 0 for _, v in events["loss"])
    rates = dict(events["steps_per_sec"])
    assert dict(events["examples_per_sec"]) == pytest.approx({s: 4 * r for s, r in rates.items()})


def test_steps_continue_across_epochs_resumes_and_steps_per_execution(tmp_path):
    model = _fit(str(tmp_path), steps=4, spe=2, every=4, epochs=2)
    _fit(str(tmp_path), steps=4, spe=2, every=4, model=model)  # Resumed: step 8 onwards.
    steps = [step for step, _ in _events(str(tmp_path / "train"))["loss"]]
    assert steps == [4, 8, 12]


def test_write_every_steps_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="write_every_steps=0 must be >= 1. Fix:"):
        tf_psplugin.TrainingSummaries(str(tmp_path), write_every_steps=0)


def test_every_n_steps_is_the_former_name_of_write_every_steps(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"TrainingSummaries\(every_n_steps=...\) is "
                                                r"deprecated: use write_every_steps="):
        callback = tf_psplugin.TrainingSummaries(str(tmp_path), every_n_steps=7)
    assert callback.write_every_steps == 7
    with pytest.warns(DeprecationWarning, match="read write_every_steps"):
        assert callback.every_n_steps == 7
    with pytest.raises(ValueError, match="are the same option"):
        tf_psplugin.TrainingSummaries(str(tmp_path), every_n_steps=7, write_every_steps=8)


def test_only_the_chief_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"chief": ["h:1"], "worker": ["h:2"], '
                                    '"ps": ["h:3"]}, "task": {"type": "worker", "index": 0}}')
    _fit(str(tmp_path), steps=4, every=2)
    assert not os.path.exists(tmp_path / "train")
