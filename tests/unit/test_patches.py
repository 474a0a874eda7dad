"""Every process-wide patch goes through `_internal.patches`, installs once and is undone."""

import atexit
import importlib
import sys

import pytest
import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_internal
from tf_psplugin._internal.compat import keras


def _keras(path):
    return tf_internal.keras_private_module(path)


def _safe_lookup_targets():
    # The dispatch targets registered for v1 safe_embedding_lookup_sparse (TF
    # has no public listing by API; this private dict is what it keeps).
    api = tf.compat.v1.nn.safe_embedding_lookup_sparse
    registry = tf_internal.tf_dispatch._TYPE_BASED_DISPATCH_SIGNATURES  # pylint: disable=protected-access
    return frozenset(registry.get(api, {}))


def _stacked_update_targets():
    new = keras.optimizers.Optimizer
    legacy = keras.optimizers.legacy.Optimizer
    builds = tuple(vars(c).get("build") for c in (keras.optimizers.SGD, keras.optimizers.Adam))
    return (vars(new).get("apply_gradients"), vars(new).get("_distributed_apply_gradients_fn"),
            vars(legacy).get("apply_gradients"), vars(legacy).get("_create_all_weights"),
            vars(legacy).get("_distributed_apply"), vars(legacy).get("add_slot")) + builds


# What each patch replaces, read the same way before, during and after.
TARGETS = {
    "exit_on_failover_error": lambda: (sys.excepthook,),
    "keras_progress_bar": lambda: (_keras("engine.training")._get_verbosity,
                                   _keras("callbacks").CallbackList._add_default_callbacks),
    "keras_data_handler": lambda: (_keras("engine.data_adapter").get_data_handler,),
    "keras_dedup_on_ps": lambda: (
        _keras("optimizers.optimizer").Optimizer._deduplicate_sparse_grad,),
    "safe_embedding_lookup_v1": _safe_lookup_targets,
    "keras_functional_fusion": lambda: (
        _keras("engine.functional").Functional._run_internal_graph,
        _keras("engine.node").Node.map_arguments,
        vars(_keras("engine.training").Model).get("__call__")),
    "keras_stacked_updates": _stacked_update_targets,
    "keras_loss_scaling": lambda: _loss_scaling_targets(),
    "retrace_after_split": lambda: (
        vars(tf_internal.polymorphic_function.Function)["__call__"],
        vars(type(tf.function(lambda: 0).get_concrete_function()))["__call__"]),
}


def _loss_scaling_targets():
    module = _keras("mixed_precision.loss_scale_optimizer")
    return (module.strategy_supports_loss_scaling, module._is_all_finite,
            vars(module._DynamicLossScaleState).get("update"),
            vars(module.LossScaleOptimizerV3).get("apply_gradients"),
            vars(module.LossScaleOptimizer).get("apply_gradients"))


@pytest.fixture(autouse=True)
def _restore():
    before = patches.installed()
    for name in before:
        patches.uninstall(name)
    yield
    patches.uninstall_all()
    for name in before:  # What other tests in this process had installed.
        patches.install(name)


def test_every_patch_is_declared_once_and_tested_here():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(TARGETS)
    for patch in patches.PATCHES:
        assert patch.why and patch.replaces and patch.tf_versions
        module, _, function = patch.apply.partition(":")
        assert module.startswith("tf_psplugin."), patch.apply  # Never a TF module by name.
        assert callable(getattr(importlib.import_module(module), function)), patch.apply


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_install_replaces_once_and_uninstall_restores(name):
    original = TARGETS[name]()
    patches.install(name)
    patched = TARGETS[name]()
    assert patched != original, f"{name}: install changed nothing"
    patches.install(name)  # Once per process: a second install wraps nothing.
    assert TARGETS[name]() == patched
    assert name in patches.installed()
    patches.uninstall(name)
    assert TARGETS[name]() == original, f"{name}: uninstall did not restore the originals"
    assert name not in patches.installed()
    patches.install(name)  # And it can be installed again.
    assert TARGETS[name]() != original


def test_exit_hook_undo_also_drops_its_atexit_handler(monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    patches.install("exit_on_failover_error")
    patches.uninstall("exit_on_failover_error")
    assert registered and unregistered == registered


def test_unknown_patch_names_the_known_ones():
    with pytest.raises(KeyError, match="keras_progress_bar"):
        patches.install("no_such_patch")
