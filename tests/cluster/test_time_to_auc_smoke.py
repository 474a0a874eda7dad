"""A tiny real run of `benchmarks.time_to_auc` on loopback: is every JSON line complete?

Not a timing check (the seconds depend on the box): the default sync setup
and stock PSS (the baseline of every ratio) each train about a second on a
2-worker, 2-PS loopback cluster (hybrid_async differs from hybrid_sync by
one strategy argument; a third cluster would add ~80 s on a loaded box);
both are scored on a small held-out set, and the lines the run prints must
carry every field a reader of the results needs. The arithmetic is tested fast in tests/unit/test_time_to_auc.py.
"""

import json
import sys

import pytest

from tests.cluster import _cluster_util as cu

pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              # The benchmarks run in .venv (TF 2.15, benchmarks/README.md).
              pytest.mark.tf215_only]


@pytest.mark.timeout(400)
def test_loopback_run_prints_complete_lines(procs, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.time_to_auc", "--hosts", "loopback",
           "--setups", "hybrid_sync,stock_pss", "--workers", "2", "--max_seconds", "1", "--eval_every_steps", "10",
           "--eval_examples", "2048", "--timeout", "240", "--results_dir", str(tmp_path),
           "--name", "smoke", "--log_dir", str(tmp_path / "logs")]
    done = procs.run(cmd, timeout=380, cwd=cu.REPO_ROOT)
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert done.returncode == 0, done.stdout[-3000:]
    run = lines[0]
    assert run["kind"] == "time_to_auc_run" and run["options"]["max_seconds"] == 1.0
    evals = [r for r in lines if r["kind"] == "time_to_auc_eval"]
    summaries = [r for r in lines if r["kind"] == "time_to_auc_summary"]
    assert {r["setup"] for r in evals} == {"hybrid_sync", "stock_pss"}
    for r in evals:
        assert r["num_workers"] == 2 and r["seconds"] > 0 and r["eval_seconds"] >= 0
        assert 0.0 <= r["auc"] <= 1.0 and r["examples"] == r["global_steps"] * 512
        # Stock PSS: one worker's batch per step, twice the steps for the same examples.
        assert r["steps"] == r["global_steps"] * (2 if r["setup"] == "stock_pss" else 1)
    assert [s["setup"] for s in summaries] == ["hybrid_sync", "stock_pss"]
    for s in summaries:
        assert "error" not in s, s
        for field in ("reached", "seconds_to_target", "seconds_to", "max_auc", "train_seconds",
                      "ratio_to_stock_pss", "startup_seconds", "loadavg_start",
                      "tf_version", "strategy_options", "global_batch", "learning_rate"):
            assert field in s, (field, s)
        assert s["train_seconds"] >= 1.0 or s["reached"]  # Ran until the cap (or the target).
    assert (tmp_path / "smoke.jsonl").read_text(encoding="utf-8").count("\n") == len(lines)
    assert "| 2 | stock_pss |" in (tmp_path / "smoke.md").read_text(encoding="utf-8")
