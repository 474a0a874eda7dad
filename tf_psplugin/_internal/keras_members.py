"""Named accessors for the Keras members the plugin's process-wide patches replace.

Split out of `tf_objects.py` (which holds every other named private-attribute
accessor) to keep each module under the package's line limit: here are the
get/set pairs of the Keras class members and module functions that a patch
in `patches.PATCHES` replaces (a Functional model's graph runner, the
callback list's defaults, the optimizers' apply hooks, loss scaling), and the
reads those patches need. The same rules as `tf_objects.py` hold: each
function names the TF/Keras class that defines the attribute, why no public
API will do, and the TF versions it was checked on.

"TF 2.15-2.21" below means checked on TF 2.15.1 (tf.keras 2.15) and TF 2.21.0
(tf-keras 2.21), the two versions CI runs.
"""

import contextlib
from typing import Any, Callable


# -- Patched Keras members (each patch is declared in `patches.PATCHES`) --------


def functional_run_internal_graph(functional_cls) -> Callable:
    """Keras Functional's `_run_internal_graph`, which runs a model's layers (tf.keras 2.15, tf-
    keras 2.21).
    """
    return functional_cls._run_internal_graph  # pylint: disable=protected-access


def set_functional_run_internal_graph(functional_cls, fn: Callable) -> None:
    """Replaces Keras Functional's `_run_internal_graph` (patch "keras_functional_fusion";
    tf.keras 2.15, tf-keras 2.21).
    """
    functional_cls._run_internal_graph = fn  # pylint: disable=protected-access


def keras_get_verbosity(training_module) -> Callable:
    """Keras `engine.training._get_verbosity`, which picks fit's verbosity (tf.keras 2.15, tf-
    keras 2.21).
    """
    return training_module._get_verbosity  # pylint: disable=protected-access


def set_keras_get_verbosity(training_module, fn: Callable) -> None:
    """Replaces Keras `engine.training._get_verbosity` (patch "keras_progress_bar"; tf.keras 2.15,
    tf- keras 2.21).
    """
    training_module._get_verbosity = fn  # pylint: disable=protected-access


def add_default_callbacks(callback_list_cls) -> Callable:
    """Keras CallbackList's `_add_default_callbacks`, which adds the progress bar (tf.keras 2.15,
    tf- keras 2.21).
    """
    return callback_list_cls._add_default_callbacks  # pylint: disable=protected-access


def set_add_default_callbacks(callback_list_cls, fn: Callable) -> None:
    """Replaces Keras CallbackList's `_add_default_callbacks` (patch "keras_progress_bar";
    tf.keras 2.15, tf-keras 2.21).
    """
    callback_list_cls._add_default_callbacks = fn  # pylint: disable=protected-access


def callback_list_progbar(callback_list):
    """Keras CallbackList's `_progbar`: the ProgbarLogger it added, or None (tf.keras 2.15,
    tf-keras 2.21).
    """
    return callback_list._progbar  # pylint: disable=protected-access


def set_callback_list_progbar(callback_list, progbar) -> None:
    """Sets Keras CallbackList's `_progbar` to the plugin's progress bar (patch
    "keras_progress_bar"; tf.keras 2.15, tf-keras 2.21).
    """
    callback_list._progbar = progbar  # pylint: disable=protected-access


def deduplicate_sparse_grad(optimizer_cls) -> Callable:
    """Keras Optimizer's `_deduplicate_sparse_grad`, which sums duplicate sparse rows (tf.keras
    2.15, tf-keras 2.21).
    """
    return optimizer_cls._deduplicate_sparse_grad  # pylint: disable=protected-access


def set_deduplicate_sparse_grad(optimizer_cls, fn: Callable) -> None:
    """Replaces Keras Optimizer's `_deduplicate_sparse_grad` (patch "keras_dedup_on_ps"; tf.keras
    2.15, tf-keras 2.21).
    """
    optimizer_cls._deduplicate_sparse_grad = fn  # pylint: disable=protected-access


def loss_scale_is_all_finite(module) -> Callable:
    """Keras's `loss_scale_optimizer._is_all_finite`, the loss scale's "every gradient is
    finite" check (patch "keras_loss_scaling"; tf.keras 2.15, tf-keras 2.21).
    """
    return module._is_all_finite  # pylint: disable=protected-access


def set_loss_scale_is_all_finite(module, fn: Callable) -> None:
    """Replaces Keras's `loss_scale_optimizer._is_all_finite` (patch "keras_loss_scaling";
    tf.keras 2.15, tf-keras 2.21).
    """
    module._is_all_finite = fn  # pylint: disable=protected-access


def dynamic_loss_scale_state(module) -> type:
    """Keras's `loss_scale_optimizer._DynamicLossScaleState`, the dynamic loss scale and
    its `update` (patch "keras_loss_scaling"; tf.keras 2.15, tf-keras 2.21).
    """
    return module._DynamicLossScaleState  # pylint: disable=protected-access


@contextlib.contextmanager
def eager_loss_scale_weights_in_graph(states, graph):
    """Lists each Keras `_DynamicLossScaleState`'s eager variables as `graph`'s too.

    Its `_trackable_children` lists only the variables of the current graph
    (`_weights`, keyed by (name, the graph's `_graph_key`; None eagerly));
    a checkpoint written inside a traced function (`checkpoint_write`) would
    save no loss scale. Undone on exit (tf.keras 2.15, tf-keras 2.21).

    Args:
        states: `_DynamicLossScaleState` objects (`dynamic_loss_scale_state`).
        graph: The graph being built (the traced write's `FuncGraph`).
    """
    graph_key = graph._graph_key  # pylint: disable=protected-access
    added = []
    for state in states:
        weights = state._weights  # pylint: disable=protected-access
        for (name, key), variable in list(weights.items()):
            if key is None and (name, graph_key) not in weights:
                weights[(name, graph_key)] = variable
                added.append((weights, (name, graph_key)))
    try:
        yield
    finally:
        for weights, key in added:
            weights.pop(key, None)


def distributed_apply_gradients_fn(optimizer_cls) -> Callable:
    """Keras Optimizer's `_distributed_apply_gradients_fn`, which applies gradients under a
    strategy (tf.keras 2.15, tf-keras 2.21).
    """
    return optimizer_cls._distributed_apply_gradients_fn  # pylint: disable=protected-access


def set_distributed_apply_gradients_fn(optimizer_cls, fn: Callable) -> None:
    """Replaces Keras Optimizer's `_distributed_apply_gradients_fn` (patch
    "keras_stacked_updates"; tf.keras 2.15, tf-keras 2.21).
    """
    optimizer_cls._distributed_apply_gradients_fn = fn  # pylint: disable=protected-access


def moving_average_functions(optimizer_cls) -> tuple:
    """Keras Optimizer's (`_update_model_variables_moving_average`,
    `_overwrite_model_variables_with_average_value`): `use_ema`'s update and
    write-back of a variable list (tf.keras 2.15, tf-keras 2.21).
    """
    # pylint: disable=protected-access
    return (optimizer_cls._update_model_variables_moving_average,
            optimizer_cls._overwrite_model_variables_with_average_value)


def set_moving_average_functions(optimizer_cls, update: Callable, overwrite: Callable) -> None:
    """Replaces the two functions `moving_average_functions` returns (patch
    "keras_stacked_updates"; tf.keras 2.15, tf-keras 2.21).
    """
    # pylint: disable=protected-access
    optimizer_cls._update_model_variables_moving_average = update
    optimizer_cls._overwrite_model_variables_with_average_value = overwrite


def moving_average_of(optimizer, var) -> Any:
    """A Keras Optimizer's `use_ema` average of `var` (a variable its `build` was given;
    `_model_variables_moving_average`, `_index_dict`, `_var_key`; tf.keras 2.15, tf-keras 2.21).
    """
    # pylint: disable=protected-access
    return optimizer._model_variables_moving_average[optimizer._index_dict[
        optimizer._var_key(var)]]


def set_create_all_weights(optimizer_cls, fn: Callable) -> None:
    """Replaces legacy OptimizerV2's `_create_all_weights` (patch "keras_stacked_updates";
    tf.keras 2.15, tf-keras 2.21).
    """
    optimizer_cls._create_all_weights = fn  # pylint: disable=protected-access


def distributed_apply(optimizer_cls) -> Callable:
    """Legacy OptimizerV2's `_distributed_apply`, which applies gradients under a strategy
    (tf.keras 2.15, tf-keras 2.21).
    """
    return optimizer_cls._distributed_apply  # pylint: disable=protected-access


def set_distributed_apply(optimizer_cls, fn: Callable) -> None:
    """Replaces legacy OptimizerV2's `_distributed_apply` (patch "keras_stacked_updates";
    tf.keras 2.15, tf-keras 2.21).
    """
    optimizer_cls._distributed_apply = fn  # pylint: disable=protected-access
