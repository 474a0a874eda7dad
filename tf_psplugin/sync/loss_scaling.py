"""Keras's dynamic loss scaling (`mixed_float16`), agreed among the workers.

Why this module exists: Keras's `LossScaleOptimizer` applies a step's
gradients only if every gradient is finite, and moves the loss scale by
that same check. Keras allows it only under strategies on its list, where
the check is made on all-reduced gradients, so every replica sees the same
answer. Under `HybridParameterServerStrategy` the dense gradients are
all-reduced, but a table's gradient is summed on its PS (the worker that
updates the shard holds the global gradient there, the others only their
own part), so Keras's check would differ between workers, and computing it
on the global gradient would copy that gradient back to a worker.

So, while a `LossScaleOptimizer` applies gradients in a synchronous step
(`agreeing()`), the reduction counts this worker's non-finite gradient
values, dense and table ones, and sums the count in the step's dense
all-reduce (`local_nonfinite_count`, `record_agreed`): every worker gets
the same "all finite" answer, and Keras's check returns it
(`patch_keras_loss_scaling`). Every worker then takes the same branch of
Keras's `tf.cond`: all updates (dense and table) or none, and the same loss
scale. Table gradients are unscaled where Keras unscales every gradient,
on each worker before the reduction, so they reach the PS unscaled; a
skipped step still takes its gradients out of the PS queues (the take runs
before the `tf.cond`), so nothing is left behind.

The count is made on each worker's own gradients, before the all-reduce.
A float16 all-reduce of the scaled dense gradients
(`HybridOptions(dense_allreduce_dtype="float16")`) can overflow in the sum
itself, after every worker found its gradients finite, and the step would
apply inf: that combination is refused when Keras makes the
`LossScaleOptimizer` (`check_dense_allreduce_dtype`). bfloat16 has
float32's range: a sum that overflows it overflows float32 too.
"""

import contextlib
import weakref
from typing import Callable, Optional, Sequence

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin._internal import keras_members
from tf_psplugin.errors import StrategyError
from tf_psplugin.sync import replicated

# Graphs in which a LossScaleOptimizer is applying gradients -> depth. Keyed
# by graph, not thread: a strategy runs the replica function and its
# merge_call (where gradients are reduced) in different threads.
_AGREEING = weakref.WeakKeyDictionary()

# Graph -> its agreed "every gradient of every worker is finite" (bool tensor).
_AGREED = weakref.WeakKeyDictionary()


def agreeing() -> bool:
    """Whether a LossScaleOptimizer is applying gradients in this graph (count non-finites)."""
    return not tf.executing_eagerly() and _AGREEING.get(tf.compat.v1.get_default_graph(), 0) > 0


@contextlib.contextmanager
def _agreeing_scope():
    graph = tf.compat.v1.get_default_graph()
    _AGREEING[graph] = _AGREEING.get(graph, 0) + 1
    try:
        yield
    finally:
        _AGREEING[graph] -= 1


def local_nonfinite_count(gradients: Sequence) -> tf.Tensor:
    """This worker's count of non-finite gradient values (float32 scalar).

    Args:
        gradients: Tensors or `tf.IndexedSlices` (their values); None skipped.
            Computed where each gradient is (a table gradient's values on
            this worker, before they are handed in).
    """
    counts = [tf.constant(0.0)]
    for g in gradients:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        counts.append(tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(values)),
                                            tf.float32)))
    return tf.add_n(counts)


def record_agreed(total_nonfinite: tf.Tensor) -> None:
    """Records the all-reduced count for the graph being traced (read by Keras's check)."""
    _AGREED[tf.compat.v1.get_default_graph()] = tf.equal(total_nonfinite, 0.0)


def _agreed_for_current_graph() -> Optional[tf.Tensor]:
    graph = tf.compat.v1.get_default_graph()
    agreed = _AGREED.get(graph)
    if agreed is not None:
        return agreed
    # Keras may ask in a graph nested in the one that reduced (a branch).
    outer = getattr(graph, "outer_graph", None)
    while outer is not None:
        agreed = _AGREED.get(outer)
        if agreed is not None:
            return graph.capture(agreed)
        outer = getattr(outer, "outer_graph", None)
    return None


def _strategy_agrees() -> bool:
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return bool(getattr(getattr(strategy, "extended", None), "agrees_loss_scaling", False))


def _strategy_dense_allreduce_dtype() -> Optional[str]:
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return getattr(getattr(strategy, "extended", None), "dense_allreduce_dtype", None)


def check_dense_allreduce_dtype(dense_allreduce_dtype: Optional[str]) -> None:
    """Refuses a float16 dense all-reduce under Keras's loss scaling.

    Args:
        dense_allreduce_dtype: The strategy's `HybridOptions.dense_allreduce_dtype`.

    Raises:
        StrategyError: it is ``"float16"``: a sum of scaled gradients above
            65504 is inf on every worker, while each worker counted its own
            gradients finite, so the step would apply it (see the module
            docstring).
    """
    if dense_allreduce_dtype == "float16":
        raise StrategyError(
            "mixed_float16's loss scaling with HybridOptions(dense_allreduce_dtype='float16'): "
            "the sum of the scaled dense gradients can overflow float16 in the all-reduce "
            "after every worker found its own gradients finite, and the step would apply inf. "
            "Fix: dense_allreduce_dtype='bfloat16' (float32's range), or None.")


_FLOAT16_CPU_WARNED = []  # Non-empty once the warning below was logged in this process.

FLOAT16_ON_CPU_WARNING = (
    "tf_psplugin: mixed_float16 with workers that have no GPU: float16 matmuls on a CPU are "
    "emulated and about 50x slower than float32 (measured: 0.02x float32's examples per "
    "CPU-second on the benchmark model; see docs/mixed_precision.md). Training is correct, "
    "only slow. Fix: on CPUs use tf.keras.mixed_precision.set_global_policy("
    "\"mixed_bfloat16\") (no loss scaling needed), or float32.")


def float16_on_cpu_warning(devices) -> Optional[str]:
    """The warning for `mixed_float16` when the cluster's workers have no GPU, or None.

    Args:
        devices: The cluster's logical devices (`tf.config.list_logical_devices()`
            on the chief once connected: every task's devices). No worker
            device at all (not connected) gives None.
    """
    workers = [d for d in devices if "/job:worker/" in d.name]
    if not workers or any(d.device_type == "GPU" for d in workers):
        return None
    return FLOAT16_ON_CPU_WARNING


def warn_float16_on_cpu_once(devices=None) -> bool:
    """Logs `FLOAT16_ON_CPU_WARNING` once per process if no worker has a GPU.

    Called when Keras makes a `LossScaleOptimizer` under this strategy (what
    `compile` does under `mixed_float16`). A warning, not a refusal: the
    training is correct, only slow.

    Returns:
        Whether it logged the warning now.
    """
    if _FLOAT16_CPU_WARNED:
        return False
    message = float16_on_cpu_warning(
        tf.config.list_logical_devices() if devices is None else devices)
    if message is None:
        return False
    _FLOAT16_CPU_WARNED.append(True)
    logging.warning(message)
    return True


def patch_keras_loss_scaling() -> Callable[[], None]:
    """Lets Keras's loss scaling run under this strategy, its check agreed by all workers.

    Applied through `tf_psplugin._internal.patches` ("keras_loss_scaling");
    returns the undo. Checked on Keras 2.15 and tf-keras 2.21. Replaces, in
    Keras's `mixed_precision.loss_scale_optimizer` module (no public hook):

    * `strategy_supports_loss_scaling`: also True under a strategy whose
      Extended says `agrees_loss_scaling` (the synchronous modes); Keras's
      `mixed_float16` policy and `LossScaleOptimizer` ask it. There it also
      warns once if no worker has a GPU (`warn_float16_on_cpu_once`), and
      refuses a float16 dense all-reduce (`check_dense_allreduce_dtype`).
    * `_is_all_finite`: in a step whose reduction recorded the agreed
      answer (`record_agreed`), returns it; otherwise Keras's own.
    * `LossScaleOptimizerV3.apply_gradients` (Keras's new optimizers): runs
      inside `agreeing()`, so the reduction counts non-finite values.
    * `LossScaleOptimizer.apply_gradients` (around a legacy optimizer):
      refused under this strategy with what to use instead (Keras applies
      the inner legacy optimizer with `experimental_aggregate_gradients=False`,
      which Keras refuses for every ParameterServerStrategy).
    * `_DynamicLossScaleState.update`: its writes (the loss scale and its
      counter) are not the step's end (`inside_variable_update`), so the
      end-of-step barrier waits for the table updates made after it.

    Under any other strategy, every replaced function behaves as Keras's.
    """
    module = _tf_internal.keras_private_module("mixed_precision.loss_scale_optimizer")
    supports = module.strategy_supports_loss_scaling
    is_all_finite = keras_members.loss_scale_is_all_finite(module)
    state_cls = keras_members.dynamic_loss_scale_state(module)
    update = state_cls.update
    v3_apply = module.LossScaleOptimizerV3.apply_gradients

    def strategy_supports_loss_scaling():
        if _strategy_agrees():
            check_dense_allreduce_dtype(_strategy_dense_allreduce_dtype())
            warn_float16_on_cpu_once()  # Keras asks when it makes a LossScaleOptimizer.
            return True
        return supports()

    def _is_all_finite(grads):
        agreed = _agreed_for_current_graph() if not tf.executing_eagerly() else None
        return agreed if agreed is not None else is_all_finite(grads)

    def _update(self, grads):
        if not _strategy_agrees():
            return update(self, grads)
        with replicated.inside_variable_update():
            return update(self, grads)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if not _strategy_agrees():
            return v3_apply(self, grads_and_vars, *args, **kwargs)
        with _agreeing_scope():
            return v3_apply(self, grads_and_vars, *args, **kwargs)

    legacy_apply = module.LossScaleOptimizer.apply_gradients

    def legacy_apply_gradients(self, grads_and_vars, *args, **kwargs):
        if _strategy_agrees():
            raise StrategyError(
                "mixed_float16 with a legacy optimizer "
                f"({type(self.inner_optimizer).__name__} from tf.keras.optimizers.legacy): "
                "Keras's LossScaleOptimizer applies it with "
                "experimental_aggregate_gradients=False, which Keras refuses under a "
                "ParameterServerStrategy. Fix: use Keras's optimizer of the same name from "
                "tf.keras.optimizers (not .legacy), or the mixed_bfloat16 policy.")
        return legacy_apply(self, grads_and_vars, *args, **kwargs)

    module.strategy_supports_loss_scaling = strategy_supports_loss_scaling
    module.LossScaleOptimizer.apply_gradients = legacy_apply_gradients
    keras_members.set_loss_scale_is_all_finite(module, _is_all_finite)
    state_cls.update = _update
    module.LossScaleOptimizerV3.apply_gradients = apply_gradients

    def undo():
        module.strategy_supports_loss_scaling = supports
        keras_members.set_loss_scale_is_all_finite(module, is_all_finite)
        state_cls.update = update
        module.LossScaleOptimizerV3.apply_gradients = v3_apply
        module.LossScaleOptimizer.apply_gradients = legacy_apply

    return undo
