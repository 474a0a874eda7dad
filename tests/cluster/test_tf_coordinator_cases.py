"""TensorFlow's own ClusterCoordinator test cases, in our words, on the plugin.

One chief runs every case against one cluster (tests/cluster/scripts/
tf_coordinator_cases.py); each is asserted here by name. Where a
synchronous step changes what TF's test expects (a scheduled function runs
on every worker; steps run in the order they were scheduled), the case
asserts the difference that docs/concepts.md documents.
"""

import os

import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "tf_coordinator_cases.py")
CHECKS = (
    "only_init_once",
    "fn_return_nested_values",
    "input_function",
    "async_schedule_and_join",
    "input_function_with_map",
    "input_function_create_variables",
    "per_worker_value",  # Differs: every worker runs each function (10 x workers).
    "disallow_remote_value_as_input",
    "python_function_not_allowed",
    "dataset_partially_created_on_coordinator",
    "pass_dataset_to_create_per_worker_dataset",
    "multiple_datasets",
    "join_raise_error",
    "schedule_raise_error",
    "schedule_raise_error_with_multiple_failure",  # Under TF's harness threads (target= only).
    "error_will_be_cleared",
    "cancellation",  # Differs: steps run in order; the later ones are cancelled.
    "input_error",
    "resource_can_still_be_used_after_cancellation",
    "run_and_reduce",
)

pytestmark = [pytest.mark.cluster]


@pytest.mark.timeout(420)
def test_tf_coordinator_cases(make_cluster):
    cluster = make_cluster(num_workers=2, num_ps=1)
    cluster.start_servers()
    result = cluster.run_chief([cu.PYTHON, SCRIPT], timeout=360)
    cu.assert_checks_passed(result, CHECKS)
