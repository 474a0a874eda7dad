"""Functions traced before a stack split, called outside the coordinator after it (issue 40).

In one process, with the stand-in tables of test_table_stacking.py: a
user's legacy optimizer outside the known list gets its tables split apart
at its step's first trace (`stacked_fallback.trace_splitting`), which
empties the old storage that functions traced before still read. Called
by hand afterwards (a user's serving function, Keras's `predict`), they
are traced anew before the call (`stacked_fallback.before_call`, the
"retrace_after_split" patch) and return what unstacked tables return; one
whose new trace would run another program is refused, naming why; the
functions Keras keeps on a model are dropped at the split, as `compile`
drops them (`stacked_fallback.drop_stale_keras_functions`).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit.test_table_stacking import (  # noqa: F401
    _batches, _model, _RmsScaledAdagrad, _stacked_updates, _step_of_replaceable_optimizer, _train,
    _train_splitting)
from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin.errors import StackingError
from tf_psplugin.state import export
from tf_psplugin.tables import stack_storage, stacked_fallback, stacking
from tf_psplugin.tables.stacking import TableStacks


def _forward(model):
    @tf.function
    def forward(x):
        return model(x)

    return forward


def _stale(function) -> bool:
    return any(stack_storage.retired_because(c) for c in tf_objects.traces_of_function(function))


def test_a_user_function_and_predict_traced_before_the_split_work_after_it():
    """A forward tf.function and `predict`, traced before the split, match unstacked after it."""
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    stacking.separate_by_model(stacked)  # As its first traced call would: the model is seen.
    assert any(m is stacked for m in stacking.models_seen())
    x, _ = _batches(1, seed=9)[0]
    forwards = {"stacked": _forward(stacked), "plain": _forward(plain)}
    for model in (stacked, plain):
        model.compile(loss="mse")
    before = forwards["stacked"](x).numpy()
    np.testing.assert_array_equal(stacked.predict(x, verbose=0), before)
    optimizers = {"stacked": _RmsScaledAdagrad(0.3), "plain": _RmsScaledAdagrad(0.3)}
    _train_splitting(stacked, optimizers["stacked"], _batches(2), stacks)
    _train(plain, optimizers["plain"], _batches(2))
    assert _stale(forwards["stacked"])
    assert stacked.predict_function is None  # Dropped at the split, as compile does.
    assert "retrace_after_split" in patches.installed()
    expected = forwards["plain"](x).numpy()
    assert not np.array_equal(expected, before)  # The step between trained the tables.
    np.testing.assert_array_equal(forwards["stacked"](x).numpy(), expected)
    np.testing.assert_array_equal(stacked.predict(x, verbose=0),
                                  plain.predict(x, verbose=0))
    assert not _stale(forwards["stacked"])  # Traced anew.


def test_a_function_whose_new_trace_would_run_another_program_is_refused_when_called():
    """Called by hand after the split, a step whose optimizer was replaced since is refused.

    Traced anew it would apply the new optimizer, not the one its old trace
    applies (as an unstacked run does): refused, naming why, on every call,
    and nothing trains.
    """
    stacks = TableStacks(lambda s: None)
    stacked = _model(stacks)
    step, holder = _step_of_replaceable_optimizer(stacked)

    x, y = _batches(1, seed=3)[0]
    step(x, y)
    holder["optimizer"] = tf.keras.optimizers.legacy.SGD(0.2)  # As a compile with another.
    _train_splitting(stacked, _RmsScaledAdagrad(0.3), _batches(2), stacks)
    before = [w.copy() for w in export.logical_weights(stacked)]
    for _ in range(2):
        with pytest.raises(StackingError, match=r"'step' cannot run: it was traced before "
                                                r"tables .* were split apart.*traced again, it "
                                                r"no longer reads.*Fix: trace it again"):
            step(x, y)
    for a, b in zip(export.logical_weights(stacked), before):
        np.testing.assert_array_equal(a, b)


def test_a_concrete_function_traced_before_the_split_is_refused_naming_why():
    """A `ConcreteFunction` cannot be traced again: called by hand, a `StackingError` says why
    and how to fix it, instead of TF's error about a row out of ``[0, 0)``."""
    stacks = TableStacks(lambda s: None)
    stacked = _model(stacks)
    x, _ = _batches(1, seed=6)[0]
    concrete = _forward(stacked).get_concrete_function(x)
    concrete(x)
    _train_splitting(stacked, _RmsScaledAdagrad(0.3), _batches(1), stacks)
    with pytest.raises(StackingError, match=r"cannot run: it was traced before tables .* were "
                                            r"split apart.*Fix: trace it again"):
        concrete(x)
    np.testing.assert_array_equal(_forward(stacked)(x).numpy(), stacked(x).numpy())


def test_keras_functions_reading_old_storage_are_dropped_unless_being_traced():
    """`drop_stale_keras_functions`: a stale function (or Keras's lambda scheduling one) is set
    back to None, one being traced now (`keep`) is left, one that reads live storage is left.
    """
    stacks = TableStacks(lambda s: None)
    stacked = _model(stacks)
    stacking.separate_by_model(stacked)
    stale = _train(stacked, tf.keras.optimizers.legacy.SGD(0.1), _batches(1))
    _train_splitting(stacked, _RmsScaledAdagrad(0.3), _batches(1), stacks)
    fresh = _forward(stacked)
    x, _ = _batches(1, seed=5)[0]
    fresh(x)  # Traced on the new stacks.
    assert _stale(stale) and not _stale(fresh)
    stacked.train_function = lambda it: stale(*it)  # As Keras's schedule lambda.
    stacked.test_function = stale
    stacked.predict_function = fresh
    assert stacked_fallback.drop_stale_keras_functions(keep=[stale]) == []
    assert stacked.train_function is not None and stacked.test_function is stale
    dropped = stacked_fallback.drop_stale_keras_functions()
    assert sorted(n for _, n in dropped) == ["test_function", "train_function"]
    assert stacked.train_function is None and stacked.test_function is None
    assert stacked.predict_function is fresh
