"""Table stacking across a restart: a restored job trains on as the unstacked one does (issue 40).

A job with a frozen table, a second model in scope, Keras Adam and
`ChiefCheckpoint` is run twice on one model directory (a fresh run, then a
restart that restores it), stacked and unstacked. The restart restores, and
so makes the optimizer's slots, before any step is traced: the stacks must
be split per model and per trainability there as in the fresh run (else
Adam's one apply per stack would have to write the frozen table's rows
back each step, tests/cluster/test_stacked_fallback.py). Both jobs must end with the same weights; with
``use_ema`` too, whose averages and overwrites act per table, and with an
optimizer class stacking does not know (each table then has storage of its
own, which the placement report names), and with both models subclassed
(split at the trained model's first traced `__call__`, or before its slots).
"""

import os

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "stacked_resume.py")

pytestmark = [pytest.mark.cluster]


def _fresh_then_restart(shared_cluster, tmp_path, mode, variant):
    """Runs the job twice on one model_dir; returns the restart's weights."""
    cluster = shared_cluster(num_workers=1, num_ps=2)
    model_dir = tmp_path / mode / "model"
    for run in ("fresh", "restart"):
        out = tmp_path / mode / run
        out.mkdir(parents=True)
        result = cluster.run_chief(
            [cu.PYTHON, SCRIPT, mode, str(model_dir), str(out), variant], timeout=240)
        assert result.returncode == 0 and "DONE" in result.stdout, (mode, run,
                                                                   result.stdout[-6000:])
    return dict(np.load(str(tmp_path / mode / "restart" / "weights.npz")))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["adam", "build_slots", "ema", "custom", "subclassed",
                                     "subclassed_build_slots"])
def test_restart_of_stacked_job_trains_like_unstacked(shared_cluster, tmp_path, variant):
    stacked = _fresh_then_restart(shared_cluster, tmp_path, "stacked", variant)
    unstacked = _fresh_then_restart(shared_cluster, tmp_path, "unstacked", variant)
    assert sorted(stacked) == sorted(unstacked)
    for name, value in unstacked.items():
        np.testing.assert_allclose(stacked[name], value, atol=1e-5, rtol=0, err_msg=name)
    # The restart trained: the trainable table moved, the frozen one did not.
    assert not np.allclose(stacked["m_item/embeddings"], stacked["t_item/embeddings"])
    report = (tmp_path / "stacked" / "restart" / "placement.txt").read_text()
    # The trained model's three tables, made first (the report names them "embeddings").
    lines = [line for line in report.splitlines() if line.strip().startswith("table ")][:3]
    assert len(lines) == 3, report
    if variant == "custom":  # Each table alone, and the report says why.
        assert all("not stacked: optimizer MyAdam" in line for line in lines), report
    else:
        assert all("stacked in" in line for line in lines), report
