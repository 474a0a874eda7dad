"""Unit tests of the evaluator sidecar against checkpoints the tests write themselves.

No cluster and no real waiting: `clock` and `sleep` are injected, and the
injected `sleep` is also where "training" writes its next checkpoint, so a
whole training run plays out between two polls.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import evaluator as ev
from tf_psplugin.state import model_dir as md

VOCAB = 12


def build(compiled=True, seed=0):
    ids = tf.keras.Input((2,), dtype=tf.int64)
    x = tf.keras.layers.Embedding(VOCAB, 2, embeddings_initializer=(
        tf.keras.initializers.RandomUniform(seed=seed)))(ids)
    x = tf.keras.layers.Flatten()(x)
    out = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(
        seed=seed + 1))(x)
    model = tf.keras.Model(ids, out)
    if compiled:
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.5),
                      tf.keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf.keras.metrics.AUC(name="auc", from_logits=True),
                               tf.keras.metrics.BinaryAccuracy(name="acc", threshold=0.0)])
    return model


def dataset():
    ids = np.arange(2 * 32).reshape(32, 2) % VOCAB
    labels = (ids[:, :1] % 2).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(8)


class Training:
    """Writes committed checkpoints like the chief would."""

    def __init__(self, model_dir):
        self.model = build(seed=3)
        self.manager = ckpt_lib.ChiefCheckpointManager(model_dir, model=self.model,
                                                  optimizer=self.model.optimizer)
        self.step = 0

    def advance(self, steps=1, final=False):
        self.model.fit(dataset().repeat(), epochs=1, steps_per_epoch=steps, verbose=0)
        self.step += steps
        return self.manager.save(self.step, final=final)


class FakeTime:
    """Injected clock/sleep: sleeping advances the clock and runs scheduled actions."""

    def __init__(self, actions=()):
        self.now = 0.0
        self.sleeps = []
        self.actions = list(actions)

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds
        if self.actions:
            self.actions.pop(0)()


def run(model_dir, fake, **kwargs):
    kwargs.setdefault("poll_seconds", 1.0)
    kwargs.setdefault("idle_timeout_seconds", 30.0)
    kwargs.setdefault("stale_done_grace_seconds", 3.0)
    return ev.run_evaluator(lambda: build(), dataset, str(model_dir), clock=fake.clock,
                            sleep=fake.sleep, **kwargs)


def lines(model_dir):
    with open(os.path.join(model_dir, "eval", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_evaluates_each_new_checkpoint_and_exits_after_the_final_one(tmp_path):
    training = Training(tmp_path)
    training.advance()
    # Training makes progress between polls; the last action finishes it.
    fake = FakeTime([lambda: None, training.advance, lambda: training.advance(final=True)])
    records = run(tmp_path, fake)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert fake.sleeps == [1.0, 1.0, 1.0]  # Polled, never slept for real.
    written = lines(tmp_path)
    assert [r["step"] for r in written] == [1, 2, 3]
    for record in written:
        assert set(record) == {"step", "loss", "auc", "acc", "checkpoint", "wall_time"}
        assert record["checkpoint"] == str(tmp_path / f"ckpt-{record['step']}")
    # The metrics are those of the checkpoint's weights, evaluated locally.
    local = build(seed=9)
    ckpt_lib.load_into(local, str(tmp_path / "ckpt-3"))
    expected = local.evaluate(dataset(), verbose=0, return_dict=True)
    assert written[-1]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert written[-1]["auc"] == pytest.approx(expected["auc"], rel=1e-6)
    # TensorBoard scalars next to the JSON lines.
    events = [n for n in os.listdir(tmp_path / "eval") if n.startswith("events.out.tfevents")]
    assert events
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "eval" / events[0])):
        tags |= {v.tag for v in event.summary.value}
    assert {"loss", "auc", "acc"} <= tags


def test_newest_only_by_default_and_every_one_on_request(tmp_path):
    training = Training(tmp_path)
    for _ in range(2):
        training.advance()
    training.advance(final=True)
    assert [r["step"] for r in run(tmp_path, FakeTime())] == [3]
    other = tmp_path / "all"
    training = Training(other)
    for _ in range(2):
        training.advance()
    training.advance(final=True)
    assert [r["step"] for r in run(other, FakeTime(), evaluate_all=True)] == [1, 2, 3]


def test_former_secs_names_still_work_with_a_warning_and_clash_with_the_new_ones(tmp_path):
    fake = FakeTime()
    # Two former names, two warnings (pytest.warns re-raises a warning it does not match).
    with pytest.warns(DeprecationWarning, match=r"run_evaluator\(idle_timeout_secs=...\) is "
                      r"deprecated: use idle_timeout_seconds=..."), \
            pytest.warns(DeprecationWarning, match=r"run_evaluator\(poll_interval_secs=...\)"):
        assert ev.run_evaluator(lambda: build(), dataset, str(tmp_path / "nothing"),
                                clock=fake.clock, sleep=fake.sleep, poll_interval_secs=1.0,
                                idle_timeout_secs=4.0) == []
    assert fake.now == 4.0 and len(fake.sleeps) == 4
    with pytest.raises(ValueError, match="are the same option"):
        ev.run_evaluator(lambda: build(), dataset, str(tmp_path / "nothing"),
                         idle_timeout_secs=4.0, idle_timeout_seconds=5.0)


def test_poll_interval_seconds_is_the_former_name_of_poll_seconds(tmp_path):
    """One name for every polling interval (FailoverPolicy, elastic.run, ServingModel.start)."""
    fake = FakeTime()
    with pytest.warns(DeprecationWarning, match=r"run_evaluator\(poll_interval_seconds=...\) is "
                      r"deprecated: use poll_seconds=..."):
        assert ev.run_evaluator(lambda: build(), dataset, str(tmp_path / "nothing"),
                                clock=fake.clock, sleep=fake.sleep, poll_interval_seconds=2.0,
                                idle_timeout_seconds=4.0) == []
    assert fake.sleeps == [2.0, 2.0]
    with pytest.warns(DeprecationWarning, match=r"wait_for_evaluation\(poll_interval_seconds="):
        assert ev.wait_for_evaluation(str(tmp_path), 4, timeout_seconds=3,
                                      poll_interval_seconds=1.5, clock=fake.clock,
                                      sleep=fake.sleep) is None
    assert fake.sleeps[2:] == [1.5, 1.5]
    with pytest.raises(ValueError, match="are the same option"):
        ev.run_evaluator(lambda: build(), dataset, str(tmp_path / "nothing"),
                         poll_interval_seconds=4.0, poll_seconds=6.0)


def test_idle_timeout_when_no_checkpoint_ever_comes(tmp_path):
    fake = FakeTime()
    assert run(tmp_path / "nothing", fake, idle_timeout_seconds=5.0) == []
    assert fake.now == 5.0 and len(fake.sleeps) == 5
    assert not os.path.exists(tmp_path / "nothing" / "eval" / "metrics.jsonl")


def test_skips_partial_and_vanished_checkpoints(tmp_path, monkeypatch):
    training = Training(tmp_path)
    first = training.advance()
    data = [n for n in first.files if ".data-" in n][0]
    path = tmp_path / data
    path.write_bytes(path.read_bytes()[:-4])  # Partial: shorter than committed.
    vanishing = {}

    def then_train():
        vanishing["info"] = training.advance()

    real_load = ckpt_lib.load_into

    def load(model, source, include_optimizer=False):
        if source.endswith("ckpt-2"):
            raise tf.errors.NotFoundError(None, None, "deleted by max_to_keep")
        return real_load(model, source, include_optimizer)

    monkeypatch.setattr(ckpt_lib, "load_into", load)
    fake = FakeTime([then_train, lambda: training.advance(final=True)])
    records = run(tmp_path, fake, evaluate_all=True)
    assert [r["step"] for r in records] == [3]


def test_retries_transient_read_errors_then_gives_up(tmp_path, monkeypatch):
    training = Training(tmp_path)
    training.advance(final=True)
    failures = {"left": 2}
    real_load = ckpt_lib.load_into

    def flaky(model, source, include_optimizer=False):
        if failures["left"]:
            failures["left"] -= 1
            raise tf.errors.DataLossError(None, None, "short read on NFS")
        return real_load(model, source, include_optimizer)

    monkeypatch.setattr(ckpt_lib, "load_into", flaky)
    fake = FakeTime()
    assert [r["step"] for r in run(tmp_path, fake, retry_delay_seconds=0.5)] == [1]
    assert fake.sleeps[:2] == [0.5, 0.5]

    # Always failing: skipped after max_read_retries, then the idle timeout ends it.
    other = tmp_path / "broken"
    Training(other).advance()
    monkeypatch.setattr(ckpt_lib, "load_into", lambda *a, **k: (_ for _ in ()).throw(
        tf.errors.UnavailableError(None, None, "filesystem down")))
    fake = FakeTime()
    assert run(other, fake, max_read_retries=2, retry_delay_seconds=0.5,
               idle_timeout_seconds=3.0) == []
    assert fake.sleeps[:2] == [0.5, 0.5]


def test_restarted_evaluator_does_not_redo_steps(tmp_path):
    training = Training(tmp_path)
    training.advance()
    run(tmp_path, FakeTime(), idle_timeout_seconds=1.0)
    training.advance(final=True)
    assert [r["step"] for r in run(tmp_path, FakeTime())] == [2]
    assert [r["step"] for r in lines(tmp_path)] == [1, 2]


def test_stale_done_marker_waits_for_a_resuming_chief(tmp_path):
    training = Training(tmp_path)
    training.advance(final=True)
    run(tmp_path, FakeTime())  # Evaluates step 1 and exits.

    def resume():  # What ChiefCheckpoint does at train begin, then training.
        md.clear_training_done(str(tmp_path))
        training.advance()

    fake = FakeTime([lambda: None, resume, lambda: training.advance(final=True)])
    assert [r["step"] for r in run(tmp_path, fake, stale_done_grace_seconds=10.0)] == [2, 3]
    # Nobody resumes: the stale marker ends the evaluator after the grace period.
    fake = FakeTime()
    assert run(tmp_path, fake, stale_done_grace_seconds=10.0) == []
    assert fake.now == 10.0
    # Marker already there, final checkpoint not evaluated yet (the evaluator
    # started after training): evaluated, then the same grace.
    other = tmp_path / "finished"
    Training(other).advance(final=True)
    fake = FakeTime()
    assert [r["step"] for r in run(other, fake, stale_done_grace_seconds=10.0)] == [1]
    assert fake.now == 10.0


def test_never_runs_in_a_training_task_or_strategy(tmp_path, monkeypatch):
    with pytest.raises(ev.EvaluatorError, match="not compiled"):
        ev.run_evaluator(lambda: build(compiled=False), dataset, str(tmp_path))
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(ev.EvaluatorError, match="46169"):
            run(tmp_path, FakeTime())
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]},
        "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ev.EvaluatorError, match="is chief:0"):
        run(tmp_path, FakeTime())
    Training(tmp_path / "ok").advance(final=True)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"], "evaluator": ["h:4"]},
        "task": {"type": "evaluator", "index": 0}}))
    assert [r["step"] for r in run(tmp_path / "ok", FakeTime())] == [1]


def test_chief_waits_until_the_evaluator_scored_the_final_step(tmp_path):
    training = Training(tmp_path)
    training.advance(2)
    run(tmp_path, FakeTime(), idle_timeout_seconds=0.0)  # Scores step 2, training not done.
    training.advance(2, final=True)
    evaluated = []
    # The chief polls; the evaluator scores step 4 during the chief's second sleep.
    chief_time = FakeTime([lambda: None, lambda: evaluated.extend(run(tmp_path, FakeTime()))])
    record = ev.wait_for_evaluation(str(tmp_path), 4, timeout_seconds=60, poll_seconds=1.0,
                                    clock=chief_time.clock, sleep=chief_time.sleep)
    assert [r["step"] for r in evaluated] == [4]
    assert record["step"] == 4 and record["auc"] == evaluated[0]["auc"]
    assert chief_time.sleeps == [1.0, 1.0]  # Returned at the first look after the record.


def test_wait_for_evaluation_times_out_and_skips_torn_lines(tmp_path):
    os.makedirs(tmp_path / "eval")
    with open(tmp_path / "eval" / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 3, "loss": 0.5}) + "\n" + '{"step": 9, "lo')  # torn
    fake = FakeTime()
    assert ev.wait_for_evaluation(str(tmp_path), 4, timeout_seconds=5, poll_seconds=2.0,
                                  clock=fake.clock, sleep=fake.sleep) is None
    assert fake.sleeps == [2.0, 2.0, 2.0]  # Looked at t=0, 2, 4, 6 (past 5): gave up.
    assert ev.wait_for_evaluation(str(tmp_path), 3, timeout_seconds=0)["loss"] == 0.5


def test_follows_incremental_checkpoints_through_their_deltas(tmp_path):
    """With full_every, the evaluator scores chain ends too, and exits on a final delta."""
    from tests.unit import test_incremental_unit as inc

    def tiny_compiled():
        model = inc.tiny_model()
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.5), "mse")
        return model

    def tiny_data():
        ids = np.arange(2 * 16).reshape(16, 2) % inc.VOCAB
        return tf.data.Dataset.from_tensor_slices((ids, np.ones([16, 1], "float32"))).batch(8)

    model_dir = str(tmp_path)
    trained = inc.tiny_model()
    # Trained once: its optimizer has its hyperparameter variables, which the
    # deltas then hold (the evaluator's never-trained optimizer has not).
    trained.fit(tiny_data(), epochs=1, steps_per_epoch=1, verbose=0)
    inc.write_full(model_dir, 2, trained)
    table = trained.get_layer("table").embeddings
    rows = np.full([2, inc.DIM], 0.5, np.float32)
    table.scatter_update(tf.IndexedSlices(tf.constant(rows), tf.constant([1, 2], tf.int64)))

    def write_deltas():
        inc.write_delta(model_dir, 4, "ckpt-2", "ckpt-2", model=trained, ids=[1, 2], rows=rows)
        inc.write_delta(model_dir, 6, "ckpt-2", "delta-4", model=trained, ids=[], rows=None)
        md.write_training_done(model_dir, 6, os.path.join(model_dir, "delta-6"))

    fake = FakeTime([write_deltas])
    records = ev.run_evaluator(tiny_compiled, tiny_data, model_dir, evaluate_all=True,
                               poll_seconds=1.0, idle_timeout_seconds=30.0,
                               clock=fake.clock, sleep=fake.sleep)
    # delta-4 was read with its chain (already at delta-6): scored once, at step 6.
    assert [(r["step"], os.path.basename(r["checkpoint"])) for r in records] == [
        (2, "ckpt-2"), (6, "delta-6")]
    reference = tiny_compiled()
    ckpt_lib.load_into(reference, model_dir)
    expected = reference.evaluate(tiny_data(), verbose=0, return_dict=True)
    assert records[-1]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert records[0]["loss"] != pytest.approx(records[-1]["loss"], rel=1e-6)
