"""Fast tests of `benchmarks.time_to_auc`: AUC, crossing, summary ratios, arguments, files.

No cluster is started: `main` runs with a fake runner that replays
evaluation lines, so the JSON lines and the result files are checked end to
end. The real (loopback) run is tests/cluster/test_time_to_auc_smoke.py.
"""

import itertools
import json
import os

import numpy as np
import pytest

from benchmarks import time_to_auc as tta


def _pairwise_auc(labels, scores):
    """The definition: P(score of a positive > score of a negative), ties half."""
    pos = [s for y, s in zip(labels, scores) if y]
    neg = [s for y, s in zip(labels, scores) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_matches_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    scores = np.round(rng.normal(size=300) + 0.8 * labels, 1)  # Rounded: many ties.
    assert len(np.unique(scores)) < 100
    assert tta.auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_auc_extremes_and_errors():
    assert tta.auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert tta.auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert tta.auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        tta.auc([1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        tta.auc([0, 1], [0.1])


def _evals(setup, w, points):
    return [{"kind": "time_to_auc_eval", "setup": setup, "num_workers": w, "seconds": s,
             "steps": 50 * (i + 1), "examples": 50 * (i + 1) * 256 * w, "auc": a}
            for i, (s, a) in enumerate(points)]


def test_first_crossing_is_the_first_evaluation_at_or_above_target():
    rows = _evals("hybrid_sync", 2, [(10, 0.70), (20, 0.77), (30, 0.76), (40, 0.78)])
    assert tta.first_crossing(rows, 0.77)["seconds"] == 20  # At, not above: counts.
    assert tta.first_crossing(list(reversed(rows)), 0.775)["seconds"] == 40  # Clock order.
    assert tta.first_crossing(rows, 0.79) is None


def test_summary_ratios_when_both_reach_the_target():
    evals = (_evals("hybrid_sync", 2, [(10, 0.70), (20, 0.771)])
             + _evals("stock_pss", 2, [(20, 0.70), (40, 0.75), (80, 0.772)]))
    by = {s["setup"]: s for s in tta.summarize(evals, 0.77, 100)}
    sync, stock = by["hybrid_sync"], by["stock_pss"]
    assert sync["reached"] and sync["seconds_to_target"] == 20 and sync["steps_to_target"] == 100
    assert sync["ratio_to_stock_pss"] == 0.25  # 20 s / 80 s
    assert sync["examples_ratio_to_stock_pss"] == pytest.approx(
        sync["examples_to_target"] / stock["examples_to_target"], abs=1e-3)
    assert sync["ratio_to_stock_pss_at_most"] is None
    assert stock["ratio_to_stock_pss"] == 1.0
    assert sync["max_auc"] == 0.771 and stock["final_auc"] == 0.772


def test_summary_bounds_the_ratio_when_stock_pss_does_not_reach_it():
    evals = (_evals("hybrid_async", 8, [(30, 0.775)])
             + _evals("stock_pss", 8, [(50, 0.70), (120, 0.74)]))
    by = {s["setup"]: s for s in tta.summarize(evals, 0.77, 120)}
    assert by["stock_pss"]["reached"] is False
    assert by["stock_pss"]["seconds_to_target"] is None
    assert by["hybrid_async"]["ratio_to_stock_pss"] is None
    assert by["hybrid_async"]["ratio_to_stock_pss_at_most"] == 0.25  # 30 s / 120 s, not reached
    assert by["stock_pss"]["ratio_to_stock_pss_at_most"] is None


def test_summary_not_reached_has_no_ratio_and_groups_by_workers():
    evals = (_evals("hybrid_sync", 2, [(10, 0.70)]) + _evals("stock_pss", 2, [(10, 0.78)])
             + _evals("hybrid_sync", 8, [(5, 0.78)]))
    out = tta.summarize(evals, 0.77, 60)
    assert [(s["num_workers"], s["setup"]) for s in out] == [
        (2, "hybrid_sync"), (2, "stock_pss"), (8, "hybrid_sync")]
    assert out[0]["reached"] is False and out[0]["ratio_to_stock_pss"] is None
    assert out[2]["ratio_to_stock_pss"] is None  # No stock PSS at W=8.


@pytest.mark.parametrize("argv, says", [
    (["--setups", "hybrid_sync,mwms"], "--setups"),
    (["--workers", "2,x"], "--workers"),
    (["--workers", "0"], "--workers"),
    (["--eval_every_steps", "15", "--steps_per_execution", "10"], "multiple of"),
    (["--target_auc", "0.5"], "--target_auc"),
    (["--target_auc", "1.2"], "--target_auc"),
    (["--max_seconds", "0"], "--max_seconds"),
    (["--per_worker_batch", "0"], "--per_worker_batch"),
    (["--learning_rate", "-1"], "--learning_rate"),
    (["--link_mbit", "-5"], "--link_mbit"),
])
def test_bad_arguments_exit_2_naming_the_field(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        tta.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_defaults_are_the_demo_and_the_issue():
    args = tta.parse_args([])
    assert args.setup_list == list(tta.SETUPS) and args.worker_list == [2]
    assert (args.per_worker_batch, args.learning_rate, args.vocab_size) == (256, 0.3, 10_000)
    assert (args.target_auc, args.link_mbit, args.num_ps) == (0.77, 50.0, 2)
    assert args.timeout == 2 * args.max_seconds + 600
    job = tta.job_for("hybrid_async", 8, args)
    assert job["embedding_updates"] == "async" and job["num_workers"] == 8
    assert tta.strategy_record("stock_pss") is None
    assert tta.strategy_record("hybrid_sync")["embedding_updates"] == "sync"
    # --dense_allreduce_dtype: the dense gradients in 16 bits, in the job and the record.
    assert job["dense_allreduce_dtype"] is None
    assert tta.strategy_record("hybrid_sync")["dense_allreduce_dtype"] is None
    args = tta.parse_args(["--dense_allreduce_dtype", "bfloat16"])
    assert tta.job_for("hybrid_sync", 2, args)["dense_allreduce_dtype"] == "bfloat16"
    assert tta.strategy_record("hybrid_sync", "bfloat16")["dense_allreduce_dtype"] == "bfloat16"


def test_main_writes_complete_lines_and_files(monkeypatch, capsys, tmp_path):
    curves = {"hybrid_sync": [(12.0, 0.74), (24.0, 0.772)],
              "hybrid_async": [(10.0, 0.75), (20.0, 0.771)],
              "stock_pss": [(30.0, 0.72), (60.0, 0.765), (90.0, 0.78)]}

    def fake_runner(job, args, log_dir, on_eval):
        for i, (seconds, value) in enumerate(curves[job["setup"]]):
            on_eval({"seconds": seconds, "steps": 50 * (i + 1), "examples": 25600 * (i + 1),
                     "auc": value, "eval_seconds": 0.2, "train_loss": 0.5, "loadavg": 9.5})
        return {"startup_seconds": 4.0, "peak_rss_mb": 900.0, "tf_version": "2.15.1",
                "examples_per_step": 512, "steps_per_epoch": 50}

    monkeypatch.setattr(tta, "run_emulated", fake_runner)
    # Each setup: 10 s of wall time, 20 busy CPU-seconds of the box of which this run's 9:
    # others used 11 of the 2 cores' 20 CPU-seconds.
    snapshots = iter({"busy": 20.0 * i, "own": 9.0 * i, "wall": 10.0 * i} for i in range(6))
    monkeypatch.setattr(tta, "cpu_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(tta.os, "cpu_count", lambda: 2)
    code = tta.main(["--results_dir", str(tmp_path), "--name", "t", "--log_dir",
                     str(tmp_path / "logs")])
    assert code == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    kinds = [r["kind"] for r in lines]
    assert kinds == ["time_to_auc_run"] + ["time_to_auc_eval"] * 7 + ["time_to_auc_summary"] * 3
    run = lines[0]
    assert run["options"]["target_auc"] == 0.77 and run["options"]["hosts"] == "emulated"
    assert "loadavg_at_start" in run["machine"]
    for r in lines[1:8]:
        assert {"setup", "num_workers", "seconds", "steps", "examples", "auc"} <= set(r)
    by = {r["setup"]: r for r in lines[8:]}
    assert by["hybrid_sync"]["seconds_to_target"] == 24.0
    assert by["hybrid_sync"]["ratio_to_stock_pss"] == round(24.0 / 90.0, 3)
    assert by["hybrid_async"]["ratio_to_stock_pss"] == round(20.0 / 90.0, 3)
    assert by["stock_pss"]["strategy_options"] is None and by["stock_pss"]["tf_version"] == "2.15.1"
    assert by["hybrid_async"]["strategy_options"]["embedding_updates"] == "async"
    assert by["hybrid_sync"]["startup_seconds"] == 4.0 and by["hybrid_sync"]["global_batch"] == 512
    with open(tmp_path / "t.jsonl", encoding="utf-8") as f:
        assert [json.loads(ln) for ln in f] == lines
    md = (tmp_path / "t.md").read_text(encoding="utf-8")
    nproc = run["machine"]["nproc"]
    assert by["stock_pss"]["other_cpu_share"] == round(11.0 / (10.0 * nproc), 3)
    assert "Measured under load" in md and "| 2 | hybrid_sync | 24.0 |" in md and "0.27x" in md
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / "t.png") > 1000


def test_main_reports_a_failed_setup_and_exits_1(monkeypatch, capsys, tmp_path):
    from benchmarks import procs

    def fake_runner(job, args, log_dir, on_eval):
        raise procs.BenchmarkProcessError("chief exited 1; log x:\nboom")

    monkeypatch.setattr(tta, "run_loopback", fake_runner)
    code = tta.main(["--hosts", "loopback", "--setups", "stock_pss", "--results_dir",
                     str(tmp_path), "--name", "t", "--log_dir", str(tmp_path / "logs")])
    assert code == 1
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert lines[-1]["kind"] == "time_to_auc_summary" and "boom" in lines[-1]["error"]
    assert "failed: chief exited 1" in (tmp_path / "t.md").read_text(encoding="utf-8")


def test_summary_records_lower_milestones():
    evals = (_evals("hybrid_sync", 2, [(10, 0.745), (20, 0.761), (30, 0.765)])
             + _evals("stock_pss", 2, [(15, 0.75), (40, 0.758)]))
    by = {s["setup"]: s for s in tta.summarize(evals, 0.77, 30, milestones=(0.74, 0.76))}
    assert by["hybrid_sync"]["seconds_to"] == {"0.74": 10, "0.76": 20}
    assert by["hybrid_sync"]["examples_to"]["0.76"] == 2 * 50 * 256 * 2
    assert by["stock_pss"]["seconds_to"] == {"0.74": 15, "0.76": None}
    assert not any(s["reached"] for s in by.values())


@pytest.mark.parametrize("milestones", ["0.7,x", "0.4"])
def test_bad_milestones_exit_2(milestones, capsys):
    with pytest.raises(SystemExit):
        tta.parse_args(["--milestones", milestones])
    assert "--milestones" in capsys.readouterr().err


def test_resummarize_rewrites_the_summaries_from_the_lines(monkeypatch, capsys, tmp_path):
    def fake_runner(job, args, log_dir, on_eval):
        for i, value in enumerate((0.745, 0.752, 0.761)):
            on_eval({"seconds": 10.0 * (i + 1), "steps": 10 * (i + 1),
                     "examples": 5120 * (i + 1), "auc": value, "loadavg": 3.0})
        return {"startup_seconds": 4.0, "peak_rss_mb": 900.0, "tf_version": "2.15.1",
                "examples_per_step": 512, "steps_per_epoch": 10}

    monkeypatch.setattr(tta, "run_loopback", fake_runner)
    assert tta.main(["--hosts", "loopback", "--setups", "hybrid_sync,stock_pss",
                     "--milestones", "", "--results_dir", str(tmp_path), "--name", "r",
                     "--log_dir", str(tmp_path / "logs")]) == 0
    first = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert "seconds_to" not in first[-1]
    assert tta.main(["--resummarize", str(tmp_path / "r.jsonl"), "--results_dir",
                     str(tmp_path)]) == 0
    again = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["setup"] for r in again] == ["hybrid_sync", "stock_pss"]
    assert again[0]["seconds_to"]["0.75"] == 20.0 and again[0]["startup_seconds"] == 4.0
    with open(tmp_path / "r.jsonl", encoding="utf-8") as f:
        rewritten = [json.loads(ln) for ln in f]
    assert rewritten[:7] == first[:7] and rewritten[7:] == again  # Run and evals kept.
    assert "AUC 0.76" in (tmp_path / "r.md").read_text(encoding="utf-8")


def test_sqrt_rule_scales_only_the_hybrid_setups_rate():
    assert tta.learning_rate("stock_pss", 8, 0.3, "sqrt") == 0.3
    assert tta.learning_rate("hybrid_sync", 8, 0.3, "sqrt") == pytest.approx(0.3 * 8 ** 0.5)
    assert tta.learning_rate("hybrid_async", 4, 0.3, "sqrt") == pytest.approx(0.6)
    assert tta.learning_rate("hybrid_sync", 8, 0.3, "same") == 0.3
    with pytest.raises(ValueError, match="lr_rule"):
        tta.learning_rate("hybrid_sync", 8, 0.3, "linear")
    args = tta.parse_args(["--lr_rule", "sqrt", "--workers", "4"])
    assert tta.job_for("hybrid_sync", 4, args)["learning_rate"] == pytest.approx(0.6)
    assert tta.job_for("stock_pss", 4, args)["learning_rate"] == 0.3
    assert tta.job_for("hybrid_sync", 4, args)["hybrid_input"] == "self_sharded"


def test_each_worker_reads_the_global_batches_the_demo_dataset_gives_it():
    # Worker i of W reads global batches i, i + W, ... whether it generates
    # only its own (self_sharded) or the demo's whole stream is sharded.
    import tensorflow as tf

    from benchmarks import auc_chief
    from tf_psplugin.data import SyntheticCTR

    job = {"vocab_size": 100, "seed": 3, "per_worker_batch": 8, "num_workers": 3}
    demo = list(SyntheticCTR(vocab_size=100, seed=3).dataset(8).take(8))
    for worker in range(3):
        creator = auc_chief.sharded_dataset(job, lambda ctx, worker=worker: worker)
        mine = list(creator(tf.distribute.InputContext()).take(2))
        for k, (features, label) in enumerate(mine):
            want_features, want_label = demo[worker + 3 * k]
            np.testing.assert_array_equal(features["categorical"],
                                          want_features["categorical"])
            np.testing.assert_array_equal(features["dense"], want_features["dense"])
            np.testing.assert_array_equal(label, want_label)


def test_other_cpu_share_is_the_box_busy_time_not_this_runs():
    before = {"busy": 100.0, "own": 40.0, "wall": 0.0}
    after = {"busy": 130.0, "own": 68.0, "wall": 20.0}   # 30 busy, 28 of them this run's
    assert tta.other_cpu_share(before, after, 2) == pytest.approx(2.0 / 40.0)
    assert tta.other_cpu_share(before, dict(after, own=75.0), 2) == 0.0  # Never negative.
    snap = tta.cpu_snapshot()
    assert snap["busy"] > 0 and snap["own"] > 0


def test_a_high_load_from_the_runs_own_processes_is_a_quiet_box():
    run = {"options": dict(tta.options(tta.parse_args([])), name="t"), "argv": [], "name": "t",
           "machine": {"date": "d", "plugin": "p", "nproc": 2, "loadavg_at_start": [0.4]}}
    evals = [{"setup": "hybrid_sync", "num_workers": 2, "seconds": 5.0, "steps": 10,
              "examples": 5120, "auc": 0.6, "loadavg": 11.0}]
    summary = dict(tta.summarize(evals, 0.77, 60.0)[0])
    quiet = tta.markdown(run, evals, [dict(summary, other_cpu_share=0.03)])
    assert "Quiet box" in quiet and "Other processes used 3-3%" in quiet
    assert "own processes count in it" in quiet
    busy = tta.markdown(run, evals, [dict(summary, other_cpu_share=0.3)])
    assert "Measured under load" in busy
    # Lines written before the share was recorded: the load-average rule.
    assert "Measured under load" in tta.markdown(run, evals, [summary])
