"""Finite data in synchronous mode: epochs end cleanly, evaluation is exact.

One chief runs every check against one cluster (tests/cluster/scripts/
finite_data.py); each is asserted here by name. What an epoch is:
tf_psplugin/runtime/epochs.py and docs/concepts.md.
"""

import os

import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "finite_data.py")
CHECKS = (
    "fit_epochs_known_length",  # fit(epochs=3), 11 batches: 5 steps/epoch, exact.
    "unknown_cardinality_input",
    "fit_epochs_unknown_length",  # ... the same when the length must be counted,
    "fit_epochs_steps_per_execution",  # ... and with a partial last execution.
    "evaluate_exact",  # Every example counted once (padding, all-reduced metrics).
    "evaluate_exact_unknown_length",
    "evaluate_exact_static_batch",
    "fit_validation_exact",
    "predict_finite",
    "custom_loop_sharded_out_of_range",  # OutOfRangeError, not CancelledError.
    "custom_loop_uneven_epoch0",  # Uneven shards end the epoch for all, no hang,
    "custom_loop_uneven_epoch1",  # ... every epoch,
    "custom_loop_usable_after",  # ... and the cluster stays usable.
    # Unknown length, no counting pass: the end is agreed step by step.
    "custom_loop_unknown_length_epoch0",
    "custom_loop_unknown_length_epoch1",
    "custom_loop_unknown_length_usable_after",
    "fit_endless_filtered_stream",  # repeat().filter() with steps_per_epoch trains.
    "fit_runs_out_with_steps",  # More steps than data: stops at the agreed end.
    "fit_after_running_out",  # ... and the model trains again.
    "batch_counter_fit",  # tf-keras's PSS metric test: one pass per epoch, every epoch.
    "batch_counter_evaluate",
    "file_sharding_auto",  # TFRecord files: each worker opens only its own files.
    "file_sharding_data_policy",  # AutoShardPolicy.DATA: by batch.
    "file_sharding_off_policy",  # OFF: every worker reads everything.
    # fit(files, epochs=2) with no steps_per_epoch: no counting pass.
    "fit_files_read_once",  # Each record read once per epoch (counted on disk),
    "fit_files_weights",  # ... the weights of one process on the global batches,
    "fit_files_callbacks",  # ... 2 epochs of 4 steps, unknown length at the start,
    "fit_files_progress_unknown_total",  # ... no total in the first epoch's bar.
)

pytestmark = [pytest.mark.cluster]


@pytest.mark.timeout(600)
def test_finite_data(make_cluster):
    cluster = make_cluster(num_workers=2, num_ps=1)
    cluster.start_servers()
    result = cluster.run_chief([cu.PYTHON, SCRIPT], timeout=500)
    cu.assert_checks_passed(result, CHECKS)


@pytest.mark.timeout(300)
def test_a_stalled_input_is_named_by_the_watchdog(make_cluster):
    """No batch ever comes: one error line says the input has not produced one."""
    cluster = make_cluster(num_workers=2, num_ps=1)
    cluster.start_servers()
    script = os.path.join(os.path.dirname(__file__), "scripts", "stalled_input.py")
    result = cluster.run_chief([cu.PYTHON, script], timeout=200)
    cu.assert_checks_passed(result, ("stalled_input_named",))
