"""The public names (issue 45 item 4): `__all__` holds what users call; renamed
names keep working for one release as deprecated aliases of the same object.

`CheckpointManager` and `latest_checkpoint` shadowed `tf.train`'s names with
other contracts (a `CheckpointInfo`, not a path); they are now
`ChiefCheckpointManager` and `latest_checkpoint_info`; `full_every`, which
counts saves, is `full_every_saves`. Every deprecation warns with
`PluginDeprecationWarning`, which this suite turns into an error.
"""

import ast
import warnings

import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin._internal import deprecation as deprecation_lib
from tf_psplugin.state import checkpoint as checkpoint_lib
from tests.unit import package_source


def _tiny_model():
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    return model


def test_all_holds_what_users_call_and_not_the_internal_types():
    public = set(tf_psplugin.__all__)
    assert {"ChiefCheckpointManager", "latest_checkpoint_info", "HybridOptions",
            "build_optimizer_slots", "current_worker_index"} <= public
    for internal_or_former in ("HybridClusterCoordinator", "ReplicatedVariable",
                               "CheckpointManager", "latest_checkpoint"):
        assert internal_or_former not in public, internal_or_former
        # Still importable, for programs that use them.
        assert getattr(tf_psplugin, internal_or_former) is not None
    assert all(hasattr(tf_psplugin, name) for name in tf_psplugin.__all__)


def test_no_public_name_shadows_a_tf_train_name():
    assert not set(tf_psplugin.__all__) & set(dir(tf.train))


def test_latest_checkpoint_is_the_deprecated_name_of_latest_checkpoint_info(tmp_path):
    model = _tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # The new names do not warn.
        manager = tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model,
                                                     optimizer=model.optimizer)
        assert tf_psplugin.latest_checkpoint_info(str(tmp_path)) is None
        saved = manager.save(3)
        info = tf_psplugin.latest_checkpoint_info(str(tmp_path))
    assert info.step == 3 and info.path == saved.path
    with pytest.warns(DeprecationWarning, match=r"latest_checkpoint is deprecated: use "
                                                r"tf_psplugin.latest_checkpoint_info"):
        former = tf_psplugin.latest_checkpoint(str(tmp_path))
    assert former == info


def test_checkpoint_manager_is_the_deprecated_name_of_chief_checkpoint_manager(tmp_path):
    model = _tiny_model()
    with pytest.warns(DeprecationWarning, match=r"CheckpointManager is deprecated: use "
                                                r"tf_psplugin.ChiefCheckpointManager"):
        manager = tf_psplugin.CheckpointManager(str(tmp_path), model=model,
                                                optimizer=model.optimizer, save_every_steps=2)
    assert isinstance(manager, tf_psplugin.ChiefCheckpointManager)
    assert manager.should_save(2) and not manager.should_save(1)
    assert manager.save(2).step == 2
    assert checkpoint_lib.latest_checkpoint_info(str(tmp_path)).step == 2


# -- full_every -> full_every_saves (issue 45 item 4: every name says its unit) ------------


def test_full_every_is_the_deprecated_name_of_full_every_saves(tmp_path):
    model = _tiny_model()
    plain = r"need HybridParameterServerStrategy.*Fix: drop full_every_saves\."
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # The new name does not warn.
        # It takes effect: incremental checkpoints refuse a model outside the strategy.
        with pytest.raises(checkpoint_lib.CheckpointError, match=plain):
            tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model,
                                               optimizer=model.optimizer, full_every_saves=3)
        with pytest.raises(ValueError, match=r"full_every_saves must be > 0 or None, got 0"):
            tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model, full_every_saves=0)
    former = r"ChiefCheckpointManager\(full_every=\.\.\.\) is deprecated: use full_every_saves="
    with pytest.warns(deprecation_lib.PluginDeprecationWarning, match=former), \
            pytest.raises(checkpoint_lib.CheckpointError, match=plain):
        tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model,
                                           optimizer=model.optimizer, full_every=3)
    with pytest.warns(DeprecationWarning, match=former):
        manager = tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model,
                                                     optimizer=model.optimizer, full_every=1)
    assert manager.save(1).kind == "full"
    # Both names: one value is redundant (it warns), two are an error naming the fix.
    with pytest.warns(DeprecationWarning, match=former):
        tf_psplugin.ChiefCheckpointManager(str(tmp_path / "same"), model=model,
                                           full_every=1, full_every_saves=1)
    with pytest.raises(ValueError, match=r"ChiefCheckpointManager: full_every=3 and "
                                         r"full_every_saves=2 are the same option .*"
                                         r"Fix: pass only full_every_saves="):
        tf_psplugin.ChiefCheckpointManager(str(tmp_path), model=model, full_every=3,
                                           full_every_saves=2)


def test_chief_checkpoint_takes_full_every_saves_and_its_former_name(tmp_path):
    def fit(callback):
        model = _tiny_model()
        model.fit(tf.zeros([4, 2]), tf.zeros([4, 1]), batch_size=2, epochs=1, verbose=0,
                  callbacks=[callback])

    plain = r"need HybridParameterServerStrategy.*Fix: drop full_every_saves\."
    with warnings.catch_warnings():
        warnings.simplefilter("error", deprecation_lib.PluginDeprecationWarning)
        callback = tf_psplugin.ChiefCheckpoint(str(tmp_path / "new"), save_every_steps=1,
                                               full_every_saves=2)
    with pytest.raises(checkpoint_lib.CheckpointError, match=plain):
        fit(callback)  # The manager, made at train begin, got it.
    with pytest.warns(deprecation_lib.PluginDeprecationWarning,
                      match=r"ChiefCheckpoint\(full_every=\.\.\.\) is deprecated: use "
                            r"full_every_saves="):
        callback = tf_psplugin.ChiefCheckpoint(str(tmp_path / "old"), save_every_steps=1,
                                               full_every=2)
    with pytest.raises(checkpoint_lib.CheckpointError, match=plain):
        fit(callback)
    with pytest.raises(ValueError, match=r"Fix: pass only full_every_saves="):
        tf_psplugin.ChiefCheckpoint(str(tmp_path), full_every=2, full_every_saves=3)


# -- every deprecation warns with PluginDeprecationWarning, an error in this suite ---------


def test_plugin_deprecations_are_errors_in_this_suite_and_others_are_not(tmp_path):
    """tests/conftest.py makes tf_psplugin's own deprecations errors (so the suite uses no
    deprecated spelling); TensorFlow's and Keras's DeprecationWarnings are not."""
    assert issubclass(deprecation_lib.PluginDeprecationWarning, DeprecationWarning)
    with pytest.raises(deprecation_lib.PluginDeprecationWarning, match="latest_checkpoint_info"):
        tf_psplugin.latest_checkpoint(str(tmp_path))
    with pytest.raises(deprecation_lib.PluginDeprecationWarning, match="experimental_fuse"):
        tf_psplugin.HybridOptions(fuse_lookups=True)
    warnings.warn("a DeprecationWarning of another library", DeprecationWarning)


def test_every_deprecation_in_the_package_warns_with_plugin_deprecation_warning():
    """A bare DeprecationWarning from the package would escape the suite's error filter."""
    bare = []
    for rel, tree in package_source.trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                category = (node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None))
                name = ast.unparse(category) if category is not None else "UserWarning"
                if name.split(".")[-1] in ("DeprecationWarning", "PendingDeprecationWarning",
                                           "FutureWarning"):
                    bare.append(f"{rel}:{node.lineno}")
    assert bare == [], f"warn with deprecation.warn or PluginDeprecationWarning: {bare}"
