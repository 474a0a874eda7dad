"""`HybridOptions(dense_allreduce_dtype="bfloat16")` with what a user turns on beside it.

The composition suite (tests/cluster/test_composition.py) runs on one
worker, where nothing is all-reduced, so the compressed all-reduce gets its
own cells here, on 2 workers: the same chief script and checks
(tests/cluster/scripts/composition.py, `cell_problems`), every cell stacked
and unstacked with the dense gradients summed in bfloat16. Together the
cells meet Keras's default optimizers (Adam, Adagrad, SGD) and a legacy
one, `fit` with `ChiefCheckpoint`, `full_every_saves` (the delta chain
restored bit for bit), export +
`ServingModel`, a frozen table, a second model in scope, a subclassed model,
`EarlyStopping(restore_best_weights=True)` and the `mixed_bfloat16` policy.
That the compression changes the weights at all, within its rounding, is
tests/cluster/test_dense_allreduce_dtype.py's.
"""

import pytest

from tests.cluster.test_composition import assert_cells_hold, run_cells

# Not here: kill and resume. On 2 workers this script's resumed job differed
# from its uninterrupted one by 0.074, stacked and unstacked alike (measured
# 2026-11-27, TF 2.21): its resume skips one batch per step, written for one
# worker. Not diagnosed further; the launcher's kill-and-resume tests
# (tests/cluster/test_failover.py) run 2 workers without the option.
CELLS = ("adam.fit.second_model+mixed_bfloat16", "adagrad.full_every.frozen",
         "sgd.export.subclassed+mixed_bfloat16", "legacy_adagrad.fit.early_stop")
WIRE = "wire_bfloat16"  # The script's mode suffix: HybridOptions(dense_allreduce_dtype=...).


@pytest.fixture(scope="module")
def results(tmp_path_factory, _cluster_pool):
    with _cluster_pool.borrowed(2, 2) as cluster:
        return run_cells(cluster, tmp_path_factory.mktemp("compose_wire"), CELLS, timeout=900,
                         table_dtype=WIRE)


@pytest.mark.cluster
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("cell", CELLS)
def test_bfloat16_all_reduce_cell_ends_like_unstacked(results, cell):
    assert_cells_hold(results, [cell])
    for stacking in ("stacked", "unstacked"):
        run = results[stacking][cell]
        # The cell ran with the option, on 2 workers (one worker all-reduces nothing).
        assert run["dense_allreduce_dtype"] == "bfloat16" and run["workers"] == 2, run
