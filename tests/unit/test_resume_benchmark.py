"""benchmarks/resume.py: arguments, chart, and one real mini run."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import resume

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments():
    args = resume.parse_args([])
    assert args.position_list == [1000, 10000, 50000] and args.batch == 16
    quick = resume.parse_args(["--quick"])
    assert quick.position_list == [1000, 50000] and quick.batch == 4
    with pytest.raises(SystemExit):
        resume.parse_args(["--positions", "0"])
    with pytest.raises(SystemExit):
        resume.parse_args(["--files", "1"])


def test_chart(tmp_path):
    records = [{"method": m, "position_steps": p, "first_step_seconds": 1.0}
               for m in ("skip", "restore") for p in (1000, 50000)]
    path = resume.write_chart(records, str(tmp_path / "c" / "resume.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.tf215_only  # Benchmarks run in .venv (TF 2.15); the code is the same on 2.21.
@pytest.mark.timeout(300)
def test_real_mini_run(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.resume", "--positions", "10,2000", "--batch", "2",
           "--log_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    runs = {(r["position_steps"], r["method"]): r for r in lines if r["kind"] == "resume"}
    assert set(runs) == {(10, "skip"), (10, "restore"), (2000, "skip"), (2000, "restore")}
    # Restoring the saved state gives exactly the batch that skipping reaches.
    assert all(r["same_batch"] for r in runs.values())
    assert runs[(2000, "restore")]["state_bytes"] > 0
    summary = [r for r in lines if r["kind"] == "resume_summary"][0]
    assert summary["same_batch"] is True
