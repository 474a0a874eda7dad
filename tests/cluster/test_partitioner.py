"""Stock PSS's `variable_partitioner` on a real cluster: shard counts, training, restore.

The chief script (scripts/partitioned_tables.py) constructs the strategy as
stock code does, `HybridParameterServerStrategy(resolver,
variable_partitioner=...)`, on 2 workers and 2 PS tasks.
"""

import collections
import json
import os

import pytest

from tests.cluster import _cluster_util as cu
from tests.cluster.test_strategy import SCRIPTS, run_chief_script

PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
PS1 = "/job:ps/replica:0/task:1/device:CPU:0"


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("partitioner,sharding,variant", [
    # 3 shards on 2 PS tasks: shard s on ps s mod 2.
    ("fixed3", "interleaved", "plain"),
    # 3 shards for table_a, 1 (whole, on one PS) for table_b.
    ("minsize", "interleaved", "plain"),
    # Both 3-shard tables in one stack of 3 shards.
    ("fixed3", "interleaved", "stacked"),
    # TF's own row-range layout: stock's placement (round-robin counter).
    ("fixed3", "contiguous", "plain"),
    # The ps and worker tasks start their servers as stock's guide does
    # (scripts/stock_server.py: tf.distribute.Server(...).join(), no plugin),
    # and the chief does not call tf_psplugin.start_server().
    ("minsize", "interleaved", "stock_servers"),
])
def test_partitioner_decides_shards_and_training_is_exact(make_cluster, shared_cluster, tmp_path,
                                                          partitioner, sharding, variant):
    args = [partitioner, sharding] + {"stacked": ["stacked"], "stock_servers": ["stock"]}.get(
        variant, [])
    if variant == "stock_servers":
        report = _run_with_stock_servers(make_cluster, tmp_path, args)
    else:
        report, _ = run_chief_script(shared_cluster, tmp_path, "partitioned_tables.py", args,
                                     num_workers=2, num_ps=2)
    assert report["num_workers"] == 2
    for name, table in report["tables"].items():
        n = table["partitioner_says"]
        assert len(table["shards"]) == n, (name, table)
        # A stack's shards hold both tables' rows.
        rows = 68 if variant == "stacked" else {"table_a": 50, "table_b": 18}[name]
        assert sum(table["shards"]) == rows, (name, table)
        if n == 1:
            assert table["devices"][0] in (PS0, PS1), table
            continue
        expected_type = {"interleaved": "InterleavedShardedVariable",
                         "contiguous": "ShardedVariable"}[sharding]
        if variant == "stacked":
            expected_type = "StackedTable"
        assert table["type"] == expected_type, table
        if sharding == "interleaved":
            assert table["devices"] == [(PS0, PS1)[s % 2] for s in range(n)], table
        else:
            # Stock's round-robin: consecutive PS tasks from a running counter.
            counts = collections.Counter(table["devices"])
            assert set(counts) == {PS0, PS1} and max(counts.values()) == 2, table
    if partitioner == "fixed3":
        assert [len(t["shards"]) for t in report["tables"].values()] == [3, 3]
    else:
        assert [len(t["shards"]) for t in report["tables"].values()] == [3, 1]
    assert report["tables_share_shards"] == (variant == "stacked")
    if sharding == "interleaved":
        assert report["dynamic_shards"] == 2
    # Dense variables: replicated on the workers, never partitioned.
    assert report["dense_devices"] == ["/job:worker/replica:0/task:0",
                                       "/job:worker/replica:0/task:1"]
    kinds = collections.Counter(r["kind"] for r in report["records"])
    assert kinds["dense"] >= 4 and not kinds["ps"], kinds
    for r in report["records"]:
        if r["kind"].startswith("dense"):
            assert all(d.startswith("/job:worker/") for d in r["devices"]), r
    # Synchronous training equals one process on the global batch.
    assert max(report["diffs"]) <= 1e-5, report["diffs"]
    assert abs(report["loss"] - report["ref_loss"]) <= 1e-5
    # The checkpoint restores into a plain model (one variable per table).
    assert report["restored_tables"] == 0.0
    assert report["restored_accumulator"] == 0.0
    assert report["accumulator_trained"] > 0.0


def _run_with_stock_servers(make_cluster, tmp_path, args):
    out = str(tmp_path / "report.json")
    cluster = make_cluster(num_workers=2, num_ps=2, servers="command")
    cluster.start_servers([cu.PYTHON, os.path.join(SCRIPTS, "stock_server.py")])
    result = cluster.run_chief(
        [cu.PYTHON, os.path.join(SCRIPTS, "partitioned_tables.py"), out] + args, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    with open(out) as f:
        return json.load(f)
