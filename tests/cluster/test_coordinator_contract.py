"""The ClusterCoordinator contract the plugin inherits from stock PSS.

One chief runs every check against one cluster (tests/cluster/scripts/
coordinator_contract.py); each check is asserted here by name, so a failure
names what broke.
"""

import os

import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "coordinator_contract.py")
CHECKS = (
    "schedule_typeerror",  # A Python function is refused, as TF does.
    "input_error_type",  # A failing dataset function: ClosureInputError(original).
    "input_error_not_a_failure",  # ... which is not a task failure,
    "input_error_no_restart",  # ... so failover never ran,
    "input_error_raised_once",  # ... and the next join is clean.
    "still_usable",
    "step_error_is_users",
    "error_raised_once",  # Raised by one join, not again.
    "pending_cancelled",  # Steps scheduled before the raise are cancelled.
    "per_worker_dataset_freed",
    "repeated_iterators_released",  # TF's testRepeatedIteratorCreation.
    # A bad record on one worker mid-epoch: its error, at once; the peer
    # waiting in the step's collective is cancelled, not left hanging.
    "pipeline_error_is_users",
    "usable_at_once_after_pipeline_error",
    "iterators_aligned_after_pipeline_error",
    "second_strategy_trains",  # Two strategies in one process (collective keys).
)

pytestmark = [pytest.mark.cluster]


@pytest.mark.timeout(600)
def test_coordinator_contract(make_cluster):
    cluster = make_cluster(num_workers=2, num_ps=1)
    cluster.start_servers()
    result = cluster.run_chief([cu.PYTHON, SCRIPT], timeout=500)
    cu.assert_checks_passed(result, CHECKS)
