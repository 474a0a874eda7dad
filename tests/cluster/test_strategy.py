"""Multi-process tests of HybridParameterServerStrategy with real servers.

Each test starts a LocalCluster (workers and PS as subprocesses on loopback)
and runs a chief script from tests/cluster/scripts/; the fixtures kill every
process even when a test fails.
"""

import json
import os
import re

import pytest

from tests.cluster import _cluster_util as cu

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def run_chief_script(cluster_factory, tmp_path, script, args, num_workers=2, num_ps=2,
                     timeout=240):
    """Runs `script` as the chief of `cluster_factory(...)`'s cluster; returns (report, log).

    `cluster_factory` is the `shared_cluster` or the `make_cluster` fixture.
    """
    out = str(tmp_path / "report.json")
    cluster = cluster_factory(num_workers=num_workers, num_ps=num_ps)
    cluster.start_servers()  # A no-op on a shared cluster.
    result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, script), out] + list(args),
                               timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:]
    with open(out) as f:
        return json.load(f), result.stdout


@pytest.mark.cluster
@pytest.mark.timeout(540)  # mixed_float16 also runs a custom loop: up to 4 min on 2 busy cores.
@pytest.mark.parametrize(
    "optimizer,sharding,steps_per_execution,variant,num_workers,exchange", [
        ("sgd", "interleaved", 1, "plain", 2, "ps"),
        ("adagrad", "interleaved", 1, "plain", 2, "ps"),
        ("adagrad", "contiguous", 1, "plain", 2, "ps"),
        ("adagrad", "interleaved", 5, "plain", 2, "ps"),
        # Both tables looked up together (experimental_fuse_lookups=True), in a loop of 5.
        ("adagrad", "interleaved", 5, "fused", 2, "ps"),
        # Both tables stored as one stack (stack_tables=True) and looked up
        # together: one gather and one Adagrad apply per PS and step.
        ("adagrad", "interleaved", 5, "stacked", 2, "ps"),
        ("adam_new", "interleaved", 1, "plain", 2, "ps"),
        # Sparse row counts that change every step (ids de-duplicated before
        # the lookup), and a worker that owns no table shard (3 workers, 2
        # shards); the PS sums 3 workers' gradients in worker order.
        ("adagrad", "interleaved", 1, "dedup", 3, "ps"),
        # The all-gather exchange, kept for comparison.
        ("adagrad", "interleaved", 1, "dedup", 3, "allgather"),
        # Keras's mixed_bfloat16 policy (layers compute in bfloat16, variables
        # stay float32; the output layer float32), here and in the reference,
        # with a legacy optimizer (slots of AutoCastVariables).
        ("adagrad", "interleaved", 1, "mixed_bfloat16", 2, "ps"),
        # mixed_float16: Keras's LossScaleOptimizer (wrapped by compile)
        # around Keras's Adam; step 3 overflows on one worker's batch only.
        ("adam_new", "interleaved", 1, "mixed_float16", 2, "ps"),
        # The same with both tables in one stack (stacking is the default).
        ("adam_new", "interleaved", 1, "mixed_float16+stacked", 2, "ps"),
        # The dense gradients in 3 all-reduces (HybridOptions.dense_bucket_bytes),
        # the workers' non-finite count riding in the last: the overflowing
        # step is still skipped by every worker.
        ("adam_new", "interleaved", 1, "mixed_float16+bucketed", 2, "ps"),
    ])
def test_sync_matches_single_process_on_global_batch(shared_cluster, tmp_path, optimizer, sharding,
                                                     steps_per_execution, variant, num_workers,
                                                     exchange):
    parts = set(variant.split("+"))  # e.g. "mixed_float16+stacked"
    stacked = "stacked" in parts
    mixed = next((p for p in sorted(parts) if p.startswith("mixed_")), None)
    report, log = run_chief_script(
        shared_cluster, tmp_path, "sync_equivalence.py",
        [optimizer, sharding, "sync", str(steps_per_execution), variant, exchange],
        num_workers=num_workers, timeout=480 if mixed == "mixed_float16" else 240)
    assert report["num_replicas_in_sync"] == num_workers
    assert report["dense_bucket_bytes"] == (16 if "bucketed" in parts else 0)
    ops = report["sparse_exchange_ops"]
    if exchange == "ps":
        # Every worker hands its gradients to both PS tasks; the updating
        # roles take them on the PS; nothing is all-gathered, and the summed
        # gradient never feeds an op on a worker.
        assert ops["enqueue"] >= 2 and ops["dequeue_on_ps"] >= num_workers, ops
        assert ops["all_gather"] == 0, ops
        on_workers = report["summed_gradient_on_workers"]
        if mixed == "mixed_float16":
            # Keras's LossScaleOptimizer applies in a tf.cond whose inputs
            # include the updating role's summed table gradient: the cond
            # (an `If` on the worker) is its only consumer there
            # (docs/mixed_precision.md, the cost of loss scaling).
            on_workers = [op for op in on_workers if not op.startswith("If ")]
        assert not on_workers, report["summed_gradient_on_workers"]
        # Exact whatever the timing: every take waits for a collective that
        # waits for every hand-in (checked in the traced graphs).
        assert not report["early_takes"], report["early_takes"]
    else:
        assert ops["enqueue"] == 0 and ops["dequeue_on_ps"] == 0 and ops["all_gather"] > 0, ops
    assert report["replicas_identical"], "dense replicas diverged across workers"
    if mixed == "mixed_float16":
        check_loss_scaling(report)
    # With experimental_fuse_lookups=True the two tables are looked up together
    # (tables/fusion.py), so the comparison below covers fused lookups.
    if parts & {"fused", "stacked"}:
        assert report["fused_lookup_gathers"] > 0, report["fused_lookup_gathers"]
    else:
        assert report["fused_lookup_gathers"] == 0, report["fused_lookup_gathers"]
    # Each updating role applies to the shards on its one PS: one apply per
    # table there, or one for the stack.
    assert report["tables_share_shards"] == stacked
    if stacked:
        # Checkpointed table by table: a plain model loads the same tables
        # and accumulators (which training moved off their initial 0.1).
        ckpt = report["checkpoint"]
        assert ckpt["tables"] == 0.0, ckpt
        if optimizer == "adam_new":
            # Keras's new optimizers' table slots are saved per table in
            # logical row order (`slot_order`): Adam's moments of both
            # tables load into a plain model as single-process training
            # made them (in the wrong rows they would differ by their size).
            assert ckpt["adam_slots"] == 4, ckpt
            assert ckpt["adam_slots_vs_reference"] <= 0.01, ckpt
        else:
            assert ckpt["accumulator"] == 0.0, ckpt
            assert ckpt["accumulator_trained"] > 0.0, ckpt
    table_records = [r for r in report["records"] if r["kind"] == "table"]
    assert len(table_records) == 2
    assert all(bool(r["stack"]) == stacked for r in table_records), table_records
    if optimizer == "adagrad" and parts <= {"plain", "stacked"} and num_workers == 2:
        expected = 1 if stacked else 2
        assert max(report["sparse_applies_per_graph"]) == expected, (
            report["sparse_applies_per_graph"])
    # Exact whatever the timing: every table/slot write on a PS precedes the
    # end-of-step barrier (checked in the traced graphs, not by luck).
    assert report["graphs_with_ps_writes"] >= 1
    assert not report["unordered_ps_writes"], report["unordered_ps_writes"]
    # bfloat16 keeps 8 significant bits: each worker's gradient of its half
    # batch is rounded before the all-reduce, the single process rounds the
    # global batch's once. Measured after 20 Adagrad steps (lr 0.1): max
    # |diff| 0.027 (a bias), loss 1.2e-4 relative; float32 stays at 1e-5.
    # float16 keeps 11: after 20 Adam steps (lr 0.01, one skipped) max |diff|
    # 5.3e-5 (a kernel), the loss equal to the bit (TF 2.15 and 2.21).
    weight_tol, loss_tol = {"mixed_bfloat16": (0.05, 1e-3),
                            "mixed_float16": (5e-4, 1e-5)}.get(mixed, (1e-5, 1e-5))
    for name, diff in report["diffs"].items():
        assert diff <= weight_tol, f"{name}: max |diff| {diff} vs single-process training"
    assert abs(report["loss"] - report["ref_loss"]) <= loss_tol * max(1.0, abs(report["loss"]))
    # Metric accumulators (ON_READ) are updated with the global batch's deltas.
    for name, value in report["metrics"].items():
        assert abs(value - report["ref_metrics"][name]) <= loss_tol * max(1.0, abs(value)), (
            name, value, report["ref_metrics"][name])
    if exchange == "ps" and not mixed:
        # (mixed_bfloat16 runs 6: not looked into yet, docs/mixed_precision.md.)
        # Per traced step: the dense all-reduce (carrying the loss tracker's
        # updates, and doubling as the hand-in barrier), the end-of-step
        # barrier, and one all-reduce for both metrics' four accumulators
        # when the step reads them.
        assert max(report["collectives_per_graph"]) == 3, report["collectives_per_graph"]
    # Placement, asserted on device strings.
    assert sorted(report["table_devices"]) == [
        "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    kinds = {r["kind"] for r in report["records"]}
    assert {"table", "dense"} <= kinds
    for r in report["records"]:
        if r["kind"].startswith("table"):
            assert all("/job:ps/" in d for d in r["devices"]), r
        else:
            assert r["devices"] and all("/job:worker/" in d for d in r["devices"]), r
            assert sorted(d.replace("/replica:0", "") for d in r["devices"]) == [
                f"/job:worker/task:{i}" for i in range(num_workers)], r
    assert "tf_psplugin placement:" in log


def check_loss_scaling(report):
    """mixed_float16: the loss scale agreed by every worker; the overflowing step skipped.

    Step `overflow_step` overflows float16 in one worker's batch only (the
    other worker's gradients are finite): every worker must skip it, halve
    the loss scale and restart its counter, as one process on the global
    batch does, and the skipped step must change no weight and no table row.
    """
    f16 = report["float16"]
    overflow = f16["overflow_step"]
    # fit: every worker's loss scale and counter end where one process's do
    # (halved once at the overflow, then 16 good steps).
    assert report["ref_loss_scale"] == [2.0**14, 16.0], report["ref_loss_scale"]
    assert f16["fit_scales"] == [report["ref_loss_scale"]] * 2, f16["fit_scales"]
    # The cond's skipping branch has no PS write and takes nothing from the
    # queues (the gradients were taken before the cond, on every step).
    conds, found = f16["skip_branch"]
    assert conds >= 1 and not found, f16["skip_branch"]
    # Custom loop, step by step: every worker's scale is one process's.
    loop = f16["custom_loop"]
    for i, (step, ref) in enumerate(zip(loop["steps"], loop["ref_scales"])):
        assert step["scales"] == [ref, ref], (i, step["scales"], ref)
        if i == overflow:
            assert ref == [2.0**14, 0.0], ref
            assert step["moved"] == 0.0, (i, step)  # Nothing applied, tables included.
        else:
            assert step["moved"] > 1e-3, (i, step)
    for name, diff in loop["diffs"].items():
        assert diff <= 5e-4, f"custom loop {name}: max |diff| {diff} vs one process"
    # A legacy optimizer: one clear error naming the fix (raised while the
    # step is traced, so TF may wrap it in a StagingError that quotes it).
    kind, message = f16["legacy_refusal"]
    assert kind in ("StrategyError", "StagingError"), f16["legacy_refusal"]
    assert ("mixed_float16 with a legacy optimizer (Adam from tf.keras.optimizers.legacy)"
            in message and "Fix: use Keras's optimizer" in message), message


@pytest.mark.cluster
@pytest.mark.timeout(540)
def test_bucketed_dense_all_reduce_trains_the_same_weights_bit_for_bit(shared_cluster, tmp_path):
    """HybridOptions.dense_bucket_bytes: three dense all-reduces instead of one, the same sums.

    With 2 workers every element of the sum is a + b, whichever collective
    carries it: the weights after 20 steps must equal the one-pack run's bit
    for bit, and one process's on the global batch as tightly as ever.
    """
    reports = {}
    for variant in ("plain", "bucketed"):
        run_dir = tmp_path / variant
        run_dir.mkdir()
        reports[variant], _ = run_chief_script(
            shared_cluster, run_dir, "sync_equivalence.py",
            ["adagrad", "interleaved", "sync", "1", variant, "ps"])
    plain, bucketed = reports["plain"], reports["bucketed"]
    assert (plain["dense_bucket_bytes"], bucketed["dense_bucket_bytes"]) == (0, 16)
    cu.assert_same_npz(tmp_path / "plain" / "report.json.npz",
                       tmp_path / "bucketed" / "report.json.npz")
    for report in (plain, bucketed):
        assert report["replicas_identical"]
        # Measured: 6e-8 (TF 2.15).
        for name, diff in report["diffs"].items():
            assert diff <= 1e-6, f"{name}: max |diff| {diff} vs single-process training"
        assert not report["early_takes"], report["early_takes"]
        assert not report["unordered_ps_writes"], report["unordered_ps_writes"]
    assert bucketed["loss"] == plain["loss"] and bucketed["metrics"] == plain["metrics"]
    # The MLP's 4 variables (Dense(8) kernel 768 bytes and bias 32, Dense(1)
    # kernel 32 and bias 4) in 3 buckets of >= 16 bytes, last layer first:
    # 2 more collectives per step, both free to start before the hand-ins of
    # the table gradients (the backward pass's last); the last bucket still
    # doubles as the hand-in barrier (no early take above).
    assert max(plain["collectives_per_graph"]) == 3, plain["collectives_per_graph"]
    assert max(bucketed["collectives_per_graph"]) == 5, bucketed["collectives_per_graph"]
    assert (max(bucketed["collectives_before_hand_ins"])
            == max(plain["collectives_before_hand_ins"]) + 2), (
        plain["collectives_before_hand_ins"], bucketed["collectives_before_hand_ins"])


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_fit_evaluate_predict_variants(shared_cluster, tmp_path):
    report, log = run_chief_script(shared_cluster, tmp_path, "fit_variants.py", [str(tmp_path)],
                                   timeout=360)
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not errors, json.dumps(report, indent=1)[-6000:]
    plain = report["plain_dataset"]
    assert {"loss", "auc", "val_loss", "val_auc"} <= set(plain)
    assert plain["loss"][1] < plain["loss"][0]
    assert report["dataset_creator"]["loss"][0] < plain["loss"][0]
    cb = report["callbacks"]
    assert cb["epochs"] == 2 and "w-1.index" in cb["ckpt_files"] and "w-2.index" in cb["ckpt_files"]
    assert cb["tb_files"] >= 1
    assert report["steps_per_execution"]["iterations"] == 20
    assert report["evaluate"]["auc"] > 0.6
    assert report["predict"] == {"shape": [100, 1], "finite": True}
    # Batch-norm statistics: updated with the workers' mean delta, identical replicas.
    for name, stats in report["batch_norm_replicas"].items():
        assert stats == {"identical": True, "moved": True}, (name, stats)
    # A metric updated after the gradients and never read in the step counts
    # every example once (2 steps x 2 workers x 32; fit resets model metrics
    # at each epoch), also when the second fit finds the step traced.
    assert report["unread_metric_update"]["seen"] == [128.0, 128.0], report["unread_metric_update"]
    # verbose=1: the plugin's bar; the global batch is 2 workers x 32 (static).
    lines = report["verbose_1"]["output"].splitlines()
    assert re.match(r"^12/12 \[=+\] - \d+s \d+ms/step - [\d,]+ examples/s - loss: ", lines[0]), lines
    assert re.match(r"^4/4 \[=+\] - \d+s \d+ms/step - .*auc: ", lines[-1]), lines


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("updates,dense,tables", [
    ("async", "allreduce", "fused"), ("sync", "ps", "fused"),
    # 26 Embedding layers stored in one stack (stack_tables=True), async.
    ("async", "allreduce", "stacked")])
def test_async_and_ps_modes_learn_the_synthetic_ctr_task(shared_cluster, tmp_path, updates, dense,
                                                         tables):
    """300 steps of 2 x 256 examples reach the generator's ceiling within 0.08 AUC.

    Measured on this 2-core box: sync 0.780, async 0.780, ps 0.743 against a
    ceiling of 0.808 (SyntheticCTR(vocab_size=1000, seed=0).expected_auc()).
    """
    report, _ = run_chief_script(shared_cluster, tmp_path, "ctr_modes.py",
                                 [updates, dense, "300", tables], timeout=540)
    assert report["auc"] >= report["expected_auc"] - 0.08, report
    kinds = {r["kind"] for r in report["placement"]}
    table_records = [r for r in report["placement"] if r["kind"] == "table"]
    assert len(table_records) == (26 if tables == "stacked" else 1)
    assert len({r["stack"] for r in table_records}) == 1
    assert all(bool(r["stack"]) == (tables == "stacked") for r in table_records)
    # One optimizer slot set per stack shard, not per table.
    assert len([r for r in report["placement"] if r["kind"] == "table-slot"]) == 2 * 2
    if dense == "ps":
        # Stock PSS placement for dense variables: on PS, not replicated.
        assert "dense" not in kinds and "ps" in kinds
    else:
        assert "dense" in kinds


def _peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_worker_memory_does_not_grow_with_the_table(make_cluster, tmp_path):
    """A 4M x 16 table (256 MB + 256 MB of Adagrad slots) leaves workers' peak RSS flat."""
    peaks = {}
    for rows in (10_000, 4_000_000):
        cluster = make_cluster(num_workers=2, num_ps=2)
        cluster.start_servers()
        out = str(tmp_path / f"big_{rows}.json")
        result = cluster.run_chief([cu.PYTHON, os.path.join(SCRIPTS, "big_table.py"), out,
                                    str(rows)], timeout=500)
        assert result.returncode == 0, result.stdout[-4000:]
        pids = cluster.pids()
        peaks[rows] = {role: _peak_rss_mb(pid) for role, pid in pids.items()
                       if role.startswith(("worker", "ps"))}
        cluster.stop()
    table_mb = 4_000_000 * 16 * 4 / 2**20
    for role in ("worker:0", "worker:1"):
        growth = peaks[4_000_000][role] - peaks[10_000][role]
        assert growth < 0.15 * table_mb, (role, peaks)
    ps_growth = sum(peaks[4_000_000][r] - peaks[10_000][r] for r in ("ps:0", "ps:1"))
    assert ps_growth > 1.5 * table_mb, peaks  # The table and its slots really are on the PS.
