"""Programs users already have, run unchanged against the default strategy.

An optimisation is on by default only when no user program can tell. These
tests run, with `tf_psplugin.HybridParameterServerStrategy()` and nothing
else changed:

* TensorFlow's own programs (scripts/conformance_tf_programs.py): the
  Parameter Server Training tutorial's custom loop (a metric updated after
  `apply_gradients`, read after `join()`; preprocessing layers;
  `distribute_datasets_from_function`; its evaluation loop) and its
  `model.fit` with `DatasetCreator`, TensorBoard, ModelCheckpoint and
  BackupAndRestore; the Keras guide's training loop from scratch, checked
  against one process on the global batch; `fit` through a StringLookup.
* Keras layer arguments and model APIs (scripts/conformance_keras_layers.py):
  own weights and names per `Embedding`, `trainable=False`, regularizers,
  constraints, two models in one scope, `set_weights`, out-of-range ids and
  the missing id of the safe lookups.

Each check is asserted here by name, so a failure names what broke.

The default stacks tables (``stack_tables=True``, issues 29 and 40), where
each table must still look like its own variable to every Keras API; the
layer checks also run with ``stack_tables=False``, the way out.
"""

import os

import pytest

from tests.cluster import _cluster_util as cu

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")

TF_PROGRAM_CHECKS = (
    "tutorial_custom_loop_runs",
    "tutorial_custom_loop_metric_counts_every_example",
    "tutorial_custom_loop_learns",
    "tutorial_custom_loop_loss_fetched",
    "tutorial_eval_counts_every_example",
    "tutorial_eval_accuracy",
    "tutorial_fit_runs",
    "tutorial_fit_loss_falls",
    "tutorial_fit_checkpoint_written",
    "tutorial_fit_checkpoint_loads",
    "scratch_loop_runs",
    "scratch_loop_weights_equal_one_process",
    "scratch_loop_metrics_equal_one_process",
    "scratch_loop_learns",
    "loop_per_execution_runs",
    "loop_per_execution_counts_every_example",
    "loop_per_execution_metrics_equal_one_process",
    "loop_per_execution_losses_equal_one_process",
    "loop_per_execution_weights_equal_one_process",
    "fit_with_preprocessing_runs",
    "fit_with_preprocessing_loss_falls",
    "fit_with_preprocessing_metric",
)

KERAS_LAYER_CHECKS = (
    "layer_weights_are_own_table",
    "count_params_is_own_table",
    "trainable_variables_name_tables",
    "regularizer_covers_own_table",
    "fit_trains",
    "frozen_table_does_not_train",
    "trainable_table_trains",
    "other_model_untouched",
    "set_weights_copies_tables",
    "out_of_range_id_fails",
    "safe_lookup_missing_id_is_zeros",
    "constraint_holds",
    "adam_frozen_table_does_not_train",
    "adam_other_model_untouched",
    "adam_trainable_table_trains",
)

pytestmark = [pytest.mark.cluster]


@pytest.mark.timeout(420)
def test_tensorflow_and_keras_programs(shared_cluster):
    cluster = shared_cluster(num_workers=2, num_ps=1)
    result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, "conformance_tf_programs.py")],
                               timeout=360)
    cu.assert_checks_passed(result, TF_PROGRAM_CHECKS)


@pytest.mark.timeout(300)
def test_tutorial_custom_loop_with_async_tables(shared_cluster):
    """The tutorial's metric stays exact when the tables train asynchronously."""
    cluster = shared_cluster(num_workers=2, num_ps=1)
    result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, "conformance_tf_programs.py"),
                                "async", "tutorial_custom_loop"], timeout=240)
    cu.assert_checks_passed(result, [c for c in TF_PROGRAM_CHECKS if c.startswith("tutorial_")
                                     and "fit" not in c])


@pytest.mark.timeout(420)
def test_keras_layer_arguments(shared_cluster):
    cluster = shared_cluster(num_workers=2, num_ps=2)
    result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, "conformance_keras_layers.py")],
                               timeout=360)
    cu.assert_checks_passed(result, KERAS_LAYER_CHECKS)


@pytest.mark.timeout(420)
def test_keras_layer_arguments_with_unstacked_tables(shared_cluster):
    """stack_tables=False: every point holds as with the default's stacking (issue 40)."""
    cluster = shared_cluster(num_workers=2, num_ps=2)
    result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, "conformance_keras_layers.py"),
                                "unstacked"], timeout=360)
    cu.assert_checks_passed(result, KERAS_LAYER_CHECKS)
