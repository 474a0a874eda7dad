"""ProgressBar (throttled fetches, line mode, examples/s) and the strategy's Keras hooks."""

import importlib
import io
import re

import pytest

from tf_psplugin._internal import patches
from tf_psplugin._internal.compat import KERAS_PACKAGE, keras
from tf_psplugin.keras import progress


class FakeRemote:
    """A RemoteValue stand-in that counts fetches."""

    fetches = 0

    def __init__(self, value):
        self.value = value

    def fetch(self):
        FakeRemote.fetches += 1
        return self.value


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    FakeRemote.fetches = 0
    return c


def make_bar(verbose=1, steps=100, dynamic=False, **kwargs):
    out = io.StringIO()
    bar = progress.ProgressBar(stream=out, dynamic=dynamic, **kwargs)
    bar.set_params({"verbose": verbose, "epochs": 1, "steps": steps})
    return bar, out


def logs(loss, auc):
    return {"loss": FakeRemote(loss), "auc": FakeRemote(auc)}


def test_line_mode_fetches_once_per_interval_and_prints_rate_eta_and_metrics(clock):
    bar, out = make_bar(line_every_seconds=10, examples_per_step=512)
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for step in range(100):
        clock.now += 0.5  # 2 steps/s.
        bar.on_train_batch_end(step, logs(0.5 - step / 1000, 0.6 + step / 1000))
    # 50 s of steps, one line per 10 s, 2 fetches (loss, auc) per line; the last
    # step's line is left to the epoch end.
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert FakeRemote.fetches == 2 * len(lines)
    first = lines[0]
    # 20 steps at 10 s; rate measured from the first step: 19 steps in 9.5 s = 2/s.
    assert re.match(r"^ 20/100 \[=====>\.+\] - ETA: 40s - 1,024 examples/s - "
                    r"loss: 0\.4810 - auc: 0\.6190$", first), first
    bar.on_epoch_end(0, {"loss": 0.4, "auc": 0.7})
    final = out.getvalue().splitlines()[-1]
    assert re.match(r"^100/100 \[=+\] - 50s 500ms/step - 1,024 examples/s - "
                    r"loss: 0\.4000 - auc: 0\.7000$", final), final


def test_terminal_mode_redraws_one_line_and_ends_it(clock):
    bar, out = make_bar(steps=4, dynamic=True, refresh_seconds=1.0)
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for step in range(4):
        clock.now += 2.0
        bar.on_train_batch_end(step, logs(1.0, 0.5))
    bar.on_epoch_end(0, {"loss": 1.0})
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1, repr(text)
    assert "steps/s" in text  # No examples_per_step and no coordinator: steps/s only.


def test_an_unknown_length_shows_no_total_until_the_first_epoch_ends(clock):
    """fit on input of unknown length: steps only in epoch 1, the counted total after it."""
    bar, out = make_bar(steps=None, line_every_seconds=1.0)
    bar.set_params({"verbose": 1, "epochs": 2, "steps": None})
    bar.on_train_begin()
    for epoch in range(2):
        bar.on_epoch_begin(epoch)
        for step in range(3):
            clock.now += 2.0
            bar.on_train_batch_end(step, logs(1.0, 0.5))
        bar.on_epoch_end(epoch, {"loss": 0.5})
    first, second = out.getvalue().split("Epoch 2/2\n")
    first = first.splitlines()[1:]  # After "Epoch 1/2".
    assert [line.split(" - ")[0] for line in first] == ["1 steps", "2 steps", "3 steps",
                                                        "3/3 [==============================]"]
    assert all("ETA" not in line for line in first)
    # Keras's rule: a length found by the first epoch is the total of later ones.
    assert [line.split(" [")[0] for line in second.splitlines()] == ["1/3", "2/3", "3/3"]
    assert "ETA" in second.splitlines()[0]


def test_verbose_2_prints_only_the_epoch_line_and_never_fetches_per_step(clock):
    bar, out = make_bar(verbose=2, steps=50)
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for step in range(50):
        clock.now += 1.0
        bar.on_train_batch_end(step, logs(1.0, 0.5))
    assert out.getvalue() == "" and FakeRemote.fetches == 0
    bar.on_epoch_end(0, {"loss": 0.25})
    assert re.match(r"^50/50 \[=+\] - 50s 1000ms/step - 1\.0 steps/s - loss: 0\.2500\n$",
                    out.getvalue()), out.getvalue()


def test_one_remote_value_holding_the_whole_dict_is_fetched_once(clock):
    bar, out = make_bar(steps=10, line_every_seconds=1)
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    clock.now += 5
    bar.on_train_batch_end(4, FakeRemote({"loss": 0.125}))
    assert FakeRemote.fetches == 1 and "loss: 0.1250" in out.getvalue()


def test_examples_per_step_comes_from_the_models_coordinator(clock):
    class Coordinator:
        examples_per_step = 2048

    class Model:
        _cluster_coordinator = Coordinator()
        metrics = []

    bar, out = make_bar(steps=10, line_every_seconds=1)
    bar.set_model(Model())
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    clock.now += 1
    bar.on_train_batch_end(0, {})
    clock.now += 1
    bar.on_train_batch_end(1, {})
    assert "2,048 examples/s" in out.getvalue().splitlines()[-1]


def test_invalid_intervals_are_rejected():
    with pytest.raises(ValueError, match="refresh_seconds"):
        progress.ProgressBar(refresh_seconds=0)


class MarkedStrategy:
    _should_use_with_coordinator = True
    _tf_psplugin_progress = True


class StockPSSLike:
    _should_use_with_coordinator = True


def test_keras_hooks_accept_verbose_1_only_for_the_plugins_strategy(monkeypatch):
    training = importlib.import_module(f"{KERAS_PACKAGE}.src.engine.training")
    patches.install("keras_progress_bar")
    patches.install("keras_progress_bar")  # Idempotent: one wrapper, not two.
    assert training._get_verbosity(1, MarkedStrategy()) == 1
    assert training._get_verbosity("auto", MarkedStrategy()) == 1
    assert training._get_verbosity(0, MarkedStrategy()) == 0
    assert training._get_verbosity(2, MarkedStrategy()) == 2
    with pytest.raises(ValueError, match="verbose=1"):  # Keras's own rule, unchanged.
        training._get_verbosity(1, StockPSSLike())
    assert training._get_verbosity("auto", StockPSSLike()) == 2


def test_keras_hooks_swap_only_the_default_progbar_under_the_plugins_strategy(monkeypatch):
    callbacks = importlib.import_module(f"{KERAS_PACKAGE}.src.callbacks")
    patches.install("keras_progress_bar")
    model = keras.Sequential([keras.layers.Dense(1)])
    monkeypatch.setattr(progress.tf.distribute, "get_strategy", lambda: MarkedStrategy())
    default = callbacks.CallbackList(None, add_progbar=True, model=model, verbose=1, epochs=1,
                                     steps=10)
    assert [type(cb) for cb in default.callbacks] == [progress.ProgressBar]
    mine = keras.callbacks.ProgbarLogger(count_mode="steps")
    kept = callbacks.CallbackList([mine], add_progbar=True, model=model, verbose=1, epochs=1,
                                     steps=10)
    assert kept.callbacks == [mine]  # A logger the user passed is the user's choice.
    monkeypatch.setattr(progress.tf.distribute, "get_strategy", lambda: StockPSSLike())
    other = callbacks.CallbackList(None, add_progbar=True, model=model, verbose=1, epochs=1,
                                     steps=10)
    assert [type(cb) for cb in other.callbacks] == [keras.callbacks.ProgbarLogger]
