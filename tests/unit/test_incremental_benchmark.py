"""benchmarks/incremental.py: arguments, summary, chart, and one real mini run (with serving)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import incremental

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments():
    args = incremental.parse_args(["--quick"])
    assert (args.rows, args.dim, args.fraction_list) == (10_000_000, 16, [0.01, 0.1, 0.01])
    assert args.serving_poll_seconds == 0.5
    with pytest.raises(SystemExit):
        incremental.parse_args(["--serving_poll_seconds", "0"])
    with pytest.raises(SystemExit):
        incremental.parse_args(["--fractions", "0"])
    with pytest.raises(SystemExit):
        incremental.parse_args(["--rows", str(7919 * 100)])


def test_optimizer_option_and_recorded_options():
    assert incremental.parse_args([]).optimizer == "legacy.Adagrad"
    for name in ("legacy.Adagrad", "Adagrad", "LazyAdam"):
        args = incremental.parse_args(["--quick", "--optimizer", name, "--stack_tables", "false"])
        options = incremental.run_options(args)
        assert options["optimizer"] == name and name in options["optimizer_class"]
        assert options["stack_tables"] is False and options["full_every"] == 2
        assert options["fractions"] == [0.01, 0.1, 0.01]
    assert incremental.run_options(incremental.parse_args([]))["stack_tables"] is True
    with pytest.raises(SystemExit):
        incremental.parse_args(["--optimizer", "Adam"])  # Not row-local: refused by name.


def record(fraction, delta_bytes, delta_seconds, exact=True, freshness=2.0, served=True):
    return {"rows": 1000, "dim": 4, "touched_fraction": fraction, "full_bytes": 1000,
            "delta_bytes": delta_bytes, "full_seconds": 10.0, "delta_seconds": delta_seconds,
            "restore_exact": exact, "serving_freshness_seconds": freshness,
            "serving_exact": served}


def test_summary_checks_the_targets_at_the_smallest_fraction():
    ok = incremental.summary([record(0.1, 200, 3.0), record(0.01, 50, 1.0)])
    assert ok["at_fraction"] == 0.01 and ok["bytes_target_met"] and ok["seconds_target_met"]
    assert ok["restore_exact"] is True
    assert ok["serving_freshness_seconds"] == 2.0 and ok["freshness_target_met"]
    assert ok["serving_exact"] is True
    bad = incremental.summary([record(0.01, 51, 1.01, exact=False),
                               record(0.1, 50, 1.0, freshness=30.5, served=False)])
    assert not bad["bytes_target_met"] and not bad["seconds_target_met"]
    assert bad["restore_exact"] is False
    # Freshness: the worst fraction counts.
    assert bad["serving_freshness_seconds"] == 30.5 and not bad["freshness_target_met"]
    assert bad["serving_exact"] is False



def test_summary_takes_the_last_run_of_the_smallest_fraction():
    # The first 1% run traces the save functions (cold, 5.0 s); the last is warm.
    summary = incremental.summary([record(0.01, 50, 5.0), record(0.1, 200, 3.0),
                                   record(0.01, 50, 1.2)])
    assert summary["delta_to_full_seconds"] == 0.12 and not summary["seconds_target_met"]
    assert incremental.parse_args([]).fraction_list == [0.01, 0.1, 0.01]

def test_chart(tmp_path):
    path = incremental.write_chart([record(0.01, 50, 1.0), record(0.1, 200, 3.0)],
                                   str(tmp_path / "c" / "incremental.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.tf215_only  # Benchmarks run in .venv (TF 2.15); the code is the same on 2.21.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer,variables", [("legacy.Adagrad", 4), ("Adagrad", 5),
                                                 ("LazyAdam", 9)])
def test_real_mini_run(tmp_path, optimizer, variables):
    cmd = [sys.executable, "-m", "benchmarks.incremental", "--rows", "20000", "--dim", "4",
           "--fractions", "0.01,0.5", "--optimizer", optimizer, "--log_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    runs = {r["touched_fraction"]: r for r in lines if r["kind"] == "incremental"}
    assert set(runs) == {0.01, 0.5}
    # Every line records the run's options.
    for line in lines:
        assert (line["optimizer"], line["stack_tables"], line["full_every"]) == (
            optimizer, True, 2), line
    # Table rows only (slots' ids are not counted); the 20000-row table is stacked
    # (alone in its stack: the only table).
    assert runs[0.01]["delta_rows"] == 200 and runs[0.5]["delta_rows"] == 10000
    assert all(r["table_stacked"] for r in runs.values())
    # Every optimizer variable (step, table and dense slots) compared bit for bit.
    assert all(r["optimizer_variables"] == variables for r in runs.values()), runs
    assert all(r["restore_exact"] and r["restore_mismatches"] == [] for r in runs.values())
    assert runs[0.01]["delta_bytes"] < runs[0.5]["delta_bytes"] < runs[0.5]["full_bytes"]
    # A separate serving process answered with each step's rows.
    for run in runs.values():
        assert 0 < run["serving_freshness_seconds"] < 60, run
        assert run["serving_exact"] is True, run
    # The second fraction's full save was reloaded whole by the serving process.
    assert runs[0.01]["serving_reloaded"] is None
    assert [n.split("-")[0] for n in runs[0.5]["serving_reloaded"]] == ["ckpt"], runs[0.5]
    summary = [r for r in lines if r["kind"] == "incremental_summary"][0]
    assert summary["restore_exact"] is True and summary["serving_exact"] is True
    assert summary["freshness_target_met"] is True


@pytest.mark.slow
@pytest.mark.tf215_only
@pytest.mark.timeout(300)
def test_real_saves_run(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.incremental", "--saves", "20",
           "--log_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert line["kind"] == "incremental_saves" and line["last_kind"] == "delta"
    assert set(line["rss_mb_per_100_saves"]) == {"chief", "ps:0", "ps:1", "worker:0"}
