"""Fast tests of the soak harness: statistics on synthetic samples, arguments, chart.

No cluster and no TF server is started: `benchmarks.soak_stats` works on the
``soak_sample`` dicts alone, and `main` is run with a fake `run_setup`.
"""

import json
import os
import sys

import pytest

from benchmarks import soak
from benchmarks import soak_stats as stats

TASKS = ("chief", "worker:0", "worker:1", "ps:0", "ps:1")
TRAIN_START = 5.0  # model.fit begins (chief's first progress line, 0 steps).
FIRST_EPOCH_END = 10.0  # Warm-up counts from here.


def _samples(seconds=600.0, interval=5.0, setup="hybrid_sync", threads=None, rss=None,
             eps=None):
    """Synthetic samples: every task flat unless `threads`/`rss(task, t)` say otherwise.

    `eps(t)` is the training rate (examples/s) at time t; each sample sees an
    epoch that ended exactly at its own time.
    """
    threads = threads or (lambda task, t: 50)
    rss = rss or (lambda task, t: 500.0)
    eps = eps or (lambda t: 1000.0)
    out, examples, prev = [], 0.0, TRAIN_START
    t = 0.0
    while t <= seconds + 1e-9:
        started, epoch = t >= TRAIN_START, t >= FIRST_EPOCH_END
        if started:
            examples += eps(t) * (t - prev)
            prev = t
        out.append({
            "kind": "soak_sample", "setup": setup, "t_s": t,
            "train_start_s": TRAIN_START if started else None,
            "first_epoch_end_s": FIRST_EPOCH_END if epoch else None,
            "steps": int(examples // 1024), "examples": examples,
            "progress_t_s": t if started else None,
            "examples_per_sec": eps(t) if epoch else None,
            "tasks": {task: {"threads": threads(task, t), "rss_mb": rss(task, t), "fds": 40}
                      for task in TASKS}})
        t += interval
    return out


WARMUP = 60.0


def test_flat_series_meets_every_target():
    s = stats.summarize(_samples(), "hybrid_sync", WARMUP, minutes_requested=10)
    assert s["completed"] is True and s["targets_met"] is True
    assert s["verdicts"] == {"threads_growth_ok": True, "fds_growth_ok": True,
                             "rss_growth_ok": True, "throughput_ok": True}
    assert set(s["growth"]) == {"chief", "worker", "ps"}
    for role in s["growth"].values():
        assert role["threads_growth_pct"] == 0 and role["rss_growth_pct_per_hour"] == 0
    assert s["throughput_ratio"] == pytest.approx(1.0)
    assert s["examples_per_sec_first"] == pytest.approx(1000.0)
    assert s["warmup_end_s"] == FIRST_EPOCH_END + WARMUP
    assert (s["train_start_s"], s["first_epoch_end_s"]) == (TRAIN_START, FIRST_EPOCH_END)
    assert s["post_warmup_samples"] == len([x for x in _samples() if x["t_s"] >= 70.0])
    assert s["minutes"] == pytest.approx((600.0 - TRAIN_START) / 60, abs=0.01)


def test_samples_after_the_last_epoch_are_not_training():
    # The chief idles 100 s after its last epoch (leaving model.fit); threads
    # drop then. Only samples up to the last progress line count.
    samples = _samples(seconds=700.0, threads=lambda task, t: 50 if t <= 600 else 20)
    for x in samples:
        if x["t_s"] > 600:
            x.update(progress_t_s=600.0, examples=samples[120]["examples"],
                     steps=samples[120]["steps"])
    s = stats.summarize(samples, "hybrid_sync", WARMUP)
    assert s["post_warmup_samples"] == len([x for x in samples if 70 <= x["t_s"] <= 600])
    assert s["verdicts"]["threads_growth_ok"] is True
    assert s["growth"]["worker"]["threads_first_last"] == [50, 50]
    assert s["throughput_ratio"] == pytest.approx(1.0)


def test_worker_thread_leak_fails_the_thread_verdict_and_names_the_worker():
    leak = lambda task, t: 100 + int(t) if task == "worker:1" else 100  # noqa: E731
    s = stats.summarize(_samples(threads=leak), "hybrid_sync", WARMUP)
    assert s["verdicts"]["threads_growth_ok"] is False
    assert s["verdicts"]["rss_growth_ok"] is True and s["verdicts"]["throughput_ok"] is True
    assert s["targets_met"] is False and s["completed"] is True
    worker = s["growth"]["worker"]
    assert worker["worst_task"] == "worker:1"
    # First quarter of the post-warm-up samples (t 70..200) has median ~135 s of
    # leak, the last 10% (t 545..600) ~575 s: (100+575)/(100+135) - 1 = 187%.
    first, last = worker["threads_first_last"]
    assert first == pytest.approx(100 + 135, abs=3) and last == pytest.approx(100 + 575, abs=3)
    assert worker["threads_growth_pct"] == pytest.approx(100 * (last - first) / first, abs=0.01)
    assert s["growth"]["ps"]["threads_growth_pct"] == 0
    assert s["growth"]["chief"]["threads_growth_pct"] == 0


def test_thread_growth_during_warmup_only_is_not_a_leak():
    ramp = lambda task, t: 50 + int(min(t, 60.0))  # noqa: E731  # Pools filled by t = 60 s.
    samples = _samples(seconds=200.0, threads=ramp)
    s = stats.summarize(samples, "hybrid_sync", WARMUP)
    assert s["verdicts"]["threads_growth_ok"] is True
    # With no warm-up excluded, the first quarter (t 10..55 s) is on the ramp.
    s0 = stats.summarize(samples, "hybrid_sync", 0.0)
    assert s0["verdicts"]["threads_growth_ok"] is False
    assert s0["growth"]["worker"]["threads_first_last"] == [82.5, 110]


def test_growing_rss_extrapolates_to_percent_per_hour():
    growing = lambda task, t: 1000.0 + 0.05 * t if task == "ps:0" else 1000.0  # noqa: E731
    s = stats.summarize(_samples(rss=growing), "hybrid_sync", WARMUP)
    post_t = [x["t_s"] for x in _samples() if x["t_s"] >= FIRST_EPOCH_END + WARMUP]
    mean_rss = 1000.0 + 0.05 * sum(post_t) / len(post_t)
    expected = 0.05 * 3600 / mean_rss * 100  # ~17.5 %/h
    assert s["growth"]["ps"]["rss_growth_pct_per_hour"] == pytest.approx(expected, rel=1e-3)
    assert s["growth"]["worker"]["rss_growth_pct_per_hour"] == 0
    assert s["verdicts"]["rss_growth_ok"] is False
    slow = lambda task, t: 1000.0 + 0.005 * t  # noqa: E731  # ~1.8 %/h: within 5 %/h.
    s_slow = stats.summarize(_samples(rss=slow), "hybrid_sync", WARMUP)
    assert 1.5 < s_slow["growth"]["chief"]["rss_growth_pct_per_hour"] < 2.0
    assert s_slow["verdicts"]["rss_growth_ok"] is True


def test_throughput_drop_fails_the_throughput_verdict():
    drop = lambda t: 1000.0 if t < 300 else 800.0  # noqa: E731
    s = stats.summarize(_samples(eps=drop), "hybrid_sync", WARMUP)
    assert "quarter" in s["throughput_windows"]
    assert s["examples_per_sec_first"] == pytest.approx(1000.0, rel=0.01)
    assert s["examples_per_sec_last"] == pytest.approx(800.0, rel=0.01)
    assert s["throughput_ratio"] == pytest.approx(0.8, rel=0.01)
    assert s["verdicts"]["throughput_ok"] is False
    assert s["verdicts"]["threads_growth_ok"] is True


def test_long_runs_use_five_minute_windows():
    drop = lambda t: 1000.0 if t < 1500 else 960.0  # noqa: E731
    s = stats.summarize(_samples(seconds=2400.0, interval=10.0, eps=drop), "hybrid_sync", 300.0)
    assert s["throughput_windows"] == "first/last 5 min after warm-up"
    assert s["window_seconds"] == 300.0
    assert s["throughput_ratio"] == pytest.approx(0.96, rel=1e-3)
    assert s["verdicts"]["throughput_ok"] is True


def test_task_death_means_not_completed():
    death = {"role": "worker:1", "pid": 123, "t_s": 200.0, "exit_code": -9}
    samples = [x for x in _samples() if x["t_s"] <= 200.0]
    s = stats.summarize(samples, "hybrid_sync", WARMUP, task_deaths=[death],
                        failure="task died: worker:1")
    assert s["completed"] is False and s["targets_met"] is False
    assert s["task_deaths"] == [death] and s["failure"] == "task died: worker:1"
    assert stats.summarize([], "stock_pss", WARMUP, failure="servers did not start")[
        "completed"] is False


def test_too_few_samples_gives_no_verdict():
    samples = [x for x in _samples() if x["t_s"] <= 80.0]  # 3 post-warm-up samples.
    s = stats.summarize(samples, "hybrid_sync", WARMUP)
    assert s["verdicts"]["threads_growth_ok"] is None and s["targets_met"] is False


def test_interpolated_window_rate():
    points = [(0.0, 0.0), (10.0, 1000.0), (20.0, 3000.0)]
    assert stats.examples_at(points, 5.0) == 500.0
    assert stats.window_rate(points, 5.0, 15.0) == pytest.approx((2000.0 - 500.0) / 10.0)
    assert stats.window_rate(points, 15.0, 99.0) == pytest.approx(200.0)  # Clipped at 20 s.
    assert stats.rate_of_latest(points) == 200.0
    assert stats.rate_of_latest(points[:1]) is None


def test_defaults_quick_and_warmup():
    args = soak.parse_args([])
    assert args.minutes == 20 and args.warmup_minutes == pytest.approx(20 / 6)
    assert args.setup_list == ["hybrid_sync", "stock_pss"] and args.interval == 5.0
    assert args.chart.endswith(os.path.join("benchmarks", "results", "soak.png"))
    quick = soak.parse_args(["--quick"])
    assert quick.minutes == 3 and quick.warmup_minutes == pytest.approx(0.5)
    assert soak.parse_args(["--minutes", "60"]).warmup_minutes == 5.0
    assert soak.parse_args(["--minutes", "2", "--warmup_minutes", "0"]).warmup_minutes == 0


@pytest.mark.parametrize("argv", [
    ["--setups", "hybrid_sync,bogus"],
    ["--quick", "--minutes", "5"],
    ["--minutes", "0"],
    ["--interval", "0"],
    ["--minutes", "2", "--warmup_minutes", "3"],
    ["--steps_per_epoch", "100"],  # Not a multiple of steps_per_execution 8.
    ["--global_batch", "1023"],
    ["--minutes", "ten"],
    ["--epoch_pass"],  # One pass per epoch needs --pool_batches == --steps_per_epoch.
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        soak.parse_args(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_chief_job_is_the_benchmark_job_for_a_duration():
    from benchmarks import run

    args = soak.parse_args(["--minutes", "1.5"])
    job = soak.chief_job("hybrid_sync", args)
    ref = run.job_for("hybrid_sync", run.parse_args([]), 2)
    assert job["role"] == "soak_chief" and job["duration_seconds"] == 90.0
    assert (job["global_batch"], job["steps_per_execution"]) == (1024, 8)
    assert job["model"] == ref["model"] and job["embedding_updates"] == "sync"
    assert job["steps_per_epoch"] == 128
    assert soak.chief_job("stock_pss", args)["setup"] == "stock_pss"
    assert job["epoch_pass"] is False


def test_epoch_pass_makes_every_epoch_one_pass_over_a_finite_pool():
    from benchmarks import model as model_lib

    args = soak.parse_args(["--epoch_pass", "--steps_per_epoch", "16", "--pool_batches", "16"])
    assert soak.chief_job("hybrid_sync", args)["epoch_pass"] is True
    spec = model_lib.ModelSpec.from_dict(soak.chief_job("hybrid_sync", args)["model"])
    finite = model_lib.make_dataset(spec, 4, 3, repeat=False)
    assert int(finite.cardinality()) == 3  # known: Keras can start each epoch over
    assert int(model_lib.make_dataset(spec, 4, 3).cardinality()) == -1  # repeated


def test_samples_read_proc_and_chief_progress():
    t0 = 1000.0
    lines = ["[chief] loading\n",
             '[chief] SOAK_PROGRESS {"epoch": -1, "steps": 0, "examples": 0, "t": 0, '
             '"mono": 1012.0, "loss": null}\n',
             '[chief] SOAK_PROGRESS {"epoch": 0, "steps": 128, "examples": 131072, "t": 8, '
             '"mono": 1020.0, "loss": 0.7}\n',
             '[chief] SOAK_PROGRESS {"epoch": 1, "steps": 256, "examples": 262144, "t": 12, '
             '"mono": 1024.0, "loss": 0.6}\n']
    points = soak.parse_progress(lines, t0)
    assert [p["t_s"] for p in points] == [12.0, 20.0, 24.0]
    sample = soak.take_sample("stock_pss", {"chief": os.getpid(), "ps:0": 2**22 + 7}, lines,
                              t0)
    assert set(sample["tasks"]) == {"chief"}  # The bogus pid is not alive.
    me = sample["tasks"]["chief"]
    assert me["threads"] >= 1 and me["fds"] >= 3 and me["rss_mb"] > 10
    assert sample["train_start_s"] == 12.0 and sample["first_epoch_end_s"] == 20.0
    assert sample["progress_t_s"] == 24.0
    assert sample["steps"] == 256 and sample["examples_per_sec"] == 131072 / 4.0
    json.dumps(sample)


def test_chart_is_a_png(tmp_path):
    leak = lambda task, t: 100 + int(t) if task.startswith("worker") else 80  # noqa: E731
    samples = _samples(threads=leak) + _samples(setup="stock_pss")
    path = stats.write_chart(samples, str(tmp_path / "sub" / "soak.png"),
                             {"hybrid_sync": WARMUP, "stock_pss": WARMUP})
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def _fake_run_setup(setup, args, log_dir, emit):
    samples = _samples(seconds=120.0, setup=setup)
    for s in samples:
        emit(s)
    failure = "task died: ps:1" if setup == "stock_pss" else None
    deaths = [{"role": "ps:1", "pid": 1, "t_s": 100.0, "exit_code": -9}] if failure else []
    return samples, stats.summarize(samples, setup, 20.0, task_deaths=deaths, failure=failure)


def test_main_prints_lines_continues_after_a_failed_setup_and_exits_1(monkeypatch, capsys,
                                                                        tmp_path):
    monkeypatch.setattr(soak, "run_setup", _fake_run_setup)
    out, chart = tmp_path / "soak.jsonl", tmp_path / "soak.png"
    code = soak.main(["--minutes", "2", "--setups", "stock_pss,hybrid_sync", "--output",
                      str(out), "--chart", str(chart), "--log_dir", str(tmp_path)])
    assert code == 1
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    summaries = [r for r in lines if r["kind"] == "soak_summary"]
    assert [(s["setup"], s["completed"]) for s in summaries] == [("stock_pss", False),
                                                                 ("hybrid_sync", True)]
    assert summaries[0]["task_deaths"][0]["role"] == "ps:1"
    assert summaries[1]["knobs"]["global_batch"] == 1024
    assert len(out.read_text().splitlines()) == len(lines)
    assert chart.stat().st_size > 0

    monkeypatch.setattr(soak, "run_setup", lambda *a: _fake_run_setup("hybrid_sync", *a[1:]))
    assert soak.main(["--quick", "--setups", "hybrid_sync", "--chart", "",
                      "--log_dir", str(tmp_path)]) == 0


def test_missing_matplotlib_skips_only_the_chart(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(soak, "run_setup", _fake_run_setup)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError.
    chart = tmp_path / "soak.png"
    code = soak.main(["--minutes", "2", "--setups", "hybrid_sync", "--chart", str(chart),
                      "--log_dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0 and not chart.exists()
    assert "pip install -e .[bench]" in captured.err
    assert any(json.loads(ln)["kind"] == "soak_summary" for ln in captured.out.splitlines())


def test_model_dir_summary_reports_max_and_last_and_none_without_checkpoints():
    post = [{"model_dir": {"files": 5, "mb": 300.0}}, {"model_dir": {"files": 16, "mb": 961.0}},
            {"model_dir": {"files": 11, "mb": 640.0}}]
    assert stats.model_dir_summary(post) == {"max_files": 16, "last_files": 11,
                                             "max_mb": 961.0, "last_mb": 640.0}
    assert stats.model_dir_summary([{"model_dir": None}, {}]) is None


def test_chief_job_passes_the_variant_and_capacity_through():
    args = soak.parse_args(["--minutes", "1", "--variant", "dynamic", "--capacity", "65536"])
    job = soak.chief_job("hybrid_sync", args)
    assert (job["model"]["variant"], job["model"]["capacity"]) == ("dynamic", 65536)


def test_chief_job_passes_the_dense_allreduce_dtype_through():
    from benchmarks import procs

    plain = soak.chief_job("hybrid_sync", soak.parse_args(["--minutes", "1"]))
    assert procs.strategy_options(plain)["dense_allreduce_dtype"] is None
    args = soak.parse_args(["--minutes", "1", "--dense_allreduce_dtype", "bfloat16"])
    job = soak.chief_job("hybrid_sync", args)
    assert procs.strategy_options(job)["dense_allreduce_dtype"] == "bfloat16"
    assert procs.strategy_kwargs(job)["dense_allreduce_dtype"] == "bfloat16"


def test_the_summary_records_the_strategy_options(monkeypatch):
    monkeypatch.setattr(soak, "_run_setup_once", lambda *a: ([], [], "no servers"))
    args = soak.parse_args(["--minutes", "1", "--dense_allreduce_dtype", "bfloat16"])
    _, summary = soak.run_setup("hybrid_sync", args, "/nonexistent", print)
    assert summary["strategy_options"]["dense_allreduce_dtype"] == "bfloat16"
    assert summary["strategy_options"]["stack_tables"] is True
    _, summary = soak.run_setup("stock_pss", args, "/nonexistent", print)
    assert summary["strategy_options"] is None  # Stock PSS takes no HybridOptions.
