"""Smoke tests of the benchmark harness: arguments, output schema, balance counts.

Fast tests never start TensorFlow processes: the runners are replaced by fakes
returning what a child would. The one real mini-run (`slow`) runs
single-process Keras and hybrid sync for a few steps and checks the JSON lines.
Measured figures are never asserted: they depend on the machine.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import balance, run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_and_quick():
    full = run.parse_args([])
    quick = run.parse_args(["--quick"])
    assert full.setup_list == list(run.THROUGHPUT_SETUPS)
    assert (full.global_batch, full.steps_per_execution) == (1024, 8)
    assert quick.steps < full.steps and quick.warmup_steps <= full.warmup_steps
    assert full.memory_row_list == [1_000_000, 10_000_000, 50_000_000]
    assert run.parse_args(["--scaling"]).scaling_worker_list == [1, 2, 4]


@pytest.mark.parametrize("argv", [
    ["--setups", "single,bogus"],
    ["--steps", "30", "--warmup_steps", "16"],  # steps not a multiple of the epoch
    ["--warmup_steps", "12", "--steps_per_execution", "8"],
    ["--memory", "--balance"],
    ["--global_batch", "1023"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def _fake_result(eps, role="chief"):
    return {"status": "ok", "examples_per_sec": eps, "timed_seconds": 2.0, "timed_steps": 64,
            "peak_rss_mb": {role: 500.0}, "tf_version": "2.15.1", "per_worker_batch": 512,
            "epoch_examples_per_sec": [eps], "timed_cpu_seconds": {role: 4.0},
            "examples_per_cpu_sec": eps / 2.0, "loadavg_start": 0.5}


def test_throughput_records_schema_and_ratios(monkeypatch, capsys, tmp_path):
    fake = {"single": 1000.0, "stock_pss": 400.0, "mwms": 300.0, "hybrid_sync": 900.0,
            "hybrid_sync_unstacked": 600.0, "hybrid_async": 950.0}

    def fake_run_job(job, args, num_workers, log_dir):
        if job["setup"] == "mwms":
            return {"status": "error", "error": "boom", "examples_per_sec": None,
                    "peak_rss_mb": {}}
        return _fake_result(fake[job["setup"]])

    monkeypatch.setattr(run, "run_job", fake_run_job)
    assert run.main(["--quick", "--log_dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert [r["setup"] for r in lines] == list(run.THROUGHPUT_SETUPS)
    for r in lines:
        for key in run.SCHEMA_KEYS:
            assert key in r, key
        assert r["knobs"]["steps_per_execution"] == 8
        assert r["machine"]["nproc"] >= 1
    by = {r["setup"]: r for r in lines}
    assert by["hybrid_sync"]["ratio_to_single"] == 0.9
    assert by["hybrid_sync"]["ratio_to_stock_pss"] == 2.25
    assert by["hybrid_sync_unstacked"]["ratio_to_stock_pss"] == 1.5
    assert by["mwms"]["status"] == "error" and by["mwms"]["examples_per_sec"] is None
    # Every line says which strategy options made its figure.
    assert by["hybrid_sync"]["strategy_options"] == {
        "embedding_updates": "sync", "sharding": None, "sparse_exchange": "ps",
        "stack_tables": True, "table_dtype": "float32", "dense_bucket_bytes": None,
        "dense_allreduce_dtype": None}
    assert all(r["policy"] == "float32" for r in lines)
    assert by["hybrid_sync"]["table_dtype"] == "float32" and by["single"]["table_dtype"] is None
    assert by["hybrid_sync"]["knobs"]["optimizer"] == "legacy.Adagrad(0.05)"
    assert by["hybrid_sync_unstacked"]["strategy_options"]["stack_tables"] is False
    assert by["hybrid_async"]["strategy_options"]["embedding_updates"] == "async"
    assert by["stock_pss"]["strategy_options"] is None
    assert "hybrid_sync" in err and "examples/s" in err


@pytest.mark.parametrize("argv, says", [
    (["--mixed_precision", "mixed_float16", "--setups", "hybrid_sync"], "--optimizer adagrad"),
    (["--table_dtype", "bfloat16"], "--optimizer adagrad"),
    (["--memory", "--table_dtype", "float32,float16"], "--optimizer adagrad"),
    (["--mixed_precision", "float64"], "--mixed_precision"),
    (["--table_dtype", "int8", "--optimizer", "adagrad"], "--table_dtype"),
    (["--mixed_precision", "mixed_float16", "--optimizer", "adagrad"], "drop them from --setups"),
    (["--memory", "--mixed_precision", "mixed_bfloat16"], "throughput mode only"),
    (["--network", "--mixed_precision", "mixed_bfloat16"], "throughput mode only"),
    (["--scaling", "--table_dtype", "bfloat16", "--optimizer", "adagrad"], "--table_dtype"),
    (["--optimizer", "adam"], "--optimizer"),
])
def test_precision_arguments_refused_with_the_fix(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_precision_variants_run_side_by_side(monkeypatch, capsys, tmp_path):
    """--mixed_precision and --table_dtype lists: every combination, each line says which."""
    jobs = []
    eps = {("float32", "float32"): 1000.0, ("float32", "bfloat16"): 900.0,
           ("mixed_bfloat16", "float32"): 500.0, ("mixed_bfloat16", "bfloat16"): 450.0}

    def fake_run_job(job, args, num_workers, log_dir):
        jobs.append(job)
        rate = eps[(job["mixed_precision"], job["table_dtype"])]
        return _fake_result(rate / (2 if job["setup"] == "single" else 1))

    monkeypatch.setattr(run, "run_job", fake_run_job)
    chart = tmp_path / "mp.png"
    assert run.main(["--quick", "--setups", "single,hybrid_sync", "--mixed_precision",
                     "float32,mixed_bfloat16", "--table_dtype", "float32,bfloat16",
                     "--optimizer", "adagrad", "--log_dir", str(tmp_path),
                     "--chart", str(chart)]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(ln) for ln in out.splitlines()]
    # Half-precision tables only where there are tables on a PS (the plugin's setups).
    assert [(r["setup"], r["policy"], r["table_dtype"]) for r in lines] == [
        ("single", "float32", None), ("hybrid_sync", "float32", "float32"),
        ("hybrid_sync", "float32", "bfloat16"), ("single", "mixed_bfloat16", None),
        ("hybrid_sync", "mixed_bfloat16", "float32"), ("hybrid_sync", "mixed_bfloat16",
                                                        "bfloat16")]
    assert [(j["mixed_precision"], j["table_dtype"], j["model"]["optimizer"]) for j in jobs] == [
        (p, d, "adagrad") for p in ("float32", "mixed_bfloat16")
        for d in ("float32", "float32", "bfloat16")]
    by = {(r["setup"], r["policy"], r["table_dtype"]): r for r in lines}
    half = by[("hybrid_sync", "float32", "bfloat16")]
    assert half["strategy_options"]["table_dtype"] == "bfloat16"
    assert half["ratio_to_float32"] == 0.9 and half["cpu_ratio_to_float32"] == 0.9
    mixed = by[("hybrid_sync", "mixed_bfloat16", "float32")]
    assert mixed["ratio_to_float32"] == 0.5
    assert mixed["ratio_to_single"] == 2.0  # Against single under the same policy.
    assert by[("hybrid_sync", "float32", "float32")]["ratio_to_float32"] is None
    assert all(r["knobs"]["optimizer"] == "Adagrad(0.05)" for r in lines)
    assert "hybrid_sync mixed_bfloat16 bfloat16 tables" in err
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_strategy_kwargs_leave_the_default_table_dtype_out():
    from benchmarks import procs

    job = {"setup": "hybrid_sync", "stack_tables": True}
    assert procs.strategy_options(job)["table_dtype"] == "float32"
    assert "table_dtype" not in procs.strategy_kwargs(job)  # A plugin before the option.
    assert procs.strategy_kwargs(dict(job, table_dtype="bfloat16"))["table_dtype"] == "bfloat16"
    # HybridOptions.dense_bucket_bytes: the default left out likewise; 0 (one pack) stated.
    assert procs.strategy_options(job)["dense_bucket_bytes"] is None
    assert "dense_bucket_bytes" not in procs.strategy_kwargs(job)
    assert procs.strategy_kwargs(dict(job, dense_bucket_bytes=0))["dense_bucket_bytes"] == 0
    # HybridOptions.dense_allreduce_dtype: None left out, a dtype stated.
    assert "dense_allreduce_dtype" not in procs.strategy_kwargs(job)
    assert procs.strategy_kwargs(dict(job, dense_allreduce_dtype="bfloat16"))[
        "dense_allreduce_dtype"] == "bfloat16"
    # The current plugin gets them as HybridOptions and a PlacementPolicy (no knob as a
    # keyword: deprecated); a plugin copy without HybridOptions as keywords.
    import types

    import tf_psplugin

    arguments = procs.strategy_arguments(
        dict(job, sharding="contiguous", sparse_exchange="allgather"), tf_psplugin)
    assert set(arguments) == {"options", "placement"}
    assert arguments["options"] == tf_psplugin.HybridOptions(
        stack_tables=True, experimental_sparse_exchange="allgather", log_placement=False)
    assert arguments["placement"].sharding == "contiguous"
    assert procs.strategy_arguments(job, tf_psplugin) == {
        "options": tf_psplugin.HybridOptions(log_placement=False)}
    old_plugin = types.SimpleNamespace(HybridParameterServerStrategy=None)
    assert procs.strategy_arguments(job, old_plugin) == dict(
        procs.strategy_kwargs(job), log_placement=False)
    # One log per variant of a run (not one per setup, overwritten by the next variant).
    assert procs.log_name(job) == "hybrid_sync"
    assert procs.log_name(dict(job, mixed_precision="mixed_float16", table_dtype="bfloat16")) \
        == "hybrid_sync-mixed_float16-bfloat16-tables"


def test_model_optimizers_and_policy():
    """Every --optimizer builds; under mixed_bfloat16 the logit stays float32."""
    import tensorflow as tf

    from benchmarks import child
    from benchmarks import model as model_lib

    assert sorted(model_lib.OPTIMIZERS) == sorted(run.OPTIMIZER_NAMES)
    with pytest.raises(ValueError, match="optimizer"):
        model_lib.ModelSpec(optimizer="adam")
    before = tf.keras.mixed_precision.global_policy()
    try:
        child.set_policy({"mixed_precision": "mixed_bfloat16"})
        assert tf.keras.mixed_precision.global_policy().name == "mixed_bfloat16"
        spec = model_lib.ModelSpec(vocab_size=10, embedding_dim=4, hidden=(8,),
                                   optimizer="adagrad")
        model = model_lib.build_model(spec)
        model_lib.compile_model(model, spec, 1)
        assert model.get_layer("mlp_0").compute_dtype == "bfloat16"
        assert model.get_layer("logit").compute_dtype == "float32"
        assert not isinstance(model.optimizer, tf.keras.optimizers.legacy.Optimizer)
    finally:
        tf.keras.mixed_precision.set_global_policy(before)


def test_slotless_sgd_makes_no_slot_and_updates_only_the_gradient_rows():
    """--optimizer sgd_noslot: Keras's SGD makes a momentum slot even at momentum=0; this none."""
    import numpy as np
    import tensorflow as tf

    from benchmarks import model as model_lib

    table = tf.Variable(np.ones([5, 2], np.float32))
    keras_sgd, slotless = tf.keras.optimizers.SGD(0.5), model_lib.SlotlessSGD(0.5)
    keras_sgd.build([table])
    slotless.build([table])
    assert len(keras_sgd.variables) == 2  # iterations and the momentum slot "m"
    assert len(slotless.variables) == 1  # iterations only
    grad = tf.IndexedSlices(tf.constant([[2.0, 4.0]]), tf.constant([3]), tf.constant([5, 2]))
    slotless.apply_gradients([(grad, table)])
    want = np.ones([5, 2], np.float32)
    want[3] = [0.0, -1.0]
    np.testing.assert_array_equal(table.numpy(), want)


def test_memory_with_half_precision_tables(monkeypatch, capsys, tmp_path):
    def fake_run_job(job, args, num_workers, log_dir):
        rows = job["model"]["vocab_size"] * 26
        per_row = {"float32": 16 * 8, "bfloat16": 16 * 6}[job["table_dtype"]]  # Adagrad.
        ps = 300.0 + rows / 2 * per_row / 2**20
        r = _fake_result(100.0)
        r["peak_rss_mb"] = {"chief": 500.0, "ps:0": ps, "ps:1": ps, "worker:0": 600.0,
                            "worker:1": 600.0}
        r["baseline_rss_mb"] = {"ps:0": 300.0, "ps:1": 300.0}
        return r

    monkeypatch.setattr(run, "run_job", fake_run_job)
    run.main(["--memory", "--memory_rows", "26000,260000", "--table_dtype", "float32,bfloat16",
              "--optimizer", "adagrad", "--log_dir", str(tmp_path)])
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(r["mode"], r.get("table_dtype")) for r in lines] == [
        ("memory", "float32"), ("memory", "float32"), ("memory", "bfloat16"),
        ("memory", "bfloat16"), ("memory_summary", None)]
    f32, bf16 = lines[1], lines[3]
    assert bf16["table_mb"] * 2 == pytest.approx(f32["table_mb"], abs=0.1)
    # Table + float32 Adagrad slot: 6 bytes per value against 8.
    assert bf16["table_plus_slots_per_ps_mb"] == pytest.approx(
        f32["table_plus_slots_per_ps_mb"] * 6 / 8, abs=0.1)
    assert f32["ps_growth_bytes_per_row"]["ps:0"] == pytest.approx(128.0, abs=0.1)
    assert bf16["ps_growth_over_share"]["ps:0"] == pytest.approx(1.0, abs=1e-3)
    assert bf16["strategy_options"]["table_dtype"] == "bfloat16"
    assert lines[-1]["ps_growth_per_row_over_float32"] == {"bfloat16 260000": 0.75,
                                                           "bfloat16 26000": 0.75}


def test_jobs_share_knobs():
    args = run.parse_args(["--quick"])
    jobs = [run.job_for(s, args, 2) for s in run.THROUGHPUT_SETUPS]
    assert {j["steps_per_execution"] for j in jobs} == {8}
    assert {j["global_batch"] for j in jobs} == {1024}
    assert {json.dumps(j["model"], sort_keys=True) for j in jobs} == {
        json.dumps(jobs[0]["model"], sort_keys=True)}
    assert [j["role"] for j in jobs] == ["single", "ps_chief", "mwms_worker", "ps_chief",
                                        "ps_chief", "ps_chief"]
    assert [j["stack_tables"] for j in jobs[3:]] == [True, False, True]
    assert [j["embedding_updates"] for j in jobs[3:]] == ["sync", "sync", "async"]


def test_memory_summary(monkeypatch, capsys, tmp_path):
    def fake_run_job(job, args, num_workers, log_dir):
        rows = job["model"]["vocab_size"] * 26
        ps = 300.0 + 2 * rows * 16 * 4 / 2 / 2**20
        r = _fake_result(100.0)
        r["peak_rss_mb"] = {"chief": 500.0, "ps:0": ps, "ps:1": ps, "worker:0": 600.0,
                            "worker:1": 610.0}
        r["baseline_rss_mb"] = {"ps:0": 300.0, "ps:1": 300.0}
        return r

    monkeypatch.setattr(run, "run_job", fake_run_job)
    run.main(["--memory", "--memory_rows", "26000,260000", "--log_dir", str(tmp_path)])
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in lines] == ["memory", "memory", "memory_summary"]
    assert lines[0]["table_rows"] == 26000
    assert lines[1]["ps_growth_over_share"]["ps:0"] == pytest.approx(1.0, abs=1e-3)
    assert lines[2]["worker_within_10pct"] is True


def test_balance_interleaved_beats_contiguous_on_frequency_sorted_ids():
    records = balance.measure(num_rows=10_000, num_features=2, batch=256, num_batches=4,
                              shard_counts=(2,), sources=("frequency_sorted",))
    by = {r["scheme"]: r for r in records}
    assert set(by) == {"contiguous", "interleaved"}
    assert sum(by["contiguous"]["lookups_per_shard"]) == 2 * 256 * 4
    assert by["interleaved"]["max_over_mean"] < by["contiguous"]["max_over_mean"]
    assert "max/mean" in balance.format_table(records)


def test_shard_lookup_counts_fallback_matches_definition():
    ids = np.array([0, 1, 2, 3, 4, 9])
    assert balance.shard_lookup_counts(ids, 10, 2, "interleaved").tolist() == [3, 3]
    assert balance.shard_lookup_counts(ids, 10, 2, "contiguous").tolist() == [5, 1]


@pytest.mark.slow
# The benchmarks run in .venv (TF 2.15, benchmarks/README.md); repeating the
# real mini run on the newest TF costs CI time and tests no benchmark code.
@pytest.mark.tf215_only
@pytest.mark.timeout(180)
def test_real_mini_run(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.run", "--setups", "single,hybrid_sync",
           "--steps", "8", "--warmup_steps", "8", "--steps_per_execution", "4",
           "--pool_batches", "2", "--vocab_size", "1000", "--timeout", "150",
           "--log_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=175)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(ln) for ln in done.stdout.splitlines()]
    assert [r["setup"] for r in lines] == ["single", "hybrid_sync"]
    for r in lines:
        assert r["status"] == "ok", r.get("error")
        assert r["examples_per_sec"] > 0 and r["steps"] == 8
    assert set(lines[1]["peak_rss_mb"]) == {"chief", "worker:0", "worker:1", "ps:0", "ps:1"}


def test_report_renders_every_mode(monkeypatch, capsys, tmp_path):
    from benchmarks import report

    monkeypatch.setattr(run, "run_job", lambda job, args, n, log_dir: _fake_result(1000.0))
    out = tmp_path / "r.jsonl"
    run.main(["--quick", "--setups", "single,stock_pss", "--log_dir", str(tmp_path),
              "--output", str(out)])
    records = [json.loads(ln) for ln in out.read_text().splitlines()]
    records += balance.measure(num_rows=1000, num_features=1, batch=64, num_batches=1,
                               shard_counts=(2,), sources=("frequency_sorted",))
    text = report.render(records)
    assert "| single | 1000 |" in text and "| frequency_sorted | 2 | interleaved |" in text
    assert text.startswith("Machine: ")


def test_throughput_run_writes_a_bar_chart_and_report_redraws_it(monkeypatch, capsys,
                                                                 tmp_path):
    """--chart on a throughput run, and `report --chart` from its JSON lines."""
    from benchmarks import report

    def fake_run_job(job, args, num_workers, log_dir):
        if job["setup"] == "mwms":  # A failed setup is labelled, not drawn.
            return {"status": "error", "error": "boom", "examples_per_sec": None,
                    "peak_rss_mb": {}}
        return _fake_result({"single": 1000.0, "stock_pss": 400.0}.get(job["setup"], 600.0))

    monkeypatch.setattr(run, "run_job", fake_run_job)
    out, chart = tmp_path / "r.jsonl", tmp_path / "sub" / "bars.png"
    assert run.main(["--quick", "--repeats", "2", "--log_dir", str(tmp_path),
                     "--output", str(out), "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000
    redrawn = tmp_path / "again.png"
    assert report.main([str(out), "--chart", str(redrawn)]) == 0
    assert redrawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| hybrid_sync | 600 |" in capsys.readouterr().out


def test_checkpoint_saves_summary_per_100_saves():
    from benchmarks import checkpoint_saves

    result = {"first": {"ps0": 400.0, "ps1": 410.0, "chief": 500.0},
              "last": {"ps0": 460.0, "ps1": 410.0, "chief": 530.0},
              "seconds": 20.0, "exact": True}
    rec = checkpoint_saves.summarize("tf_checkpoint", 200, 20, result)
    assert rec["ps0_rss_mb_per_100_saves"] == 30.0
    assert rec["ps1_rss_mb_per_100_saves"] == 0.0
    assert rec["chief_rss_mb_per_100_saves"] == 15.0
    assert rec["seconds_per_save"] == 0.1 and rec["restore_exact"] is True
    with pytest.raises(SystemExit):
        checkpoint_saves.main(["--saves", "0"])


def test_dynamic_table_ops_times_every_mechanism_in_process(tmp_path):
    """--local: every mechanism runs and the stored keys survive a checkpoint."""
    from benchmarks import dynamic_table_ops

    args = dynamic_table_ops.build_parser().parse_args(
        ["--local", "--keys_per_call", "256", "--capacity", "1000", "--distinct", "500",
         "--batches", "2", "--repeats", "1"])
    records = dynamic_table_ops.measure(args, "/CPU:0", str(tmp_path))
    by = {r.get("mechanism", r["mode"]): r for r in records}
    assert set(dynamic_table_ops.MECHANISMS) <= set(by)
    assert by["static_gather"]["ratio_to_static_gather"] == 1.0
    assert all(by[m]["ms_per_call"] > 0 for m in dynamic_table_ops.MECHANISMS)
    summary = by["dynamic_table_ops_summary"]
    assert 0 < summary["keys_stored"] <= 500
    assert summary["keys_restored_from_checkpoint"] == summary["keys_stored"]
    assert summary["dht_keys_stored"] == summary["keys_stored"]


def test_dynamic_mode_compares_both_tables_and_draws_them(monkeypatch, capsys, tmp_path):
    """--dynamic: the same hybrid_sync job with a hashed and a dynamic table."""
    jobs = []

    def fake_run_job(job, args, num_workers, log_dir):
        jobs.append(job)
        variant = job["model"]["variant"]
        result = _fake_result(1000.0 if variant == "hashed" else 800.0)
        result["peak_rss_mb"] = {"chief": 500.0, "ps:0": 300.0, "ps:1": 310.0}
        result["heldout_auc"] = 0.70 if variant == "hashed" else 0.71
        if variant == "dynamic":
            result["table_size"] = 1000
            result["table_stats"] = [{"shard": 0, "size": 1000, "admitted": 1500,
                                      "evicted": 500, "rejected": 0}]
        return result

    monkeypatch.setattr(run, "run_job", fake_run_job)
    chart = tmp_path / "dyn.png"
    assert run.main(["--dynamic", "--quick", "--capacity", "4096", "--admit_after", "2",
                     "--log_dir", str(tmp_path), "--chart", str(chart)]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert [r.get("setup") for r in lines] == ["hashed", "dynamic", None]
    assert {j["setup"] for j in jobs} == {"hybrid_sync"}
    assert [j["model"]["variant"] for j in jobs] == ["hashed", "dynamic"]
    assert all(j["model"]["capacity"] == 4096 and j["model"]["admit_after"] == 2 for j in jobs)
    assert all(j["heldout_batches"] == 8 for j in jobs)
    summary = lines[-1]
    assert summary["step_time_ratio_dynamic_over_hashed"] == 1.25
    assert summary["target_met"] is True
    assert summary["heldout_auc_dynamic_minus_hashed"] == 0.01
    assert summary["ps_peak_rss_mb_total"] == {"hashed": 610.0, "dynamic": 610.0}
    assert lines[1]["table_stats"][0]["evicted"] == 500
    assert "step time dynamic / hashed: 1.25" in err
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_raw_key_variants_build_and_feed_raw_ids():
    import tensorflow as tf

    from benchmarks import model as model_lib

    ids = tf.constant([[0, 1], [1, 0]], tf.int64)
    keys = model_lib.raw_keys(ids).numpy()
    assert keys.min() >= 0 and keys.max() < 2**40
    assert len(set(keys.ravel().tolist())) == 4  # distinct per (feature, id)
    for variant in model_lib.RAW_KEY_VARIANTS:
        spec = model_lib.ModelSpec(vocab_size=50, num_categorical=2, embedding_dim=4,
                                   hidden=(8,), variant=variant, capacity=64)
        model = model_lib.build_model(spec)
        out = model({"dense": tf.zeros([2, model_lib.NUM_DENSE]), "categorical": keys})
        assert out.shape == (2, 1)


def test_lookup_ablation_variants_drop_only_the_lookup_or_the_push():
    """local_rows: no table, no row gradient to any table; no_push: tables, no gradient to them.

    Both still compute the first MLP layer's input gradient (the baseline's
    dense work): the scalar `AblationScale` gets a gradient through the rows.
    """
    import tensorflow as tf

    from benchmarks import model as model_lib

    x = {"dense": tf.ones([3, model_lib.NUM_DENSE]),
         "categorical": tf.constant([[0, 49], [7, 1], [2, 2]], tf.int64)}
    grads = {}
    for variant in ("baseline",) + model_lib.ABLATION_VARIANTS:
        spec = model_lib.ModelSpec(vocab_size=50, num_categorical=2, embedding_dim=4,
                                   hidden=(8,), variant=variant)
        model = model_lib.build_model(spec)
        with tf.GradientTape() as tape:
            out = model(x)
            loss = tf.reduce_sum(out * out)
        names = [v.name for v in model.trainable_variables]
        grads[variant] = dict(zip(names, tape.gradient(loss, model.trainable_variables)))
        assert out.shape == (3, 1)
    tables = [n for n in grads["baseline"] if "embeddings" in n]
    assert len(tables) == 2 and all(grads["baseline"][n] is not None for n in tables)
    assert not any("embeddings" in n for n in grads["local_rows"])  # No table at all.
    no_push_tables = [n for n in grads["no_push"] if "embeddings" in n]
    assert no_push_tables == tables and all(grads["no_push"][n] is None for n in tables)
    for variant in model_lib.ABLATION_VARIANTS:
        scale = [g for n, g in grads[variant].items() if "scale" in n]
        assert len(scale) == 1 and float(scale[0]) != 0.0  # Row gradient computed.


def test_ablation_interleaves_dense_bucket_sizes_and_records_them(monkeypatch, capsys, tmp_path):
    from benchmarks import ablation

    order = []

    def fake_run_job(job, args, num_workers, log_dir):
        order.append(job["dense_bucket_bytes"])
        return _fake_result(100.0 + (job["dense_bucket_bytes"] > 0))

    monkeypatch.setattr(run, "run_job", fake_run_job)
    monkeypatch.setattr(run, "plugin_revision", lambda: "rev")
    assert ablation.main(["--setup", "hybrid_sync", "--dense_bucket_bytes", "0,4096",
                          "--repeats", "2", "--log_dir", str(tmp_path)]) == 0
    assert order == [0, 4096, 0, 4096]  # Interleaved, so load hits both alike.
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["strategy_options"]["dense_bucket_bytes"] for r in lines] == [0, 4096]
    assert [r["runs_examples_per_sec"] for r in lines] == [[100.0, 100.0], [101.0, 101.0]]
