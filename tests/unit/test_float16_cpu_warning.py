"""mixed_float16 on workers without a GPU: one clear warning, no refusal (issue 42); a float16
dense all-reduce under loss scaling: refused (issue 44)."""

import pytest
import tensorflow as tf

from tf_psplugin._internal import tf_internal
from tf_psplugin.errors import StrategyError
from tf_psplugin.sync import loss_scaling

_CPU_ONLY = [
    tf.config.LogicalDevice("/job:chief/replica:0/task:0/device:CPU:0", "CPU"),
    tf.config.LogicalDevice("/job:worker/replica:0/task:0/device:CPU:0", "CPU"),
    tf.config.LogicalDevice("/job:worker/replica:0/task:1/device:CPU:0", "CPU"),
    tf.config.LogicalDevice("/job:ps/replica:0/task:0/device:CPU:0", "CPU"),
]
_WITH_GPU = _CPU_ONLY + [
    tf.config.LogicalDevice("/job:worker/replica:0/task:1/device:GPU:0", "GPU")]


@pytest.fixture
def warnings_logged(monkeypatch):
    monkeypatch.setattr(loss_scaling, "_FLOAT16_CPU_WARNED", [])
    logged = []
    monkeypatch.setattr(loss_scaling.logging, "warning", lambda msg, *a: logged.append(msg % a))
    return logged


def test_cpu_only_workers_get_the_warning_naming_the_fix():
    message = loss_scaling.float16_on_cpu_warning(_CPU_ONLY)
    assert "mixed_float16" in message and "emulated" in message
    assert "50x slower" in message and "mixed_bfloat16" in message


def test_no_warning_with_a_worker_gpu_or_no_cluster():
    assert loss_scaling.float16_on_cpu_warning(_WITH_GPU) is None
    assert loss_scaling.float16_on_cpu_warning(_CPU_ONLY[:1]) is None  # Not connected.


def test_warned_once_per_process(warnings_logged):
    assert loss_scaling.warn_float16_on_cpu_once(_CPU_ONLY)
    assert not loss_scaling.warn_float16_on_cpu_once(_CPU_ONLY)
    assert warnings_logged == [loss_scaling.FLOAT16_ON_CPU_WARNING]


def test_keras_loss_scale_optimizer_under_the_strategy_warns_and_is_allowed(
        monkeypatch, warnings_logged):
    # What Keras's compile does under mixed_float16: make a LossScaleOptimizer,
    # whose constructor asks `strategy_supports_loss_scaling`.
    module = tf_internal.keras_private_module("mixed_precision.loss_scale_optimizer")
    monkeypatch.setattr(loss_scaling, "_strategy_agrees", lambda: True)
    monkeypatch.setattr(loss_scaling.tf.config, "list_logical_devices", lambda *a: _CPU_ONLY)
    undo = loss_scaling.patch_keras_loss_scaling()
    try:
        assert module.strategy_supports_loss_scaling() is True
        assert module.strategy_supports_loss_scaling() is True
    finally:
        undo()
    assert warnings_logged == [loss_scaling.FLOAT16_ON_CPU_WARNING]


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_loss_scaling_is_allowed_with_a_bfloat16_or_no_compressed_all_reduce(
        monkeypatch, warnings_logged, wire):
    module = tf_internal.keras_private_module("mixed_precision.loss_scale_optimizer")
    monkeypatch.setattr(loss_scaling, "_strategy_agrees", lambda: True)
    monkeypatch.setattr(loss_scaling, "_strategy_dense_allreduce_dtype", lambda: wire)
    monkeypatch.setattr(loss_scaling.tf.config, "list_logical_devices", lambda *a: _CPU_ONLY)
    undo = loss_scaling.patch_keras_loss_scaling()
    try:
        assert module.strategy_supports_loss_scaling() is True
    finally:
        undo()


def test_loss_scaling_refuses_a_float16_all_reduce_naming_the_fix(monkeypatch, warnings_logged):
    # HybridOptions(dense_allreduce_dtype="float16"): the sum of scaled
    # gradients could overflow after every worker found its own finite.
    module = tf_internal.keras_private_module("mixed_precision.loss_scale_optimizer")
    monkeypatch.setattr(loss_scaling, "_strategy_agrees", lambda: True)
    monkeypatch.setattr(loss_scaling, "_strategy_dense_allreduce_dtype", lambda: "float16")
    undo = loss_scaling.patch_keras_loss_scaling()
    try:
        with pytest.raises(StrategyError, match=r"dense_allreduce_dtype='float16'.*Fix: "
                                                r"dense_allreduce_dtype='bfloat16'"):
            module.strategy_supports_loss_scaling()
    finally:
        undo()
