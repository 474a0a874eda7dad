"""benchmarks/input.py: arguments, data files, chart, and one real mini run."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import input as input_bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments():
    args = input_bench.parse_args([])
    assert args.worker_counts == [2, 4, 8] and args.files == 16
    quick = input_bench.parse_args(["--quick"])
    assert quick.worker_counts == [2, 4] and quick.records_per_file == 5000
    with pytest.raises(SystemExit):
        input_bench.parse_args(["--workers", "8", "--files", "4"])  # fewer files than workers


def test_files_hold_every_record(tmp_path):
    import tensorflow as tf

    files = input_bench.write_files(str(tmp_path), 3, 7, 16)
    assert len(files) == 3
    assert sum(1 for _ in tf.data.TFRecordDataset(files)) == 21


def test_chart(tmp_path):
    records = [{"policy": p, "workers": w, "max_read_to_share": 1.0 if p == "auto" else w,
                "time_to_first_step_s": 2.0} for p in input_bench.POLICIES for w in (2, 4)]
    path = input_bench.write_chart(records, str(tmp_path / "c" / "input.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.tf215_only  # Benchmarks run in .venv (TF 2.15); the code is the same on 2.21.
@pytest.mark.timeout(240)
def test_real_mini_run(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.input", "--workers", "2", "--files", "4",
           "--records_per_file", "1500", "--batch", "64", "--log_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    by_policy = {r["policy"]: r for r in lines if r["kind"] == "input"}
    for r in by_policy.values():
        assert r["examples"] == r["records"] == 6000  # every record once per epoch
        assert r["time_to_first_step_s"] > 0
    # By file, each worker reads about its half; by batch, all of it.
    assert by_policy["auto"]["max_read_to_share"] < 1.3
    assert by_policy["by_batch"]["max_read_to_share"] > 1.8
