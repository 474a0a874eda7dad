"""The public names (issue 45 item 4): `__all__` holds what users call; renamed
names keep working for one release as deprecated aliases of the same object.

`CheckpointManager` and `latest_checkpoint` shadowed `tf.train`'s names with
other contracts (a `CheckpointInfo`, not a path); they are now
`ChiefCheckpointManager` and `latest_checkpoint_info`.
"""

import warnings

import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.state import checkpoint as checkpoint_lib


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
